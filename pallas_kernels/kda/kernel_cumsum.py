"""Within-chunk cumsum of the KDA log-decay gates as a Pallas kernel.

The chunked KDA forward needs G = the inclusive cumsum of the gates g along
T within each chunk of C rows; the backward needs the reverse one (suffix
sums) of dG. Layout as in `pallas_op`: [B, Tp, F] f32 with F = H*K and
Tp = NC * C.

`chunk_cumsum` runs one program per [C, BF] block on the grid
(B, NC, F/BF), all parallel: one read and one write of every element. On TPU
it returns `chunk_cumsum_xla`, since Mosaic has no cumsum lowering.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_config import KernelConfig, is_pow2

_F32 = jnp.float32
_MAX_BLOCK_F = 128


def _check(g_btf, chunk_size: int) -> None:
  if g_btf.ndim != 3:
    raise ValueError(f"g_btf must be [B, Tp, F] (rank 3), got shape {g_btf.shape}")
  if jnp.dtype(g_btf.dtype) != jnp.dtype(_F32):
    raise ValueError(f"g_btf must be float32, got {g_btf.dtype}")
  if not isinstance(chunk_size, int) or not is_pow2(chunk_size):
    raise ValueError(f"chunk_size must be a power of two, got {chunk_size!r}")
  if g_btf.shape[1] % chunk_size:
    raise ValueError(f"Tp={g_btf.shape[1]} must be a multiple of chunk_size={chunk_size}")


def default_block_f(f: int) -> int:
  """The largest power of two dividing F, at most 128 (min(F, 128) for F = 2^n)."""
  return min(_MAX_BLOCK_F, f & -f)


def chunk_cumsum_xla(g_btf, chunk_size: int, *, reverse: bool = False):
  """Within-chunk (reverse) cumsum along T in XLA.

  Args:
    g_btf: [B, Tp, F] f32, Tp a multiple of `chunk_size`.
    chunk_size: C, the chunk length.
    reverse: suffix sums within each chunk instead of prefix sums.

  Returns:
    [B, Tp, F] f32: `lax.cumsum` over the C axis of a [B, NC, C, F] reshape.
  """
  _check(g_btf, chunk_size)
  b, tp, f = g_btf.shape
  g = g_btf.reshape(b, tp // chunk_size, chunk_size, f)
  return jax.lax.cumsum(g, axis=2, reverse=reverse).reshape(b, tp, f)


def _cumsum_kernel(x_ref, o_ref, *, reverse: bool):
  x = x_ref[...]
  c = jnp.cumsum(x, axis=0)
  if reverse:
    # The Triton lowering has forward cumsum only (it raises on reverse), and
    # a row flip does not lower either, so the suffix sum is total - prefix + x.
    # Its rounding differs from a sequential suffix sum by up to about
    # f32 eps times the chunk's total magnitude (a small suffix after a large
    # prefix keeps the prefix's absolute rounding error).
    c = jnp.sum(x, axis=0, keepdims=True) - c + x
  o_ref[...] = c


def chunk_cumsum(g_btf, chunk_size: int, *, reverse: bool = False, cfg: KernelConfig,
                 block_f: int | None = None):
  """Inclusive cumsum along T within each chunk of `chunk_size` rows.

  Args:
    g_btf: [B, Tp, F] f32 (F = H*K), Tp a multiple of `chunk_size`.
    chunk_size: C, a power of two.
    reverse: suffix sums within each chunk (the backward's dg from dG).
    cfg: the kernel config; its backend picks the lowering. On TPU ("tpu",
      "tpu_interpret") this returns `chunk_cumsum_xla` (Mosaic has no cumsum
      lowering); every other backend runs the Pallas kernel.
    block_f: F-width of a program's block, a power of two dividing F;
      default `default_block_f(F)` (128 for F = 2048).

  Returns:
    [B, Tp, F] f32. Forward: out[t] = sum of g over the chunk's rows <= t;
    reverse: over rows >= t, computed as chunk total - prefix + g (see
    `_cumsum_kernel` for its rounding).

  Raises:
    ValueError: wrong rank or dtype, Tp not a multiple of C, bad block_f.
  """
  _check(g_btf, chunk_size)
  b, tp, f = g_btf.shape
  if block_f is None:
    block_f = default_block_f(f)
  if not isinstance(block_f, int) or not is_pow2(block_f) or f % block_f:
    raise ValueError(f"block_f must be a power of two dividing F={f}, got {block_f!r}")
  if cfg.is_tpu:
    return chunk_cumsum_xla(g_btf, chunk_size, reverse=reverse)
  spec = pl.BlockSpec((None, chunk_size, block_f), lambda i, j, k: (i, j, k))
  return pl.pallas_call(
      functools.partial(_cumsum_kernel, reverse=reverse),
      grid=(b, tp // chunk_size, f // block_f),
      in_specs=[spec], out_specs=spec,
      out_shape=jax.ShapeDtypeStruct((b, tp, f), _F32),
      compiler_params=cfg.compiler_params("cumsum"),
      interpret=cfg.interpret, name="kda_chunk_cumsum",
  )(g_btf)
