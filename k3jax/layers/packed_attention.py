"""Causal attention over documents packed in a row through cuDNN's packed layout.

cuDNN's fused attention can take each row as a list of documents (their starts
and lengths) and run causal attention inside each one; it then never builds
or reads a [B, 1, T, T] mask, and skips the tiles between documents. jax
reaches this layout only through a private module,
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` (`q_offsets` /
`kv_offsets` beside per-document `q_seqlen` / `kv_seqlen`):
`jax.nn.dot_product_attention` takes one length per row. A private API may
change in any release, so `available()` is True only on the jax minor
versions this module was checked on (`TESTED_JAX`); elsewhere the attention
layer keeps the document mask. cuDNN runs the packed layout on Hopper and
later GPUs only (jax refuses it when tracing elsewhere).

Layout for M runs a row, in jax's convention:
  offsets_bm1 [B, M + 1] int32: the start of each run in its row; -1 for runs
    the row does not have, and always -1 in the last entry.
  lengths_bm [B, M] int32: each run's length; -1 for runs the row does not have.
jax compacts them over the batch into cuDNN's flat cumulative offsets; every
token lies in exactly one run (`Segments` covers each row with its runs,
padding included), so each query sees its own run, causally.

Memory: the softmax statistics the backward keeps grow from B H T to
B M H T float32.
"""
from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp

from k3jax.layers.segments import Segments

try:  # Private: the only route to cuDNN's packed layout in jax 0.11 (module docstring).
  from jax._src.cudnn import fused_attention_stablehlo as _cudnn_fa
except ImportError:  # moved or gone in another jax: the layer keeps the mask
  _cudnn_fa = None

# jax (major, minor) versions whose private packed-layout call this module was checked on.
TESTED_JAX = ((0, 11),)
# Whether `CausalSelfAttention(documents=None)` takes this path where it compiles. On because
# the one-GPU twins in tests/test_attention.py (`-m gpu`) pass, and the whole gpu_1b with the
# reset is faster than with the mask (docs/benchmarks.md, "Packed documents"); on the CPU only
# the layout's index arithmetic is checked. A mesh of more than one device keeps the mask
# (`k3jax.parallel.model_layout`) until the two-GPU twin runs.
DEFAULT_ON_GPU = True


def available() -> bool:
  """Whether this jax is one whose private packed-layout call was checked (`TESTED_JAX`)."""
  return _cudnn_fa is not None and tuple(jax.__version_info__[:2]) in TESTED_JAX


def cudnn_layout(segments: Segments) -> tuple[jax.Array, jax.Array]:
  """(offsets_bm1 [B, M + 1], lengths_bm [B, M]) int32 of `segments`' runs (module docstring).

  `Segments.offsets_bm` holds the run starts, then T for runs a row lacks;
  the overflow rule carries over (the M-th run reaches to the end of the row).
  """
  starts_bm1 = segments.offsets_bm
  length = segments.ids_bt.shape[1]
  used_bm = starts_bm1[:, :-1] < length  # a run starts before the row ends
  lengths_bm = jnp.where(used_bm, starts_bm1[:, 1:] - starts_bm1[:, :-1], -1)
  used_bm1 = jnp.pad(used_bm, ((0, 0), (0, 1)))
  return jnp.where(used_bm1, starts_bm1, -1), lengths_bm


def attend(q_bthk: jax.Array, k_btgk: jax.Array, v_btgk: jax.Array, offsets_bm1: jax.Array,
           lengths_bm: jax.Array) -> jax.Array:
  """Causal attention within each run: q [B, T, H, hd], k, v [B, T, KVH, hd] (16-bit,
  H a multiple of KVH) and the runs from `cudnn_layout` -> [B, T, H, hd]."""
  if not available():
    raise RuntimeError(f"cuDNN's packed layout is reached through a private jax module checked "
                       f"on jax {TESTED_JAX} only, not {jax.__version__}: use "
                       f"documents='mask'")
  return _cudnn_fa.dot_product_attention(
      q_bthk, k_btgk, v_btgk, q_seqlen=lengths_bm, kv_seqlen=lengths_bm,
      q_offsets=offsets_bm1, kv_offsets=offsets_bm1, scale=1.0 / math.sqrt(q_bthk.shape[-1]),
      mask_type=_cudnn_fa.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")


@functools.cache
def compiles(dtype_name: str, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
  """Whether the packed call and its gradient compile here for this head shape."""
  t, runs = 128, 2

  def shape(*dims, dtype=dtype_name):
    return jax.ShapeDtypeStruct(dims, jnp.dtype(dtype))

  def loss(q, k, v, offsets, lengths):
    return jnp.sum(attend(q, k, v, offsets, lengths).astype(jnp.float32))

  try:
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        shape(1, t, num_heads, head_dim), shape(1, t, num_kv_heads, head_dim),
        shape(1, t, num_kv_heads, head_dim), shape(1, runs + 1, dtype="int32"),
        shape(1, runs, dtype="int32")).compile()
    return True
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("cuDNN packed attention unavailable for %s heads=%d/%d dim=%d (%s); "
                    "documents keep the mask", dtype_name, num_heads, num_kv_heads, head_dim,
                    str(e).splitlines()[0][:200])
    return False
