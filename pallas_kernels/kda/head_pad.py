"""Zero-padding of the head widths K and V up to the kernels' power-of-two tiles.

The Pallas kernels (Triton tensors in particular) take power-of-two widths.
Any K, V <= MAX_PADDED_WIDTH is run at the next allowed width with

* q, k and g padded with zeros along K: a zero key channel never writes the
  state and a zero query channel never reads it, and a zero log-decay (a
  factor of 1) on a state row that stays zero changes nothing;
* v padded with zeros along V, and the initial state with zero rows and
  columns: the padded state columns then stay zero (their delta-rule error
  v - k^T S is zero), so the real outputs are exactly those at K, V;
* the outputs and final state sliced back; autodiff of the pad and slice
  gives the gradients of the real entries.

At allowed widths nothing is padded, so those calls run the same program as
without this module.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.kda import kernel_config

# Widest non-power-of-two head width padded inside the op.
MAX_PADDED_WIDTH = 256

# Narrowest K and V of the kernels: 8 (16 for K on the GPU, where K slices
# are dot dims of at least 16).
_MIN_WIDTH = 8
_MIN_TRITON_K = 16


def padded_widths(head_k: int, head_v: int, backend: str) -> tuple[int, int]:
  """(K', V'): the widths the kernels run at for head widths K, V on `backend`.

  Raises ValueError for a non-power-of-two width above MAX_PADDED_WIDTH.
  """
  out = []
  for name, n, low in (("K", head_k, _MIN_TRITON_K if backend == "triton" else _MIN_WIDTH),
                       ("V", head_v, _MIN_WIDTH)):
    if n < 1:
      raise ValueError(f"{name} must be >= 1, got {n}")
    if kernel_config.is_pow2(n) and n >= low:
      out.append(n)
      continue
    if n > MAX_PADDED_WIDTH:
      raise ValueError(f"{name} = {n} is not a power of two; the pallas kernels pad head widths "
                       f"up to {MAX_PADDED_WIDTH} only. Use a power of two, {name} <= "
                       f"{MAX_PADDED_WIDTH}, or implementation='xla'")
    out.append(max(low, 1 << (n - 1).bit_length()))
  return out[0], out[1]


def _pad_last(x, axis: int, width: int):
  extra = width - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def pad_heads(q, k, v, g, h0, head_k: int, head_v: int):
  """q, k, g [..., K] -> [..., K']; v [..., V] -> [..., V']; h0 [N, H, K, V] -> [N, H, K', V'].

  h0 may be None. Arrays already at the widths are returned as they are.
  """
  q, k, g = (_pad_last(x, -1, head_k) for x in (q, k, g))
  v = _pad_last(v, -1, head_v)
  if h0 is not None:
    h0 = _pad_last(_pad_last(h0, -2, head_k), -1, head_v)
  return q, k, v, g, h0


def unpad_outputs(o, ht, head_k: int, head_v: int):
  """o [B, T, H, V'] -> [..., V]; ht [N, H, K', V'] (or None) -> [N, H, K, V]."""
  if o.shape[-1] != head_v:
    o = o[..., :head_v]
  if ht is not None and ht.shape[-2:] != (head_k, head_v):
    ht = ht[..., :head_k, :head_v]
  return o, ht
