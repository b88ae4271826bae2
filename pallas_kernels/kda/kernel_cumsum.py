"""Within-chunk cumsum of the KDA log-decay gates as a Pallas kernel.

The chunked KDA forward needs G = the inclusive cumsum of the gates g along
T within each chunk of C rows; the backward needs the reverse one (suffix
sums) of dG. Layout as in `pallas_op`: [B, Tp, F] f32 with F = H*K and
Tp = NC * C.

`chunk_cumsum` runs one program per [C, BF] block on the grid
(B, NC, F/BF), all parallel: one read and one write of every element. On TPU
it returns `chunk_cumsum_xla`, since Mosaic has no cumsum lowering.

Every GPU kernel here (and in `kernel_gate_cumsum`) sums the block's rows one
[1, BF] row at a time (`scan_rows`): each thread keeps its columns' running
sum in registers, so nothing crosses threads. A scan over the rows of the
whole [C, BF] tile (`jnp.cumsum(axis=0)`, Triton's tl.cumsum) spreads the rows
over warps and exchanges partial sums through shared memory; with the clamp's
flag reduction on top it took 240 registers and ran at 2.0 TB/s on the H200,
where the row scan runs at the copy rate (docs/benchmarks.md, "Gate cumsum
kernels"). The sums are sequential in row order, as numpy's cumsum, and the
reverse one is a true suffix sum.

`clamped_cumsum` and `clamped_cumsum_bwd` are the same passes with
`chunk_kda`'s safety clamp of traced gates folded in: G is the cumsum of g
clamped into [lower_bound, 0], and dg is zero where g lay outside that range
(gradient 1 on the closed interval). The clamp costs no memory traffic: the
forward applies it to the gates it already reads, and the record the backward
needs is a per-program flag [B, NC, F/BF] int32 (1: the block holds an
out-of-range gate) plus an int8 mask [B, Tp, F] that only flagged programs
write and only flagged programs read, so valid gates never touch it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_config import KernelConfig, is_pow2

_F32 = jnp.float32
# Widest block: at 256 columns and 4 warps each thread loads two floats per row.
_MAX_BLOCK_F = 256
# Rows loaded before the first of them is stored (see `scan_rows`).
ROW_GROUP = 8


def clamp_gates(g: jax.Array, lower_bound: float) -> jax.Array:
  """g clamped into [lower_bound, 0]; any shape.

  Unlike `jnp.clip`, the gradient is 1 on the closed interval (a gate exactly
  at the bound keeps its full gradient) and 0 outside it.
  """
  g = jnp.where(g < lower_bound, jnp.asarray(lower_bound, g.dtype), g)
  return jnp.where(g > 0, jnp.zeros((), g.dtype), g)


def out_of_range(g: jax.Array, lower_bound: float) -> jax.Array:
  """Where `clamp_gates` changes g and passes no gradient: g < lower_bound or g > 0."""
  return (g < lower_bound) | (g > 0)


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
  """The largest power of two dividing F, at most 256 (min(F, 256) for F = 2^n)."""
  return min(_MAX_BLOCK_F, f & -f)


def block_width(f: int, block_f: int | None) -> int:
  """A program's F-width: `block_f` checked (a power of two dividing F), or the default."""
  if block_f is None:
    return default_block_f(f)
  if not isinstance(block_f, int) or not is_pow2(block_f) or f % block_f:
    raise ValueError(f"block_f must be a power of two dividing F={f}, got {block_f!r}")
  return block_f


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


def scan_rows(num_rows: int, width: int, load_row, store_row, *, reverse: bool = False,
              carry=None):
  """Running sum over a block's rows, one [1, BF] row at a time (in a Pallas kernel).

  For r in row order (reversed with `reverse`): acc += x_r, then
  carry = `store_row(r, acc, extra_r, carry)`, where `(x_r, extra_r) =
  load_row(r)`; x_r is the row's f32 summand and extra_r whatever else the
  store needs from row r. A loop over groups of ROW_GROUP rows, each group
  loaded before any of its rows is stored: a load may not move past a store to
  another ref (the compiler cannot tell they do not alias), so loading each row
  just before its sum would leave one load per thread in flight. The loop (not
  a Python unroll of all C rows) keeps the Triton IR small: unrolled, the
  clamped kernel's IR made pip Triton 3.6's TTGIR passes run for minutes.

  Args:
    num_rows: C, the block's rows (static).
    width: BF, the block's columns (static).
    load_row: r (traced int32) -> (x_r [1, BF] f32, extra_r).
    store_row: (r, acc [1, BF] f32, extra_r, carry) -> carry.
    reverse: suffix sums (rows C-1 down to 0).
    carry: initial value of the loop state store_row threads through.

  Returns:
    The final carry.
  """
  group = min(ROW_GROUP, num_rows)
  num_groups = num_rows // group

  def body(j, state):
    acc, carry = state
    if reverse:
      start = (num_groups - 1 - j) * group
      rows = [start + i for i in reversed(range(group))]
    else:
      rows = [j * group + i for i in range(group)]
    loaded = [load_row(r) for r in rows]
    for r, (x, extra) in zip(rows, loaded):
      acc = acc + x
      carry = store_row(r, acc, extra, carry)
    return acc, carry

  return jax.lax.fori_loop(0, num_groups, body, (jnp.zeros((1, width), _F32), carry))[1]


def _row(r):
  """Index of row r (int or traced int32) of a [C, BF] block ref, as a [1, BF] slice."""
  return pl.ds(r, 1), slice(None)


def _load(ref):
  """load_row for `scan_rows`: row r of ref, nothing else."""
  return lambda r: (ref[_row(r)], None)


def _store(ref):
  """store_row for `scan_rows`: the running sum into row r of ref."""
  def store(r, acc, _, carry):
    ref[_row(r)] = acc
    return carry
  return store


def _cumsum_kernel(x_ref, o_ref, *, reverse: bool):
  c, bf = x_ref.shape
  scan_rows(c, bf, _load(x_ref), _store(o_ref), reverse=reverse)


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
      default `default_block_f(F)` (256 for F = 2048).

  Returns:
    [B, Tp, F] f32. Forward: out[t] = sum of g over the chunk's rows <= t;
    reverse: over rows >= t. Summed in sequence, row by row (`scan_rows`).

  Raises:
    ValueError: wrong rank or dtype, Tp not a multiple of C, bad block_f.
  """
  _check(g_btf, chunk_size)
  b, tp, f = g_btf.shape
  block_f = block_width(f, block_f)
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


def clamped_cumsum_xla(g_btf, lower_bound: float, chunk_size: int):
  """XLA form of `clamped_cumsum` (TPU, and the tests' reference).

  Returns (G [B, Tp, F] f32, (None, mask [B, Tp, F] int8)): no flags, the
  mask is written everywhere (XLA fuses it with the cumsum's read of g).
  """
  mask = out_of_range(g_btf, lower_bound).astype(jnp.int8)
  return chunk_cumsum_xla(clamp_gates(g_btf, lower_bound), chunk_size), (None, mask)


def clamped_cumsum_bwd_xla(dg_cum_btf, record, chunk_size: int):
  """XLA form of `clamped_cumsum_bwd`; record as `clamped_cumsum_xla` returns it."""
  _, mask = record
  dg = chunk_cumsum_xla(dg_cum_btf, chunk_size, reverse=True)
  return jnp.where(mask != 0, jnp.zeros((), dg.dtype), dg)


def _clamped_cumsum_kernel(g_ref, o_ref, *record_refs, lower_bound: float):
  c, bf = g_ref.shape

  def load(r):
    g = g_ref[_row(r)]
    return clamp_gates(g, lower_bound), out_of_range(g, lower_bound).astype(jnp.int32)

  def store(r, acc, outside, hit):
    o_ref[_row(r)] = acc
    return jnp.maximum(hit, outside)

  # hit [1, BF]: 1 where a row so far had its gate outside [lower_bound, 0].
  hit = scan_rows(c, bf, load, store, carry=jnp.zeros((1, bf), jnp.int32))
  if record_refs:
    flag_ref, mask_ref = record_refs
    # One axis at a time: the Triton lowering's multi-axis reduction fails
    # under an abstract mesh (jax.export for CUDA from a CPU host).
    flag = jnp.max(jnp.max(hit, axis=1), axis=0)
    flag_ref[...] = flag

    @pl.when(flag != 0)
    def _():
      def write(r, carry):
        mask_ref[_row(r)] = out_of_range(g_ref[_row(r)], lower_bound).astype(jnp.int8)
        return carry
      jax.lax.fori_loop(0, c, write, 0)


def _clamped_reverse_kernel(x_ref, flag_ref, mask_ref, o_ref):
  c, bf = x_ref.shape

  def store_masked(r, acc, mask, carry):
    o_ref[_row(r)] = jnp.where(mask != 0, 0.0, acc)
    return carry

  flagged = flag_ref[...] != 0

  # The mask is loaded only where flagged.
  @pl.when(jnp.logical_not(flagged))
  def _():
    scan_rows(c, bf, _load(x_ref), _store(o_ref), reverse=True)

  @pl.when(flagged)
  def _():
    scan_rows(c, bf, lambda r: (x_ref[_row(r)], mask_ref[_row(r)]), store_masked, reverse=True)


def _block_specs(f: int, chunk_size: int, block_f: int | None):
  """(block_f, the [C, BF] tile's BlockSpec, the per-program flag's)."""
  block_f = block_width(f, block_f)
  tile = pl.BlockSpec((None, chunk_size, block_f), lambda i, j, k: (i, j, k))
  flag = pl.BlockSpec((None, None, None), lambda i, j, k: (i, j, k))
  return block_f, tile, flag


def clamped_cumsum(g_btf, lower_bound: float, chunk_size: int, *, cfg: KernelConfig,
                   with_record: bool = False, block_f: int | None = None):
  """G = within-chunk cumsum of g clamped into [lower_bound, 0], in one pass.

  Args:
    g_btf: [B, Tp, F] f32 log-decays (any values; NaN passes through).
    lower_bound: g_min < 0 (python float).
    chunk_size: C, a power of two dividing Tp.
    cfg: kernel config; a TPU backend returns `clamped_cumsum_xla`.
    with_record: also return what `clamped_cumsum_bwd` needs (training).
    block_f: F-width of a program's block (default `default_block_f`).

  Returns:
    G [B, Tp, F] f32, or (G, record) with record = (flags [B, NC, F/BF]
    int32, mask [B, Tp, F] int8 written only in flagged blocks).
  """
  _check(g_btf, chunk_size)
  if not isinstance(lower_bound, float) or not lower_bound < 0:
    raise ValueError(f"lower_bound must be a negative python float, got {lower_bound!r}")
  b, tp, f = g_btf.shape
  block_f, tile, flag = _block_specs(f, chunk_size, block_f)
  if cfg.is_tpu:
    g_cum, record = clamped_cumsum_xla(g_btf, lower_bound, chunk_size)
    return (g_cum, record) if with_record else g_cum
  nc = tp // chunk_size
  out_specs, out_shape = [tile], [jax.ShapeDtypeStruct((b, tp, f), _F32)]
  if with_record:
    out_specs += [flag, tile]
    out_shape += [jax.ShapeDtypeStruct((b, nc, f // block_f), jnp.int32),
                  jax.ShapeDtypeStruct((b, tp, f), jnp.int8)]
  outs = pl.pallas_call(
      functools.partial(_clamped_cumsum_kernel, lower_bound=lower_bound),
      grid=(b, nc, f // block_f), in_specs=[tile], out_specs=out_specs, out_shape=out_shape,
      compiler_params=cfg.compiler_params("cumsum"),
      interpret=cfg.interpret, name="kda_clamped_cumsum",
  )(g_btf)
  return (outs[0], tuple(outs[1:])) if with_record else outs[0]


def spec_clamped_cumsum(g_btf, spec, *, cfg: KernelConfig, with_record: bool = False):
  """`clamped_cumsum` with the bound and chunk size of `spec` (a bounded `KdaSpec`)."""
  return clamped_cumsum(g_btf, spec.lower_bound, spec.chunk_size, cfg=cfg,
                        with_record=with_record)


def clamped_cumsum_bwd(dg_cum_btf, record, chunk_size: int, *, cfg: KernelConfig,
                       block_f: int | None = None):
  """dg = within-chunk reverse cumsum of dG, zero where the forward clamped g.

  Args:
    dg_cum_btf: [B, Tp, F] f32 cotangent of G.
    record: the forward's record (`clamped_cumsum(..., with_record=True)`),
      with the same block_f.
    chunk_size, cfg, block_f: as in `clamped_cumsum`.

  Returns:
    dg [B, Tp, F] f32.
  """
  _check(dg_cum_btf, chunk_size)
  if cfg.is_tpu:
    return clamped_cumsum_bwd_xla(dg_cum_btf, record, chunk_size)
  b, tp, f = dg_cum_btf.shape
  block_f, tile, flag = _block_specs(f, chunk_size, block_f)
  flags, mask = record
  if flags.shape != (b, tp // chunk_size, f // block_f) or mask.shape != dg_cum_btf.shape:
    raise ValueError(f"record shapes {flags.shape}, {mask.shape} do not match dG "
                     f"{dg_cum_btf.shape} with block_f={block_f}")
  return pl.pallas_call(
      _clamped_reverse_kernel,
      grid=(b, tp // chunk_size, f // block_f), in_specs=[tile, flag, tile], out_specs=tile,
      out_shape=jax.ShapeDtypeStruct((b, tp, f), _F32),
      compiler_params=cfg.compiler_params("cumsum"),
      interpret=cfg.interpret, name="kda_clamped_cumsum_bwd",
  )(dg_cum_btf, flags, mask)
