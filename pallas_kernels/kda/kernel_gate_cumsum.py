"""The bounded sigmoid gate fused into the within-chunk cumsum (Pallas), and its backward.

With `chunk_kda(..., gate_activation="bounded_sigmoid")` the op receives the
gate's pre-activation `raw` instead of the float32 log-decay g, and forms

    g = lower_bound * sigmoid(raw + bias)      (float32 math)
    G = within-chunk inclusive cumsum of g

in one pass: `raw` is read in its own dtype (bf16 in a bf16 model) and g is
never written. The backward turns dG into

    dg     = within-chunk reverse cumsum of dG
    draw   = dg * lower_bound * s (1 - s),   s = sigmoid(raw + bias)
             (the slope formed as sigmoid(x) sigmoid(-x), exact in both tails)
    dbias  = sum of draw over B and T

in one pass as well: draw is written in raw's dtype and each program also
writes its block's column sums of draw (float32), which XLA adds over B and
the chunks. Layouts as in `kernel_cumsum`: [B, Tp, F] with F = H*K, Tp = NC*C;
bias [F] float32.

Rows the op pads (time padding, unused varlen slots) hold raw = -inf, where
s = 0: g = 0 and draw = 0 there, as with an explicit zero gate.

On TPU both directions run as XLA (`gate_cumsum_xla`, `gate_cumsum_bwd_xla`;
Mosaic has no cumsum lowering); they are also the tests' references.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import kernel_cumsum
from pallas_kernels.kda.kernel_config import KernelConfig, is_pow2

_F32 = jnp.float32


def _check(raw_btf, bias_f, lower_bound, chunk_size: int) -> None:
  if raw_btf.ndim != 3:
    raise ValueError(f"raw_btf must be [B, Tp, F] (rank 3), got shape {raw_btf.shape}")
  if not jnp.issubdtype(raw_btf.dtype, jnp.floating):
    raise ValueError(f"raw_btf must be a floating array, got {raw_btf.dtype}")
  f = raw_btf.shape[-1]
  if bias_f.shape != (f,) or jnp.dtype(bias_f.dtype) != jnp.dtype(_F32):
    raise ValueError(f"bias_f must be [F] = [{f}] float32, got {bias_f.shape} {bias_f.dtype}")
  if not isinstance(lower_bound, float) or not lower_bound < 0:
    raise ValueError(f"lower_bound must be a negative python float, got {lower_bound!r}")
  if not isinstance(chunk_size, int) or not is_pow2(chunk_size):
    raise ValueError(f"chunk_size must be a power of two, got {chunk_size!r}")
  if raw_btf.shape[1] % chunk_size:
    raise ValueError(f"Tp={raw_btf.shape[1]} must be a multiple of chunk_size={chunk_size}")


def _sigmoid(x):
  """1 / (1 + e^-x), written out: relatively accurate in both tails on every backend
  (XLA's CPU logistic is off by a few percent below x ~ -30); 0 at x = -inf."""
  return 1.0 / (1.0 + jnp.exp(-x))


def _sigmoid_slope(x):
  """s (1 - s) for s = sigmoid(x), as sigmoid(x) sigmoid(-x): 1 - s would round to 0 for
  x above ~17 in f32, where the slope is still ~e^-x. 0 at x = -inf."""
  return _sigmoid(x) * _sigmoid(-x)


def bounded_sigmoid(raw, bias, lower_bound: float):
  """g = lower_bound * sigmoid(raw + bias) in float32 (raw any float dtype, bias broadcastable)."""
  return lower_bound * _sigmoid(raw.astype(_F32) + bias.astype(_F32))




def gate_cumsum_xla(raw_btf, bias_f, lower_bound: float, chunk_size: int):
  """XLA form of `gate_cumsum`: [B, Tp, F] raw, [F] bias -> [B, Tp, F] f32 G."""
  _check(raw_btf, bias_f, lower_bound, chunk_size)
  g = bounded_sigmoid(raw_btf, bias_f, lower_bound)
  return kernel_cumsum.chunk_cumsum_xla(g, chunk_size)


def gate_cumsum_bwd_xla(dg_cum_btf, raw_btf, bias_f, lower_bound: float, chunk_size: int):
  """XLA form of `gate_cumsum_bwd`: (draw [B, Tp, F] in raw's dtype, dbias [F] f32)."""
  _check(raw_btf, bias_f, lower_bound, chunk_size)
  dg = kernel_cumsum.chunk_cumsum_xla(dg_cum_btf.astype(_F32), chunk_size, reverse=True)
  draw = dg * (lower_bound * _sigmoid_slope(raw_btf.astype(_F32) + bias_f))
  return draw.astype(raw_btf.dtype), jnp.sum(draw, axis=(0, 1))


def _fwd_kernel(raw_ref, bias_ref, o_ref, *, lower_bound: float):
  c, bf = raw_ref.shape
  bias = bias_ref[...]

  def load(r):
    return lower_bound * _sigmoid(raw_ref[pl.ds(r, 1), :].astype(_F32) + bias), None

  def store(r, acc, _, carry):
    o_ref[pl.ds(r, 1), :] = acc
    return carry

  kernel_cumsum.scan_rows(c, bf, load, store)


def _bwd_kernel(dg_cum_ref, raw_ref, bias_ref, draw_ref, dbias_ref, *, lower_bound: float):
  c, bf = raw_ref.shape
  bias = bias_ref[...]

  def load(r):
    return dg_cum_ref[pl.ds(r, 1), :], raw_ref[pl.ds(r, 1), :]

  def store(r, dg, raw, dbias):
    # dg is the suffix sum of dG (the rows are scanned in reverse).
    draw = dg * (lower_bound * _sigmoid_slope(raw.astype(_F32) + bias))
    draw_ref[pl.ds(r, 1), :] = draw.astype(draw_ref.dtype)
    return dbias + draw

  # dbias [1, BF] f32: the column sums of draw.
  dbias = kernel_cumsum.scan_rows(c, bf, load, store, reverse=True,
                                  carry=jnp.zeros((1, bf), _F32))
  dbias_ref[...] = jnp.sum(dbias, axis=0)


def gate_cumsum(raw_btf, bias_f, lower_bound: float, chunk_size: int, *, cfg: KernelConfig,
                block_f: int | None = None):
  """G = within-chunk cumsum of lower_bound * sigmoid(raw + bias), one pass.

  Args:
    raw_btf: [B, Tp, F] gate pre-activations, any float dtype (read as is).
    bias_f: [F] float32, added to raw before the sigmoid.
    lower_bound: g_min < 0 (python float).
    chunk_size: C, a power of two dividing Tp.
    cfg: kernel config; a TPU backend returns `gate_cumsum_xla`.
    block_f: F-width of a program's block (default `kernel_cumsum.default_block_f`).

  Returns:
    [B, Tp, F] float32 G.
  """
  _check(raw_btf, bias_f, lower_bound, chunk_size)
  b, tp, f = raw_btf.shape
  block_f = kernel_cumsum.block_width(f, block_f)
  if cfg.is_tpu:
    return gate_cumsum_xla(raw_btf, bias_f, lower_bound, chunk_size)
  tile = pl.BlockSpec((None, chunk_size, block_f), lambda i, j, k: (i, j, k))
  row = pl.BlockSpec((1, block_f), lambda i, j, k: (0, k))
  return pl.pallas_call(
      functools.partial(_fwd_kernel, lower_bound=lower_bound),
      grid=(b, tp // chunk_size, f // block_f),
      in_specs=[tile, row], out_specs=tile,
      out_shape=jax.ShapeDtypeStruct((b, tp, f), _F32),
      compiler_params=cfg.compiler_params("cumsum"),
      interpret=cfg.interpret, name="kda_gate_cumsum",
  )(raw_btf, bias_f[None])


def spec_gate_cumsum(raw_btf, bias_f, spec, *, cfg: KernelConfig):
  """`gate_cumsum` with the bound and chunk size of `spec` (a bounded `KdaSpec`)."""
  return gate_cumsum(raw_btf, bias_f, spec.lower_bound, spec.chunk_size, cfg=cfg)


def gate_cumsum_bwd(dg_cum_btf, raw_btf, bias_f, lower_bound: float, chunk_size: int, *,
                    cfg: KernelConfig, block_f: int | None = None):
  """Backward of `gate_cumsum`: dG -> (draw, dbias), one pass over dG and raw.

  Args:
    dg_cum_btf: [B, Tp, F] float32 cotangent of G.
    raw_btf, bias_f, lower_bound, chunk_size, cfg, block_f: as in `gate_cumsum`.

  Returns:
    draw [B, Tp, F] in raw's dtype; dbias [F] float32 (the programs' column
    sums, added over B and the chunks by XLA).
  """
  _check(raw_btf, bias_f, lower_bound, chunk_size)
  if dg_cum_btf.shape != raw_btf.shape or jnp.dtype(dg_cum_btf.dtype) != jnp.dtype(_F32):
    raise ValueError(f"dg_cum_btf must be float32 of raw's shape {raw_btf.shape}, got "
                     f"{dg_cum_btf.shape} {dg_cum_btf.dtype}")
  b, tp, f = raw_btf.shape
  block_f = kernel_cumsum.block_width(f, block_f)
  if cfg.is_tpu:
    return gate_cumsum_bwd_xla(dg_cum_btf, raw_btf, bias_f, lower_bound, chunk_size)
  nc = tp // chunk_size
  tile = pl.BlockSpec((None, chunk_size, block_f), lambda i, j, k: (i, j, k))
  row = pl.BlockSpec((1, block_f), lambda i, j, k: (0, k))
  partial = pl.BlockSpec((None, None, block_f), lambda i, j, k: (i, j, k))
  draw, dbias_bnf = pl.pallas_call(
      functools.partial(_bwd_kernel, lower_bound=lower_bound),
      grid=(b, nc, f // block_f),
      in_specs=[tile, tile, row], out_specs=[tile, partial],
      out_shape=[jax.ShapeDtypeStruct((b, tp, f), raw_btf.dtype),
                 jax.ShapeDtypeStruct((b, nc, f), _F32)],
      compiler_params=cfg.compiler_params("cumsum"),
      interpret=cfg.interpret, name="kda_gate_cumsum_bwd",
  )(dg_cum_btf, raw_btf, bias_f[None])
  return draw, jnp.sum(dbias_bnf, axis=(0, 1))


def spec_gate_cumsum_bwd(dg_cum_btf, raw_btf, bias_f, spec, *, cfg: KernelConfig):
  """`gate_cumsum_bwd` with the bound and chunk size of `spec` (a bounded `KdaSpec`)."""
  return gate_cumsum_bwd(dg_cum_btf, raw_btf, bias_f, spec.lower_bound, spec.chunk_size,
                         cfg=cfg)
