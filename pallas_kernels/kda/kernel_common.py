"""In-kernel helpers shared by the Pallas KDA stages.

* matmuls and exponentials: `dot`, `exp`, `iota`, `add_all`; static slices
  of the head widths: `k_slices`, `width_slices`;
* the anchored decay factors of a row sub-tile (`tile_factors`) and of the
  pairwise diagonal's levels (`pair_levels`, `level_factors`, `level_decay`,
  `level_pairs`, `anchor_picker`, `same_block`);
* BlockSpecs of the per-chunk kernels (`chunk_specs`) and the grid of the
  state kernels (`state_grid`, `state_launch_options`);
* the score gradients shared by both intra backward bodies
  (`add_score_grads`, `state_decay_grad`).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda.kernel_config import KernelConfig, pow2_part

_F32 = jnp.float32


class IntraBwdOut(NamedTuple):
  """Outputs of both intra backward bodies: dq, dk [B, Tp, H*K] (dq w.r.t.
  the unscaled q) and dv [B, Tp, H*V] in the caller's grad_dtype; dg
  [B, Tp, H*K] f32 (w.r.t. the within-chunk cumsum G); dbeta [B, H, Tp, 1] f32."""
  dq: jax.Array
  dk: jax.Array
  dv: jax.Array
  dg: jax.Array
  dbeta: jax.Array


def run_codes(run_bnc, carry_bnc, last_bnc):
  """The kernels' run inputs (`segment_ids`), from the [B, NC, C] run indices
  and carry / last flags of `tiling.RunMasks`: per position code = 4 run +
  2 carry + last as a column [B, Tp, 1] int32, and the runs as one [1, C]
  row per chunk, [B, NC, 1, C] int32 (a chunk's row block is then whole in
  its last two dims, as TPU blocks must be)."""
  b, nc, c = run_bnc.shape
  code = run_bnc * 4 + carry_bnc.astype(jnp.int32) * 2 + last_bnc.astype(jnp.int32)
  return (code.reshape(b, nc * c, 1).astype(jnp.int32),
          run_bnc[:, :, None, :].astype(jnp.int32))


class RunFlags(NamedTuple):
  """One chunk's run masks inside a kernel (`tiling.RunMasks`), for R of its rows.

  same [R, C] bool (run_i == run_j; None without the run row); carry, last
  [R, 1] bool (the row reads the incoming state; the row is in the chunk's
  last run); carry_last [1, 1] bool (the chunk's last row carries: the
  state leaving it keeps e^{G_last} S)."""
  same: jax.Array | None
  carry: jax.Array
  last: jax.Array
  carry_last: jax.Array


def run_flags(code_ref, run_ref=None, rows=None, last_row=None) -> RunFlags:
  """The masks of rows `rows` (all when None) of a chunk from its code ref
  [C, 1] and run ref [1, C] (`run_codes`' blocks). `last_row`: the index of
  the chunk's last row in `code_ref` (None: the ref's last row), for refs
  that hold several chunks."""
  code = code_ref[...] if rows is None else code_ref[rows, :]
  if last_row is None:
    last_row = pl.ds(code_ref.shape[0] - 1, 1)
  code_last = code_ref[last_row, :]
  same = None if run_ref is None else jnp.right_shift(code, 2) == run_ref[...]
  return RunFlags(same=same, carry=jnp.bitwise_and(code, 2) != 0,
                  last=jnp.bitwise_and(code, 1) != 0,
                  carry_last=jnp.bitwise_and(code_last, 2) != 0)


def keep_rows(x, rows):
  """x with the rows where `rows` ([R, 1] bool) is False zeroed; x itself when rows is None."""
  return x if rows is None else jnp.where(rows, x, 0.0)


def dot(a, b, cfg: KernelConfig, *, ta: bool = False, tb: bool = False, dtype=None):
  """a @ b (a^T if ta, b^T if tb) with f32 accumulation; operands cast to `dtype`.

  `dtype` defaults to cfg.mm_dtype; pass float32 for matmuls that must be
  f32-accurate (one-hot embeddings).
  """
  dtype = cfg.mm_dtype if dtype is None else dtype
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return lax.dot_general(a.astype(dtype), b.astype(dtype), dims,
                         precision=cfg.dot_precision(dtype),
                         preferred_element_type=_F32)


def iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


_LOG2_E = 1.4426950408889634


# Power of two carried by the anchored decay factors of a row tile
# (`tile_factors`): the row factor e^{G_i - a} (down to e^-85 in a dense
# diagonal tile) times 2^DIAG_SHIFT, the column factor e^{a - G_j} (up to
# e^85) times 2^-DIAG_SHIFT; their products are unchanged. Unshifted, a row
# operand x e^{G_i - a} underflowed f32's (and bf16's) smallest normal,
# 1.18e-38, for every entry |x| < 1.18e-38 e^85 = 0.097, losing own-tile
# terms as large as x itself (30% error in o at |g_min| (L - 1) = 84, f32).
# Shifted, only entries below 1.18e-38 e^85 2^-29 = 1.8e-10 can; the column
# factor stays below e^85 2^-29 = 1.5e28, and an off-diagonal column factor
# (<= 2^-29) underflows only where its term is below 2^-97 of the operands.
DIAG_SHIFT = 29


def exp(x, shift: int = 0):
  """e^x 2^shift as 2^(x log2 e + shift), for every exponential inside the kernels.

  The Triton lowering maps jnp.exp to libdevice's expf, about 9 SASS
  instructions per element, and exp2 to one MUFU.EX2 plus a few. The extra
  rounding of x log2 e (+ shift) is a relative error of about
  2^-24 |x log2 e + shift|: below 1e-5 even for the largest dense diagonal
  factor (|x| <= 85, `spec.MAX_EXP_ARG`). `shift` (an int) scales by an
  exact power of two inside the exponent (`DIAG_SHIFT`).
  """
  return jnp.exp2(x * _LOG2_E + shift) if shift else jnp.exp2(x * _LOG2_E)


def shifted_pair(d, shift: int = DIAG_SHIFT):
  """(e^d 2^shift, e^-d 2^-shift) from one exponent, t = d log2 e + shift:
  2^t and 2^-t (a row factor and its tile's column factor, `DIAG_SHIFT`)."""
  t = d * _LOG2_E + shift
  return jnp.exp2(t), jnp.exp2(-t)


def k_slices(cfg: KernelConfig, dk: int, width: int | None = None) -> list:
  """Static `pl.ds` K slices of at most `width` (default cfg.block_k) channels
  covering K = dk (`width_slices`: width each at a power of two K, 64 + 32 at
  K = 96 and width 64).

  The blocked intra forward, the state kernels and the split intra backward
  do every per-channel (K) element-wise operation on [C, block_k] tiles (the
  state kernels keep the state as [block_k, BV] slices): one whole [C, K] f32
  tile is 64 registers per thread on the GPU at C = 64, K = 128 and 4 warps,
  so whole-K tiles spill. The gate factors are per channel and every K
  contraction is a sum over slices, so slicing changes no algebra.
  """
  width = cfg.block_k if width is None else width
  if not (width > 0 and width & (width - 1) == 0):
    raise ValueError(f"the K slice width must be a power of two, got {width}")
  return width_slices(dk, width)


def width_slices(n: int, cap: int | None = None) -> list:
  """Static `pl.ds` slices covering an axis of n channels: powers of two,
  widest first, each at most `cap` (a power of two; None: no cap).

  Triton tensors must have power-of-two sizes, so kernels touch K or V data
  of other widths through these: 96 -> 64 + 32 (with cap 32: 3 x 32),
  80 -> 64 + 16; at a power of two n, n / cap slices of cap (or the whole
  axis). Every start is a multiple of its slice's width.
  """
  out, start = [], 0
  while start < n:
    size = 1 << ((n - start).bit_length() - 1)     # the widest power of two that fits
    if cap is not None:
      size = min(size, cap)
    out.append(pl.ds(start, size))
    start += size
  return out


def add_all(terms):
  """The sum of a non-empty iterable of arrays, without a zero to start from
  (one term is returned as it is, so a single slice adds no op)."""
  terms = iter(terms)
  total = next(terms)
  for term in terms:
    total = total + term
  return total


def tile_factors(g_ck, anchor_1k, r: int, ell: int, diagonal: str):
  """Anchored decay factors of row sub-tile r.

  The anchor is the FIRST row of tile r, never a later one, so no output can
  depend on a future gate.

  Args:
    g_ck: [C, K] within-chunk cumulative log-decay.
    anchor_1k: [1, K], g_ck at row r * ell.

  Returns:
    row_ck: e^{G_i - a} 2^DIAG_SHIFT on the rows of tile r (<= 2^DIAG_SHIFT),
      zero elsewhere.
    col_ck: e^{a - G_j} 2^-DIAG_SHIFT on the columns tile r may see through
      the anchored matmul (earlier tiles: e^{a - G_j} <= 1; its own tile
      when `dense`: <= e^{|g_min| (L - 1)}), zero elsewhere. Exponents are
      masked before exp, so nothing overflows; the shifts cancel in every
      row-by-column product (`DIAG_SHIFT`: without them the row operands
      underflow at the bound).
  """
  c = g_ck.shape[0]
  row = iota((c, 1), 0)
  in_r = (row >= r * ell) & (row < (r + 1) * ell)
  visible = row < ((r + 1) * ell if diagonal == "dense" else r * ell)
  diff = g_ck - anchor_1k
  row_ck = jnp.where(in_r, exp(jnp.where(in_r, diff, 0.0), DIAG_SHIFT), 0.0)
  col_ck = jnp.where(visible, exp(jnp.where(visible, -diff, 0.0), -DIAG_SHIFT), 0.0)
  return row_ck, col_ck


def pair_levels(ell: int) -> list[int]:
  """Half-widths s = L/2, L/4, ..., 1 of the pairwise diagonal's levels (none at L = 1)."""
  levels, s = [], ell // 2
  while s >= 1:
    levels.append(s)
    s //= 2
  return levels


def same_block(c: int, width: int):
  """[C, C] bool: rows i and columns j in one aligned block of `width` rows."""
  return (jnp.bitwise_and(iota((c, 1), 0), -width)
          == jnp.bitwise_and(iota((1, c), 1), -width))


def level_factors(g_rk, s: int, pick=None):
  """Decay factors of level s of the pairwise diagonal, for R rows of G.

  Level s holds the pairs (i, j) with i in the upper and j in the lower half
  of one aligned 2s-row block. Its anchor u is G at the first row of the
  upper half, between j and i (j < u <= i), so
    e^{G_i - G_j} = e^{G_i - u} e^{u - G_j},
  both factors <= 1 for any non-positive gate: nothing overflows, and a
  factor underflows only where the pair decay itself is below f32's range.
  The L/2, ..., 1 levels of an L-row diagonal tile cover each of its pairs
  j < i once; every level is one masked tensor-core product per score.

  Args:
    g_rk: [R, K'] f32 within-chunk cumulative log-decay; its first row starts
      a 2s-row block (R a multiple of 2s).
    pick: `pick(g_rk, s) -> [R, K']`, u on every row (`anchor_picker`);
      None: `anchors_by_reshape`.

  Returns:
    row_rk: e^{G_i - u} on upper-half rows, zero on lower-half rows;
    col_rk: e^{u - G_j} on lower-half rows, zero on upper-half rows.
    Both [R, K'] f32; exponents are masked before exp.
  """
  upper = _upper_half(g_rk.shape[0], s)
  e = level_decay(g_rk, s, pick)
  return jnp.where(upper, e, 0.0), jnp.where(upper, 0.0, e)


def _upper_half(rows: int, s):
  """[R, 1] bool: the rows in the upper half of their aligned 2s-row block."""
  return jnp.bitwise_and(iota((rows, 1), 0), s) != 0


def level_decay(g_rk, s, pick=None):
  """Level s's decay factors of `level_factors`, unmasked: [R, K'] f32,
  e^{G_i - u} on upper-half rows and e^{u - G_j} on lower-half rows.

  Both are <= 1 (as `level_factors`), so a product of any two rows' factors
  is finite: a kernel may use these unmasked operands and mask the [R, R]
  product to the level's pairs (`level_pairs`) instead of zeroing half of
  each operand. The sign goes into the exponent's log2 e factor (one
  multiply, no select); the values equal `level_factors`' bit for bit.
  """
  diff = g_rk - (pick or anchors_by_reshape)(g_rk, s)
  sign = jnp.where(_upper_half(g_rk.shape[0], s), _LOG2_E, -_LOG2_E)
  return jnp.exp2(diff * sign)


def level_pairs(rows: int, s, transpose: bool = False):
  """[R, R] bool: level s's pairs (i, j), i in the upper and j in the lower
  half of one aligned 2s-row block (`level_factors`); with `transpose`, the
  same pairs as (j, i)."""
  row, col = iota((rows, 1), 0), iota((1, rows), 1)
  later, earlier = (col, row) if transpose else (row, col)
  return ((jnp.bitwise_and(row, -2 * s) == jnp.bitwise_and(col, -2 * s))
          & (jnp.bitwise_and(later, s) != 0) & (jnp.bitwise_and(earlier, s) == 0))


def anchors_by_reshape(g_rk, s: int):
  """Level s's anchors u (`level_factors`) through a [R / 2s, 2s, K'] reshape."""
  rows, width = g_rk.shape
  g3 = g_rk.reshape(rows // (2 * s), 2 * s, width)
  first = iota((1, 2 * s, 1), 1) == s
  u = jnp.sum(jnp.where(first, g3, 0.0), axis=1, keepdims=True)     # exact: one term
  return jnp.broadcast_to(u, g3.shape).reshape(rows, width)


def anchor_picker(cfg: KernelConfig, g_ref, start: int = 0, cols=slice(None)):
  """`level_factors`' anchor picker by `cfg.level_anchors`, for rows of g_ref
  from `start` (the rows of g_rk) and its columns `cols`.

  "reshape": `anchors_by_reshape` (values only); "gather": one load of
  g_ref at each row's anchor index; "select": R / 2s selects of broadcast
  anchor rows (Mosaic lowers neither small-row reshapes nor gathers).
  """
  mode = cfg.level_anchors
  if mode == "reshape":
    return anchors_by_reshape
  if mode == "gather":
    def gather(g_rk, s):
      at = jnp.bitwise_and(iota((g_rk.shape[0],), 0), -2 * s) + (start + s)
      return g_ref[at, cols]
    return gather

  def select(g_rk, s):
    row = iota((g_rk.shape[0], 1), 0)
    u = jnp.broadcast_to(g_ref[pl.ds(start + s, 1), cols], g_rk.shape)
    for blk in range(1, g_rk.shape[0] // (2 * s)):
      u = jnp.where(row >= 2 * s * blk, g_ref[pl.ds(start + 2 * s * blk + s, 1), cols], u)
    return u
  return select


@dataclasses.dataclass(frozen=True)
class ChunkSpecs:
  """BlockSpecs of one chunk for the per-chunk kernels, grid (B, H, NC)."""
  k: pl.BlockSpec      # [C, K] of a [B, Tp, H*K] array
  v: pl.BlockSpec      # [C, V] of a [B, Tp, H*V] array
  cc: pl.BlockSpec     # [C, C] of a [B, H, Tp, C] array
  beta: pl.BlockSpec   # [C, 1] of a [B, H, Tp, 1] array
  state: pl.BlockSpec  # [K, V] of a [B, H, NC*K, V] array: the chunk's row of states
  # [C, 1] of the [B, Tp, 1] run codes, and [1, C] of the [B, NC, 1, C] runs (`run_codes`).
  runs: tuple[pl.BlockSpec, pl.BlockSpec]


def chunk_specs(chunk_size: int, dk: int, dv: int) -> ChunkSpecs:
  """The intra-chunk kernels' BlockSpecs for chunk length C, head dims K and V."""
  c = chunk_size
  return ChunkSpecs(
      k=pl.BlockSpec((None, c, dk), lambda ib, ih, ic: (ib, ic, ih)),
      v=pl.BlockSpec((None, c, dv), lambda ib, ih, ic: (ib, ic, ih)),
      cc=pl.BlockSpec((None, None, c, c), lambda ib, ih, ic: (ib, ih, ic, 0)),
      beta=pl.BlockSpec((None, None, c, 1), lambda ib, ih, ic: (ib, ih, ic, 0)),
      state=pl.BlockSpec((None, None, dk, dv), lambda ib, ih, ic: (ib, ih, ic, 0)),
      runs=(pl.BlockSpec((None, c, 1), lambda ib, ih, ic: (ib, ic, 0)),
            pl.BlockSpec((None, None, 1, c), lambda ib, ih, ic: (ib, ic, 0, 0))))


@dataclasses.dataclass(frozen=True)
class StateGrid:
  """Grid and BlockSpecs shared by the forward and reverse state kernels.

  GPU: grid (V/BV, B, H); each program sees the whole padded sequence and
  loops over the chunks itself. The V tile is the first grid axis, which the
  Triton launch makes the fastest-varying block index: the V/BV programs of
  one (batch row, head) start together and walk the same chunks side by
  side, so the second one mostly finds that chunk's [C, K] operands (W, the
  decayed keys, the gates) in L2. TPU: grid
  (B, H, V/BV, NC) with the chunk axis sequential, so one chunk is resident
  in VMEM; `reverse` visits it backwards.
  """
  grid: tuple[int, ...]
  meta: pl.BlockSpec    # int32 [NC] per-chunk metadata
  k: pl.BlockSpec       # [B, Tp, H*K] tensors
  v: pl.BlockSpec       # [B, Tp, H*V] tensors
  a: pl.BlockSpec       # [B, H, Tp, C] chunk matrices
  state: pl.BlockSpec   # [Nh, H, K, V] initial / final states
  chunk_states: pl.BlockSpec  # [B, H, NC*K, V] per-chunk states
  dk: int
  block_v: int
  code: pl.BlockSpec | None = None  # [B, Tp, 1] int32 run codes (`run_codes`)


def state_grid(q_shape, head_v: int, *, heads: int, chunk_size: int, cfg: KernelConfig,
               varlen: bool, num_state_rows: int, reverse: bool = False) -> StateGrid:
  """Lays the state kernels out for `cfg`'s backend.

  Args:
    q_shape: (B, Tp, H*K); head_v: V; num_state_rows: Nh of the state arrays.
    varlen: one state block holds every sequence row (B == 1).
  """
  b, tp, hk = q_shape
  h, c = heads, chunk_size
  dk = hk // h
  bv = cfg.block_v
  nv = head_v // bv
  nc = tp // c
  n_blk = num_state_rows if varlen else 1
  meta = cfg.meta_block_spec(nc)
  if cfg.is_tpu:
    at = (lambda ic: nc - 1 - ic) if reverse else (lambda ic: ic)
    return StateGrid(
        grid=(b, h, nv, nc), meta=meta,
        k=pl.BlockSpec((None, c, dk), lambda ib, ih, iv, ic: (ib, at(ic), ih)),
        v=pl.BlockSpec((None, c, bv), lambda ib, ih, iv, ic: (ib, at(ic), ih * nv + iv)),
        a=pl.BlockSpec((None, None, c, c), lambda ib, ih, iv, ic: (ib, ih, at(ic), 0)),
        state=pl.BlockSpec((n_blk, None, dk, bv),
                           lambda ib, ih, iv, ic: (0 if varlen else ib, ih, 0, iv)),
        chunk_states=pl.BlockSpec((None, None, dk, bv),
                                  lambda ib, ih, iv, ic: (ib, ih, at(ic), iv)),
        dk=dk, block_v=bv,
        code=pl.BlockSpec((None, c, 1), lambda ib, ih, iv, ic: (ib, at(ic), 0)))
  return StateGrid(
      grid=(nv, b, h), meta=meta,
      k=pl.BlockSpec((None, tp, dk), lambda iv, ib, ih: (ib, 0, ih)),
      v=pl.BlockSpec((None, tp, bv), lambda iv, ib, ih: (ib, 0, ih * nv + iv)),
      a=pl.BlockSpec((None, None, tp, c), lambda iv, ib, ih: (ib, ih, 0, 0)),
      state=pl.BlockSpec((n_blk, None, dk, bv),
                         lambda iv, ib, ih: (0 if varlen else ib, ih, 0, iv)),
      chunk_states=pl.BlockSpec((None, None, nc * dk, bv), lambda iv, ib, ih: (ib, ih, 0, iv)),
      dk=dk, block_v=bv, code=pl.BlockSpec((None, tp, 1), lambda iv, ib, ih: (ib, 0, 0)))


def store_state_rows(ref, i, slices, s) -> None:
  """Stores the state s (K slices, [ks.size, width] each) as chunk i's K rows of
  ref [NC*K, width], in ref's dtype."""
  dk = sum(ks.size for ks in slices)
  base = pl.multiple_of(i * dk, pow2_part(dk))
  for ks, s_kb in zip(slices, s):
    # base + ks.start is a multiple of this: the widest slices come first.
    at = pl.multiple_of(base + ks.start, min(ks.size, pow2_part(dk)))
    ref[pl.ds(at, ks.size), :] = s_kb.astype(ref.dtype)


def run_state_loop(step, num_chunks: int, slices, width: int, init_ref, final_ref, meta_refs, *,
                   varlen: bool, reverse: bool = False) -> None:
  """One program's pass over its chunks with a state carried as K slices (the GPU's
  forward recurrence, and with `reverse` its reverse state pass, last chunk first).

  Per chunk i, `step(i, s)` takes the state entering it and returns the one
  leaving it. With `varlen` the chunks hold several sequences: the state
  entering the pass's first chunk of a sequence is init_ref's row seq_n[i],
  and the state leaving its last chunk of one is stored in final_ref's row
  seq_n[i] (first and last in the pass's order: in reverse, a sequence's last
  chunk enters first). Fixed length (not `varlen`) the program's rows are one
  sequence: init_ref's only row enters the pass and the state leaving it goes
  to final_ref's, outside the loop, and the metadata is not read. Inside the
  loop the per-chunk selection would load a whole [K, width] f32 block every
  chunk (registers and pipelined shared memory the loop needs for its operands).

  Args:
    slices: the K slices (`k_slices`); a state is a tuple of [ks.size, width] f32.
    init_ref, final_ref: [Nh', K, width] refs (Nh' = 1 when not varlen).
    meta_refs: (first_ref, last_ref, seq_ref), int32 [NC] each: the chunk
      starts / ends a sequence, and its state row.
  """
  first_ref, last_ref, seq_ref = meta_refs
  enter_ref, leave_ref = (last_ref, first_ref) if reverse else (first_ref, last_ref)

  def body(j, s):
    i = num_chunks - 1 - j if reverse else j
    if varlen:
      seq = seq_ref[i]
      s = tuple(jnp.where(enter_ref[i] != 0, init_ref[seq, ks, :].astype(_F32), s_kb)
                for ks, s_kb in zip(slices, s))
    s = step(i, s)
    if varlen:
      @pl.when(leave_ref[i] != 0)
      def _():
        for ks, s_kb in zip(slices, s):
          final_ref[seq, ks, :] = s_kb

    return s

  if varlen:
    lax.fori_loop(0, num_chunks, body, tuple(jnp.zeros((ks.size, width), _F32) for ks in slices))
    return
  last = lax.fori_loop(0, num_chunks, body,
                       tuple(init_ref[0, ks, :].astype(_F32) for ks in slices))
  for ks, s_kb in zip(slices, last):
    final_ref[0, ks, :] = s_kb


def state_grid_step(step, i, slices, scratch_ref, init_ref, final_ref, meta_refs, *,
                    reverse: bool = False) -> None:
  """One grid step (chunk i) of a TPU state pass, the state in VMEM scratch.

  The counterpart of `run_state_loop` with one chunk per grid step: the state
  entering the pass's first chunk of a sequence (first_n[i], or last_n[i] in
  `reverse`) is init_ref's row seq_n[i], else the scratch's; `step(s)` returns
  the state leaving the chunk, which the scratch keeps and, at the pass's
  last chunk of a sequence, final_ref's row seq_n[i] takes.

  Args:
    slices: the K slices (`k_slices`); a state is a tuple of [ks.size, width] f32.
    scratch_ref: [K, width] f32 scratch; init_ref, final_ref: [Nh', K, width].
    meta_refs: (first_ref, last_ref, seq_ref), int32 [NC] each.
  """
  first_ref, last_ref, seq_ref = meta_refs
  enter_ref, leave_ref = (last_ref, first_ref) if reverse else (first_ref, last_ref)
  seq = seq_ref[i]

  @pl.when(enter_ref[i] != 0)
  def _():
    scratch_ref[...] = init_ref[seq].astype(_F32)

  s = step(tuple(scratch_ref[ks, :] for ks in slices))
  for ks, s_kb in zip(slices, s):
    scratch_ref[ks, :] = s_kb

  @pl.when(leave_ref[i] != 0)
  def _():
    for ks, s_kb in zip(slices, s):
      final_ref[seq, ks, :] = s_kb


def state_launch_options(cfg: KernelConfig, stage: str, grid: StateGrid) -> dict:
  """`pallas_call` options of a state kernel: compiler params, TPU VMEM state."""
  if not cfg.is_tpu:
    return dict(compiler_params=cfg.compiler_params(stage))
  return dict(compiler_params=cfg.compiler_params(stage, grid_rank=4, sequential_last=True),
              scratch_shapes=[pltpu.VMEM((grid.dk, grid.block_v), _F32)])


def state_decay_grad(ds, s, g_last, carried=None):
  """Gradient of dG's last row from the state decay S_next = e^{G_last} S + ...

  Args:
    ds: [K', V'] gradient of the state leaving the chunk; s: [K', V'] state
      entering it (either may be stored in bf16; the product and sum are f32).
    g_last: [1, K'] the chunk's last row of G.
    carried: None, or [1, 1] bool: whether the decay term exists (runs:
      `RunFlags.carry_last`); zero where False.

  Returns:
    [1, K'] f32: (sum_v dS * S)^T e^{G_last}.
  """
  prod = ds.astype(_F32) * s.astype(_F32)
  grad = jnp.transpose(jnp.sum(prod, axis=1, keepdims=True)) * exp(g_last)
  return grad if carried is None else jnp.where(carried, grad, 0.0)


def add_score_grads(grads, q, k, g, beta, refs, *, ell, diagonal, cfg: KernelConfig,
                    score_dtype, tile_product, qk_diagonal, levels: bool = True):
  """Adds the gradients through a chunk's anchored score products (all row tiles).

  Scores: A_qk = sum_r (q row_r)(k col_r)^T, A_kk = beta (k row_r)(k col_r)^T,
  with tile r's anchored factors (`tile_factors`); with `pairwise`, the
  diagonal tiles instead sum one masked product per level (`level_factors`)
  plus A_qk's exact diagonal q_i . k_i. The gate gradient of a
  score is (row operand) * (row-side product) minus (column operand) *
  (column-side product); both sides must use the same rounded operands, or the
  reverse cumsum of dG stops cancelling. Shared by the one-program and the split intra backward, which differ
  only in how they get the [C, C] gradients of the scores.

  Each product is folded into dq, dk, dG (or R) as soon as it is formed, so
  one [C, K'] product is live at a time next to the accumulators: on the
  GPU these programs run at the register cap.

  Every product takes a whole [C, C] score gradient, not the rows of tile r:
  the column side's right operands (xq, xk) are zero outside tile r, so the
  other rows add exact zeros; the row side's result rows outside tile r are
  not zero but reach the gradients only through row_f, xq and xk, which are
  zero there (they are sums over the same column operand yk as the tile's
  own rows, so of their size). The left operands are then the same for
  every tile: no per-tile mask, and on the GPU each is staged for the
  tensor cores once. A level's products take the gradients masked to its
  2s-row blocks, and the same argument holds with its halves for tile r.

  Args:
    grads: (dq, dk, dbeta, dG) so far: [C, K'], [C, K'], [C, 1], [C, K'] f32.
    q, k, g: [C, K'] f32 (q scaled; K' the columns this program handles);
      beta: [C, 1] f32.
    refs: (q_ref, k_ref, g_ref, beta_ref) of the same columns (the tile
      anchors, and the level anchors unless picked by reshape, read g_ref).
    score_dtype: operand dtype of the score products (the forward's).
    tile_product(side, x, block=None): for side "q_row" dA_qk x, "q_col"
      dA_qk^T x, "k_row" dA x, "k_col" dA^T x, with the whole [C, C]
      gradients, or with them zeroed outside aligned `block`-row diagonal
      blocks (`same_block`); operands rounded to the score dtype; x [C, K']
      in the score dtype, result [C, K'] f32.
    qk_diagonal(): [C, 1] f32, the diagonal of dA_qk (`pairwise` only).
    levels: pairwise only: add the diagonal tiles' terms (the levels and
      A_qk's diagonal) here; False when `kernel_diag.diag_grads` has.

  Returns:
    grads plus the score terms: dq += the row side of dA_qk; dk += both
    column sides and beta R, with R = sum_j dA_ij k_j e^{G_i - G_j};
    dbeta += sum_d k R; dG += the gate terms.
  """
  dq, dk, dbeta, dgc = grads
  g_ref = refs[2]
  c = q.shape[0]
  rnd = lambda x: x.astype(score_dtype).astype(_F32)
  r_acc = jnp.zeros_like(q)
  bk = beta * k

  def fold(row_f, col_f, block):
    nonlocal dq, dk, dgc, r_acc
    yk = rnd(k * col_f)
    xq = rnd(q * row_f)
    xk = rnd(bk * row_f)
    t = tile_product("q_row", yk, block)
    dq = dq + row_f * t
    dgc = dgc + xq * t
    t = tile_product("k_row", yk, block)
    r_acc = r_acc + row_f * t
    dgc = dgc + xk * t
    # Both column sides share col_f and yk: one sum, one fold (and one chain
    # of accumulating matmuls on the GPU).
    t = tile_product("q_col", xq, block) + tile_product("k_col", xk, block)
    dk = dk + col_f * t
    dgc = dgc - yk * t

  # pairwise: tile 0 sees no earlier tile, its anchored product is zero.
  for r in range(1 if diagonal == "pairwise" else 0, c // ell):
    anchor = g_ref[pl.ds(r * ell, 1), :]
    fold(*tile_factors(g, anchor, r, ell, diagonal), None)
  if diagonal == "pairwise" and levels:
    for s in pair_levels(ell):
      fold(*level_factors(g, s, anchor_picker(cfg, g_ref)), 2 * s)
    d_qk = qk_diagonal()           # A_qk[i, i] = q_i . k_i: no decay, no dG term
    dq = dq + d_qk * k
    dk = dk + d_qk * q
  dk = dk + beta * r_acc
  dbeta = dbeta + jnp.sum(k * r_acc, axis=1, keepdims=True)
  return dq, dk, dbeta, dgc


def finish_intra_bwd(grads, q, k, g, beta, refs, out_refs, *, dglast, row_c, scale, ell,
                     diagonal, cfg: KernelConfig, score_dtype, tile_product, qk_diagonal,
                     levels: bool = True, dv_out=None):
  """The intra-chunk backward's last steps, shared by the one-program and the split kernel.

  Adds the score terms (`add_score_grads`; arguments as there), adds dG_last's share
  to the chunk's last row of dG, and stores the program's gradients.

  Args:
    grads: (dq, dk, dbeta, dG) before the score terms: [C, K'], [C, K'], [C, 1], [C, K'] f32.
    out_refs: (dq_ref, dk_ref, dg_ref, dbeta_ref); dq is stored times `scale`
      (the q read was scaled), dq and dk in their refs' dtypes.
    dglast: [1, K'] f32, the gradient of G's last row through the state's decay.
    row_c: [C, 1] int32 row index.
    dv_out: (dv_ref, dv [C, V] f32) to store after dk, or None.
  """
  dq_ref, dk_ref, dg_ref, dbeta_ref = out_refs
  dq, dk, dbeta, dgc = add_score_grads(
      grads, q, k, g, beta, refs, ell=ell, diagonal=diagonal, cfg=cfg,
      score_dtype=score_dtype, tile_product=tile_product, qk_diagonal=qk_diagonal,
      levels=levels)
  dgc = dgc + jnp.where(row_c == q.shape[0] - 1, dglast, 0.0)
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  if dv_out is not None:
    dv_ref, dv = dv_out
    dv_ref[...] = dv.astype(dv_ref.dtype)
  dg_ref[...] = dgc
  dbeta_ref[...] = dbeta
