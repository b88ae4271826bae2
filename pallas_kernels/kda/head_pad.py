"""Zero-padding of the head widths K and V that the kernels do not run as they are.

Which widths the kernels run is `kernel_config.width_rule`'s:

* GPU (and interpret mode): powers of two, and any multiple of 16 through
  power-of-two slices inside the kernels (no copy). Other widths are padded
  to the next width it takes (a multiple of 16, or a power of two below 16);
  with the whole-tile bodies (sub_chunk < 16) to the next power of two.
* TPU: powers of two, and multiples of 128 when H > 1 (Mosaic blocks of the
  [B, T, H*K] layout span 128 lanes or the whole array), so with H > 1 a
  narrower width is padded to 128.

A width is padded with

* q, k and g padded with zeros along K: a zero key channel never writes the
  state and a zero query channel never reads it, and a zero log-decay (a
  factor of 1) on a state row that stays zero changes nothing;
* v padded with zeros along V, and the initial state with zero rows and
  columns: the padded state columns then stay zero (their delta-rule error
  v - k^T S is zero), so the real outputs are exactly those at K, V;
* the outputs and final state sliced back; autodiff of the pad and slice
  gives the gradients of the real entries.

At widths the kernels run nothing is padded, so those calls run the same
program as without this module.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.kda import kernel_config

# Widest head width padded inside the op (every backend runs 256 as it is).
MAX_PADDED_WIDTH = 256


def padded_widths(head_k: int, head_v: int, backend: str, *, heads: int = 1,
                  sliced: bool = True) -> tuple[int, int]:
  """(K', V'): the widths the kernels run at for head widths K, V on `backend`.

  Each is the narrowest width >= the given one that `kernel_config.width_rule`
  accepts for `heads` (H) and `sliced` bodies (`kernel_config.sliced_bodies`).

  Raises ValueError for a width the kernels do not run above MAX_PADDED_WIDTH.
  """
  out = []
  for name, n in (("K", head_k), ("V", head_v)):
    if n < 1:
      raise ValueError(f"{name} must be >= 1, got {n}")
    rule = lambda w: kernel_config.width_rule(name, w, backend=backend, heads=heads,
                                              sliced=sliced)
    reason = rule(n)
    if reason is None:
      out.append(n)
      continue
    if n > MAX_PADDED_WIDTH:
      raise ValueError(f"{reason}; the pallas kernels pad head widths up to "
                       f"{MAX_PADDED_WIDTH} only. Use a width they run as it is "
                       f"(kernel_config.width_rule), {name} <= {MAX_PADDED_WIDTH}, or "
                       "implementation='xla'")
    out.append(next(w for w in range(n, MAX_PADDED_WIDTH + 1) if rule(w) is None))
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
