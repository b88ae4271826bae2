"""Pallas forward kernels of chunked KDA (backend-neutral bodies).

Two kernels, chunk length C, sub-tile (diagonal tile) length L:

* `intra_fwd`: grid (B, H, chunks), all parallel. Per chunk it builds the
  anchored scores A_kk (strictly lower) and A_qk (lower), inverts the unit
  lower-triangular I + A_kk in f32, and writes
  W = M (beta k e^G), U = M (beta v), A_qk (and M when the backward asks).
  `KernelConfig.inverse` selects the body: "substitution" (scores per
  [L, C] row block; substitution over the whole [C, C] tile, row by row) or
  "blocked" (whole-tile score products summed over K slices of
  `KernelConfig.block_k` channels; M by recursive 2 x 2 blocking, or with
  `KernelConfig.blocked_inverse="stacked"` its diagonal L x L blocks by an
  L-step substitution on their [C, L] stack and the rest by block products;
  every step a tensor-core product). `KernelConfig.intra_fwd_impl="split"` runs the
  blocked body as two kernels instead (`kernel_intra_split`).
* `state_fwd`: grid (V/BV, B, H) (GPU; on TPU (B, H, V/BV, chunks) with a
  sequential chunk axis). Carries the f32 state S [K, BV] through the
  chunks: V' = U - W S; O = (q e^G) S + A_qk V';
  S <- e^{G_last} S + (k e^{G_last - G})^T V'.
  The TPU default; on the GPU and in interpret mode `kernel_state_split`
  (recurrence alone, then a parallel output kernel) runs instead
  (`KernelConfig.state_fwd_impl`).

Layouts (prepared by `pallas_op`): q, k, g_cum, w as [B, Tp, H*K]; v, u, o as
[B, Tp, H*V]; beta as [B, H, Tp, 1]; A_qk and M as [B, H, Tp, C]; states as
[N, H, K, V]; per-chunk states as [B, H, NC*K, V]. Tp = NC * C.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_config import KernelConfig

_F32 = jnp.float32


# ---------------------------------------------------------------------------
# Shared in-kernel helpers (also used by kernel_bwd)
# ---------------------------------------------------------------------------


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


def exp(x):
  """e^x as 2^(x log2 e), for every exponential inside the kernels.

  The Triton lowering maps jnp.exp to libdevice's expf, about 9 SASS
  instructions per element, and exp2 to one MUFU.EX2 plus a few. The intra
  kernels take one exponential per element of several [C, K'] tiles per
  row tile, so on the H200 build expf was 28% of `kda_intra_bwd_k`'s
  instructions and 35% of `kda_intra_fwd`'s. The extra rounding of x log2 e
  is a relative error of about 2^-24 |x log2 e| in the result: below 1e-5
  even for the largest dense diagonal factor (|x| <= 85, `tiling`), far
  below the bf16 rounding of the operands it feeds. The f32 GPU tests
  (`TestKdaPallasGpu`) pass with it at their earlier bounds.
  """
  return jnp.exp2(x * _LOG2_E)


def k_slices(cfg: KernelConfig, dk: int, width: int | None = None) -> list:
  """Static `pl.ds` K slices of `width` (default cfg.block_k) channels covering
  K = dk (one slice if width >= dk).

  The blocked intra forward, the state kernels and the split intra backward
  do every per-channel (K) element-wise operation on [C, block_k] tiles (the
  state kernels keep the state as [block_k, BV] slices): one whole [C, K] f32
  tile is 64 registers per thread on the GPU at C = 64, K = 128 and 4 warps,
  so whole-K tiles spill. The gate factors are per channel and every K
  contraction is a sum over slices, so slicing changes no algebra.
  """
  width = cfg.block_k if width is None else width
  bk = min(width, dk)
  if dk % bk:
    raise ValueError(f"the K slice width must divide K={dk}, got {width}")
  return [pl.ds(kb * bk, bk) for kb in range(dk // bk)]


def tile_factors(g_ck, anchor_1k, r: int, ell: int, diagonal: str):
  """Anchored decay factors of row sub-tile r.

  The anchor is the FIRST row of tile r, never a later one, so no output can
  depend on a future gate.

  Args:
    g_ck: [C, K] within-chunk cumulative log-decay.
    anchor_1k: [1, K], g_ck at row r * ell.

  Returns:
    row_ck: e^{G_i - a} on the rows of tile r (<= 1), zero elsewhere.
    col_ck: e^{a - G_j} on the columns tile r may see through the anchored
      matmul (earlier tiles: <= 1; its own tile when `dense`:
      <= e^{|g_min| (L - 1)}), zero elsewhere. Exponents are masked before
      exp, so nothing overflows.
  """
  c = g_ck.shape[0]
  row = iota((c, 1), 0)
  in_r = (row >= r * ell) & (row < (r + 1) * ell)
  visible = row < ((r + 1) * ell if diagonal == "dense" else r * ell)
  diff = g_ck - anchor_1k
  row_ck = jnp.where(in_r, exp(jnp.where(in_r, diff, 0.0)), 0.0)
  col_ck = jnp.where(visible, exp(jnp.where(visible, -diff, 0.0)), 0.0)
  return row_ck, col_ck


def pair_tile_scores(p_qk, p_kk, q_l, bk_l, k_ref, g_ref, start: int):
  """Adds a diagonal tile's explicit position-pair scores (`pairwise`).

  For the L rows/columns from `start`:
    A_qk[i, j] = sum_d q_id k_jd e^{G_id - G_jd} (j <= i),
    A_kk[i, j] = sum_d (beta k)_id k_jd e^{G_id - G_jd} (j < i).
  One column j per loop step, as [L, K] work (no [L, L, K] tensor), written
  into column start + j of the row blocks.

  Args:
    p_qk, p_kk: [L, C] score row blocks of the tile's rows (zero on the tile).
    q_l, bk_l: [L, K] scaled q and beta * k of the tile.
    k_ref, g_ref: chunk refs of k and the cumulative gates.

  Returns:
    (p_qk, p_kk) with the diagonal tile filled in.
  """
  ell, c = p_qk.shape
  g_l = g_ref[pl.ds(start, ell), :]
  row_l = iota((ell, 1), 0)
  col = iota((1, c), 1)

  def body(j, carry):
    p_qk, p_kk = carry
    k_j = k_ref[pl.ds(start + j, 1), :].astype(_F32)
    g_j = g_ref[pl.ds(start + j, 1), :]
    seen = row_l >= j
    dec = jnp.where(seen, exp(jnp.where(seen, g_l - g_j, 0.0)), 0.0) * k_j
    at_j = col == start + j
    p_qk = jnp.where(at_j, jnp.sum(q_l * dec, axis=1, keepdims=True), p_qk)
    p_kk = jnp.where(at_j & (row_l > j), jnp.sum(bk_l * dec, axis=1, keepdims=True), p_kk)
    return p_qk, p_kk

  return lax.fori_loop(0, ell, body, (p_qk, p_kk))


def onehot_rows(c: int, ell: int, r: int):
  """[C, L] f32 embedding E with E[r * ell + l, l] = 1."""
  return (iota((c, ell), 0) == iota((c, ell), 1) + r * ell).astype(_F32)


def unit_lower_inverse(blocks_lc):
  """(I + A)^-1 for strictly lower-triangular A [C, C], by forward substitution.

  Args:
    blocks_lc: A as its row blocks, a list of [L, C] arrays (rows r*L...).

  Row i of M is e_i - sum_{j<i} A_ij M_j. Pure f32 elementwise work: no
  powers of A are formed, so nothing cancels catastrophically.
  """
  ell, c = blocks_lc[0].shape
  row = iota((c, 1), 0)
  row_l = iota((ell, 1), 0)
  m = (iota((c, c), 0) == iota((c, c), 1)).astype(_F32)
  for r, blk in enumerate(blocks_lc):
    def body(l, m, blk=blk, r=r):
      a_i = jnp.sum(jnp.where(row_l == l, blk, 0.0), axis=0)
      upd = jnp.sum(a_i[:, None] * m, axis=0)
      return jnp.where(row == r * ell + l, m - upd[None, :], m)
    m = lax.fori_loop(1 if r == 0 else 0, ell, body, m)
  return m


def split_bf16(x):
  """(head, rest) bf16 with head + rest = x up to about 2^-16 |x| (x f32)."""
  head = x.astype(jnp.bfloat16)
  return head, (x - head.astype(_F32)).astype(jnp.bfloat16)


def dot_bf16x3(a_parts, b_parts, cfg: KernelConfig):
  """a @ b from `split_bf16` parts: three bf16 products, f32 accumulation."""
  (a_hi, a_lo), (b_hi, b_lo) = a_parts, b_parts
  small = dot(a_hi, b_lo, cfg, dtype=jnp.bfloat16) + dot(a_lo, b_hi, cfg, dtype=jnp.bfloat16)
  return small + dot(a_hi, b_hi, cfg, dtype=jnp.bfloat16)


def diag_operand_dtype(cfg: KernelConfig):
  """Operand dtype of the inverse's diagonal-level products when they are not
  bf16x3 splits: bf16 (inverse_diag="bf16") or f32 ("f32")."""
  return jnp.bfloat16 if cfg.inverse_diag == "bf16" else _F32


def blocked_unit_lower_inverse(a_cc, ell: int, cfg: KernelConfig, dtype=None):
  """(I + A)^-1 of a strictly lower-triangular A [C, C], blocked by L x L tiles.

  Every step is a whole-tile tensor-core product (f32 accumulation), so the
  Triton lowering needs no per-row reductions:
  * the C/L diagonal blocks together, by forward substitution in L steps on
    their vertical stack D [C, L] (D[rL + i, j] = M_rr[i, j]): step l sets the
    rows l of all blocks at once, D_l <- e_l - (A_diag D)_l, with f32
    operands, their bf16x3 splits or bf16 ones (`cfg.inverse_diag`);
  * below the diagonal, one block row i at a time, operands in `dtype`
    (default f32):
    M_ij = -M_ii sum_{k=j}^{i-1} A_ik M_kj (i > j), i.e.
    M_i <- -M_diag ((rows i of A_off) M).

  Args:
    a_cc: [C, C] f32, zero on and above the diagonal.

  Returns:
    M [C, C] f32, unit lower triangular.
  """
  c = a_cc.shape[0]
  dtype = _F32 if dtype is None else dtype
  row, col = iota((c, 1), 0), iota((1, c), 1)
  rmod = jnp.bitwise_and(row, ell - 1)                 # row within its tile
  same = jnp.zeros((c, c), jnp.bool_)
  for r in range(c // ell):
    same = same | ((row >= r * ell) & (row < (r + 1) * ell)
                   & (col >= r * ell) & (col < (r + 1) * ell))
  a_diag = jnp.where(same, a_cc, 0.0)
  col_l = iota((1, ell), 1)
  stack0 = (rmod == col_l).astype(_F32)                # [C, L] stacked identities

  if cfg.inverse_diag == "bf16x3":
    a_parts = split_bf16(a_diag)                       # loop-invariant
    product = lambda stack: dot_bf16x3(a_parts, split_bf16(stack), cfg)
  else:
    product = lambda stack: dot(a_diag, stack, cfg, dtype=diag_operand_dtype(cfg))

  def step(l, stack):
    # All rows of the product are formed, only rows l kept: the loop-invariant
    # left operand lets the compiler keep it in the matmul layout.
    return jnp.where(rmod == l, stack - product(stack), stack)

  stack = lax.fori_loop(1, ell, step, stack0)
  # [C, L] -> block-diagonal [C, C] through a one-hot product (exact).
  tile_cols = (iota((ell, 1), 0) == jnp.bitwise_and(col, ell - 1)).astype(_F32)
  m_diag = jnp.where(same, dot(stack, tile_cols, cfg, dtype=_F32), 0.0)
  m = m_diag
  a_off = jnp.where(same, 0.0, a_cc)
  for i in range(1, c // ell):
    in_i = (row >= i * ell) & (row < (i + 1) * ell)
    t = dot(jnp.where(in_i, a_off, 0.0), m, cfg, dtype=dtype)
    m = m - dot(m_diag, t, cfg, dtype=dtype)
  return m


def recursive_unit_lower_inverse(a_cc, ell: int, cfg: KernelConfig, dtype=None):
  """(I + A)^-1 of a strictly lower-triangular A [C, C] by recursive 2 x 2 blocking.

  With M_s the inverse of I + A restricted to its diagonal s x s blocks and
  E_s the entries of A in the lower-left s x s quadrants of the 2s x 2s
  diagonal blocks, [[P, 0], [X, Q]]^-1 = [[P^-1, 0], [-Q^-1 X P^-1, Q^-1]]
  gives M_2s = M_s - (M_s E_s) M_s, all as [C, C] products. M_2 = I - A_2
  (2 x 2 blocks are nilpotent of order 2). log2(C) - 1 levels, two dependent
  products each: 10 at C = 64, against the L - 1 chained substitution steps
  and 2 (C/L - 1) block products of `blocked_unit_lower_inverse`. Only
  products of inverse blocks with blocks of A are formed, never powers of A,
  so no large terms cancel (the blocked triangular inversion of LAPACK's
  trtri). Levels whose blocks are at most L wide take `cfg.inverse_diag`
  operands (f32, bf16x3 splits or bf16), the wider ones `dtype` (default
  f32), the same precision split as the stacked schedule.

  Args:
    a_cc: [C, C] f32, zero on and above the diagonal.

  Returns:
    M [C, C] f32, unit lower triangular.
  """
  c = a_cc.shape[0]
  dtype = _F32 if dtype is None else dtype
  row, col = iota((c, 1), 0), iota((1, c), 1)

  def same_block(s):                                   # [C, C]: i, j in one s-block
    return jnp.bitwise_and(row, -s) == jnp.bitwise_and(col, -s)

  m = jnp.where(row == col, 1.0, 0.0) - jnp.where(same_block(2), a_cc, 0.0)
  if cfg.inverse_diag == "bf16x3":
    a_parts = split_bf16(a_cc)
  diag_dtype = diag_operand_dtype(cfg)
  s = 2
  while s < c:
    quadrant = same_block(2 * s) & jnp.logical_not(same_block(s))
    if 2 * s <= ell and cfg.inverse_diag == "bf16x3":
      e_parts = tuple(jnp.where(quadrant, x, 0) for x in a_parts)
      m_parts = split_bf16(m)
      t = dot_bf16x3(m_parts, e_parts, cfg)
      m = m - dot_bf16x3(split_bf16(t), m_parts, cfg)
    else:
      prec = diag_dtype if 2 * s <= ell else dtype
      t = dot(m, jnp.where(quadrant, a_cc, 0.0), cfg, dtype=prec)
      m = m - dot(t, m, cfg, dtype=prec)
    s *= 2
  return m


@dataclasses.dataclass(frozen=True)
class ChunkSpecs:
  """BlockSpecs of one chunk for the per-chunk kernels, grid (B, H, NC)."""
  k: pl.BlockSpec      # [C, K] of a [B, Tp, H*K] array
  v: pl.BlockSpec      # [C, V] of a [B, Tp, H*V] array
  cc: pl.BlockSpec     # [C, C] of a [B, H, Tp, C] array
  beta: pl.BlockSpec   # [C, 1] of a [B, H, Tp, 1] array
  state: pl.BlockSpec  # [K, V] of a [B, H, NC*K, V] array: the chunk's row of states


def chunk_specs(chunk_size: int, dk: int, dv: int) -> ChunkSpecs:
  """The intra-chunk kernels' BlockSpecs for chunk length C, head dims K and V."""
  c = chunk_size
  return ChunkSpecs(
      k=pl.BlockSpec((None, c, dk), lambda ib, ih, ic: (ib, ic, ih)),
      v=pl.BlockSpec((None, c, dv), lambda ib, ih, ic: (ib, ic, ih)),
      cc=pl.BlockSpec((None, None, c, c), lambda ib, ih, ic: (ib, ih, ic, 0)),
      beta=pl.BlockSpec((None, None, c, 1), lambda ib, ih, ic: (ib, ih, ic, 0)),
      state=pl.BlockSpec((None, None, dk, dv), lambda ib, ih, ic: (ib, ih, ic, 0)))


@dataclasses.dataclass(frozen=True)
class StateGrid:
  """Grid and BlockSpecs shared by the forward and reverse state kernels.

  GPU: grid (V/BV, B, H); each program sees the whole padded sequence and
  loops over the chunks itself. The V tile is the first grid axis, which the
  Triton launch makes the fastest-varying block index: the V/BV programs of
  one (batch row, head) start together and walk the same chunks side by
  side, so the second one mostly finds that chunk's [C, K] operands (W, the
  decayed keys, the gates) in L2. Nsight Compute, H200, bf16, B16 T2048 H16
  D128 (two V tiles, 512 programs for 264 slots): the forward recurrence
  read 424 MB from HBM against 688 MB with the V tile last, and took
  327-329 us against 358-362 us (locked 1.34 GHz clocks). TPU: grid
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
        dk=dk, block_v=bv)
  return StateGrid(
      grid=(nv, b, h), meta=meta,
      k=pl.BlockSpec((None, tp, dk), lambda iv, ib, ih: (ib, 0, ih)),
      v=pl.BlockSpec((None, tp, bv), lambda iv, ib, ih: (ib, 0, ih * nv + iv)),
      a=pl.BlockSpec((None, None, tp, c), lambda iv, ib, ih: (ib, ih, 0, 0)),
      state=pl.BlockSpec((n_blk, None, dk, bv),
                         lambda iv, ib, ih: (0 if varlen else ib, ih, 0, iv)),
      chunk_states=pl.BlockSpec((None, None, nc * dk, bv), lambda iv, ib, ih: (ib, ih, 0, iv)),
      dk=dk, block_v=bv)


def state_launch_options(cfg: KernelConfig, stage: str, grid: StateGrid) -> dict:
  """`pallas_call` options of a state kernel: compiler params, TPU VMEM state."""
  if not cfg.is_tpu:
    return dict(compiler_params=cfg.compiler_params(stage))
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  return dict(compiler_params=cfg.compiler_params(stage, grid_rank=4, sequential_last=True),
              scratch_shapes=[pltpu.VMEM((grid.dk, grid.block_v), _F32)])


# ---------------------------------------------------------------------------
# Intra-chunk kernel
# ---------------------------------------------------------------------------


def _intra_fwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, aqk_ref,
                      *opt_refs, scale, ell, diagonal, cfg, save_m, save_gated):
  """Row-block scores and full-tile forward substitution (`inverse="substitution"`)."""
  cfg = cfg.intra()
  c = q_ref.shape[0]
  k = k_ref[...].astype(_F32)
  g = g_ref[...]
  sdt = cfg.score_mm_dtype
  col = iota((1, c), 1)
  row_l = iota((ell, 1), 0)
  akk_blocks = []
  # Row sub-tile r: its L rows against all columns, anchored at its first row.
  for r in range(c // ell):
    rows = pl.ds(r * ell, ell)
    anchor = g_ref[pl.ds(r * ell, 1), :]
    q_l = q_ref[rows, :].astype(_F32) * scale
    bk_l = beta_ref[rows, :] * k_ref[rows, :].astype(_F32)
    row_f = exp(g_ref[rows, :] - anchor)                 # <= 1
    _, col_f = tile_factors(g, anchor, r, ell, diagonal)
    yk = k * col_f
    p_qk = dot(q_l * row_f, yk, cfg, tb=True, dtype=sdt)
    p_kk = dot(bk_l * row_f, yk, cfg, tb=True, dtype=sdt)
    if diagonal == "pairwise":
      p_qk, p_kk = pair_tile_scores(p_qk, p_kk, q_l, bk_l, k_ref, g_ref, r * ell)
    row_g = row_l + r * ell
    aqk_ref[rows, :] = jnp.where(col <= row_g, p_qk, 0.0).astype(aqk_ref.dtype)
    akk_blocks.append(jnp.where(col < row_g, p_kk, 0.0))
  m = unit_lower_inverse(akk_blocks)
  write_outputs(m, q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, opt_refs, scale=scale,
                cfg=cfg, save_m=save_m, save_gated=save_gated)


def _blocked_slice_scores(p_qk, p_kk, q_ref, k_ref, g_ref, beta_ref, ks, *, scale, ell,
                          diagonal, cfg):
  """Adds one K slice's anchored score products to the [C, C] accumulators.

  The decay e^{G_i - G_j} is a per-channel product, so the scores
  sum_d x_id k_jd e^{G_id - G_jd} split into per-slice sums; every factor
  below is formed on [C, BK] tiles only.

  Args:
    p_qk, p_kk: [C, C] f32 partial sums of A_qk and A_kk (unmasked above the
      diagonal; the caller masks).
    ks: static `pl.ds` of the slice's BK channels.

  Returns:
    (p_qk, p_kk) plus this slice's diagonal-tile (dense only) and
    off-diagonal-tile products.
  """
  c = q_ref.shape[0]
  nt = c // ell
  sdt = cfg.score_mm_dtype
  row, col = iota((c, 1), 0), iota((1, c), 1)
  in_tile = [(row >= r * ell) & (row < (r + 1) * ell) for r in range(nt)]
  anchors = [g_ref[pl.ds(r * ell, 1), ks] for r in range(nt)]    # [1, BK]
  g = g_ref[:, ks]
  a_own = jnp.broadcast_to(anchors[0], g.shape)                  # a_t(i)
  a_next = jnp.broadcast_to(anchors[nt - 1], g.shape)            # a_t(i)+1; own on the last
  for r in range(nt):
    if r > 0:
      a_own = jnp.where(in_tile[r], anchors[r], a_own)
    if r + 1 < nt:
      a_next = jnp.where(in_tile[r], anchors[r + 1], a_next)
  k = k_ref[:, ks].astype(_F32)
  row_f = exp(g - a_own)                                         # <= 1
  xq = q_ref[:, ks].astype(_F32) * scale * row_f
  xk = beta_ref[...] * k * row_f
  k_next = k * exp(a_next - g)                                   # <= 1 off the last tile
  if diagonal == "dense":
    same = jnp.zeros((c, c), jnp.bool_)
    for r in range(nt):
      same = same | (in_tile[r] & (col >= r * ell) & (col < (r + 1) * ell))
    k_own = k * exp(a_own - g)                                   # <= e^{|g_min| (L-1)}
    p_qk = p_qk + jnp.where(same, dot(xq, k_own, cfg, tb=True, dtype=sdt), 0.0)
    p_kk = p_kk + jnp.where(same, dot(xk, k_own, cfg, tb=True, dtype=sdt), 0.0)
  for s in range(nt - 1):
    ratio = jnp.ones_like(g)                                     # e^{a_t(i) - a_{s+1}}
    for r in range(s + 2, nt):
      ratio = jnp.where(in_tile[r], exp(anchors[r] - anchors[s + 1]), ratio)
    later = row >= (s + 1) * ell
    col_s = jnp.where(in_tile[s], k_next, 0.0)
    # Rows before tile s + 1 and columns outside tile s are zero operands, so
    # the product lands only in its (later rows, tile s) block.
    p_qk = p_qk + dot(jnp.where(later, xq * ratio, 0.0), col_s, cfg, tb=True, dtype=sdt)
    p_kk = p_kk + dot(jnp.where(later, xk * ratio, 0.0), col_s, cfg, tb=True, dtype=sdt)
  return p_qk, p_kk


def _intra_fwd_blocked_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, aqk_ref,
                              *opt_refs, scale, ell, diagonal, cfg, save_m, save_gated):
  """K-sliced scores and the blocked inverse (`inverse="blocked"`), then W and U:
  `blocked_scores_inverse` followed by `write_w_u` in one program."""
  cfg = cfg.intra()
  m = blocked_scores_inverse(q_ref, k_ref, g_ref, beta_ref, aqk_ref, scale=scale, ell=ell,
                             diagonal=diagonal, cfg=cfg)
  write_outputs(m, q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, opt_refs, scale=scale,
                cfg=cfg, save_m=save_m, save_gated=save_gated)


def blocked_scores_inverse(q_ref, k_ref, g_ref, beta_ref, aqk_ref, *, scale, ell, diagonal, cfg):
  """One chunk's anchored scores and M = (I + A_kk)^-1; writes A_qk.

  Scores, with a_r = G[r L] the first row of tile r and t(i) the tile of row i:
  * diagonal tiles (dense), all at once: (x e^{G - a_t(i)}) (k e^{a_t(j) - G})^T
    masked to i, j in one tile; row factors <= 1, column factors
    <= e^{|g_min| (L - 1)};
  * column tile s against all later rows, anchored at a_{s+1} (between every
    such row and column): (x e^{G - a_t(i)} e^{a_t(i) - a_{s+1}}) (k e^{a_{s+1} - G})^T,
    all factors <= 1.
  Anchors are first rows of tiles at or before every row using them. Both
  are summed over K slices of cfg.block_k channels (`_blocked_slice_scores`),
  so the element-wise work holds [C, BK] tiles, never [C, K] ones; per slice
  each score matrix takes C/L products of [C, BK] x [BK, C]. The pairwise
  diagonal (`pair_tile_scores`) stays over the full K. Then
  M = (I + A_kk)^-1 by `recursive_unit_lower_inverse` or
  `blocked_unit_lower_inverse` (`cfg.blocked_inverse`).

  Args:
    q_ref, k_ref, g_ref: [C, K] refs of one chunk; beta_ref [C, 1];
    aqk_ref: [C, C] output ref of A_qk (lower triangle, zero above).
    cfg: the intra config (`KernelConfig.intra()`).

  Returns:
    M [C, C] f32.
  """
  c, dk = q_ref.shape
  bk = cfg.block_k
  if bk > dk:
    raise ValueError(f"block_k must divide K={dk}, got {bk}")
  slices = k_slices(cfg, dk)
  row, col = iota((c, 1), 0), iota((1, c), 1)
  p_qk = p_kk = jnp.zeros((c, c), _F32)
  for ks in slices:
    p_qk, p_kk = _blocked_slice_scores(p_qk, p_kk, q_ref, k_ref, g_ref, beta_ref, ks,
                                       scale=scale, ell=ell, diagonal=diagonal, cfg=cfg)
  if diagonal == "pairwise":
    zero = jnp.zeros((ell, c), _F32)
    for r in range(c // ell):
      rows = pl.ds(r * ell, ell)
      q_l = q_ref[rows, :].astype(_F32) * scale
      bk_l = beta_ref[rows, :] * k_ref[rows, :].astype(_F32)
      t_qk, t_kk = pair_tile_scores(zero, zero, q_l, bk_l, k_ref, g_ref, r * ell)
      e_cl = onehot_rows(c, ell, r)                              # exact embedding
      p_qk = p_qk + dot(e_cl, t_qk, cfg, dtype=_F32)
      p_kk = p_kk + dot(e_cl, t_kk, cfg, dtype=_F32)
  aqk_ref[...] = jnp.where(col <= row, p_qk, 0.0).astype(aqk_ref.dtype)
  inverse = (recursive_unit_lower_inverse if cfg.blocked_inverse == "recursive"
             else blocked_unit_lower_inverse)
  return inverse(jnp.where(col < row, p_kk, 0.0), ell, cfg, dtype=cfg.inverse_mm_dtype)


def write_w_u(m, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, cfg, gated=None):
  """W = M (beta k e^G) per K slice and U = M (beta v) per V slice.

  The V slices are block_k wide when K is sliced, else the whole V (one
  slice, as on TPU, keeps one product each). Operands are read per slice, so
  nothing [C, K]-sized is live next to M.

  Args:
    m: [C, C] (f32, or as stored; cast to cfg.mm_dtype as a matmul operand).
    k_ref, g_ref, w_ref: [C, K]; v_ref, u_ref: [C, V]; beta_ref [C, 1].
    cfg: the intra config (`KernelConfig.intra()`).
    gated: None, or (q_ref, scale, kg_ref, qg_ref) with [C, K] refs: also
      writes the decayed keys kg = k e^{G_last - G} (<= 1; the split state
      recurrence's operand) and the gated queries qg = (scale q) e^G (the
      split output kernel's and the reverse state kernel's), sharing e^G
      with W's slice.
  """
  dk, dv = k_ref.shape[1], v_ref.shape[1]
  bk = cfg.block_k
  slices = k_slices(cfg, dk)
  bv = min(bk, dv) if bk < dk else dv
  last = pl.ds(k_ref.shape[0] - 1, 1)
  for ks in slices:
    k = k_ref[:, ks].astype(_F32)
    g = g_ref[:, ks]
    e_g = exp(g)
    w_ref[:, ks] = dot(m, beta_ref[...] * k * e_g, cfg).astype(w_ref.dtype)
    if gated is not None:
      q_ref, scale, kg_ref, qg_ref = gated
      kg_ref[:, ks] = (k * exp(g_ref[last, ks] - g)).astype(kg_ref.dtype)
      qg_ref[:, ks] = (q_ref[:, ks].astype(_F32) * scale * e_g).astype(qg_ref.dtype)
  for vb in range(dv // bv):
    vs = pl.ds(vb * bv, bv)
    u_ref[:, vs] = dot(m, beta_ref[...] * v_ref[:, vs].astype(_F32), cfg).astype(u_ref.dtype)


def write_outputs(m, q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, opt_refs, *, scale,
                  cfg, save_m, save_gated):
  """The intra kernels' outputs after M: W and U (`write_w_u`), then, in the
  order of `opt_refs`, M (save_m) and the gated keys and queries (save_gated)."""
  opt_refs = list(opt_refs)
  if save_m:
    m_ref = opt_refs.pop(0)
    m_ref[...] = m.astype(m_ref.dtype)
  gated = (q_ref, scale, *opt_refs) if save_gated else None
  write_w_u(m, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, cfg, gated)


def intra_fwd(q, k, v, g_cum, beta, *, heads, chunk_size, sub_chunk, diagonal, scale,
              cfg: KernelConfig, save_m: bool = False, save_gated: bool = False,
              m_dtype=_F32):
  """Runs the intra-chunk kernel (or, with cfg.intra_fwd_impl="split", the
  two kernels of `kernel_intra_split`; same outputs).

  Args:
    q, k: [B, Tp, H*K]; v: [B, Tp, H*V]; g_cum: [B, Tp, H*K] f32 within-chunk
      cumsum; beta: [B, H, Tp, 1] f32.
    save_m: also return M = (I + A_kk)^-1 for the backward, stored in
      m_dtype (formed in f32; bf16 when the backward only uses it as a bf16
      matmul operand, see `KernelConfig.residual_dtype`).
    save_gated: also return the decayed keys kg = k e^{G_last - G} (G_last
      the chunk's last row) and the gated queries qg = (scale q) e^G, the
      operands of `kernel_state_split` and of the gated reverse state kernel.

  Returns:
    w [B, Tp, H*K], u [B, Tp, H*V] (cfg.mm_dtype), a_qk [B, H, Tp, C]
    (cfg.mm_dtype), then m [B, H, Tp, C] (m_dtype) if save_m, then kg and qg
    [B, Tp, H*K] (cfg.mm_dtype) if save_gated.
  """
  if cfg.intra_fwd_impl == "split":
    # The module imports this one's helpers, so it is imported here.
    from pallas_kernels.kda import kernel_intra_split  # pylint: disable=g-import-not-at-top
    return kernel_intra_split.intra_fwd_split(
        q, k, v, g_cum, beta, heads=heads, chunk_size=chunk_size, sub_chunk=sub_chunk,
        diagonal=diagonal, scale=scale, cfg=cfg, save_m=save_m,
        save_gated=save_gated, m_dtype=m_dtype)
  b, tp, hk = q.shape
  h, c = heads, chunk_size
  dk, dv = hk // h, v.shape[-1] // h
  nc = tp // c
  spec = chunk_specs(c, dk, dv)
  kspec, vspec, cspec, bspec = spec.k, spec.v, spec.cc, spec.beta
  out_shape = [jax.ShapeDtypeStruct((b, tp, hk), cfg.mm_dtype),
               jax.ShapeDtypeStruct((b, tp, h * dv), cfg.mm_dtype),
               jax.ShapeDtypeStruct((b, h, tp, c), cfg.mm_dtype)]
  out_specs = [kspec, vspec, cspec]
  if save_m:
    out_shape.append(jax.ShapeDtypeStruct((b, h, tp, c), m_dtype))
    out_specs.append(cspec)
  if save_gated:
    out_shape += [jax.ShapeDtypeStruct((b, tp, hk), cfg.mm_dtype)] * 2
    out_specs += [kspec] * 2
  body = _intra_fwd_blocked_kernel if cfg.inverse == "blocked" else _intra_fwd_kernel
  kernel = functools.partial(body, scale=scale, ell=sub_chunk, diagonal=diagonal, cfg=cfg,
                             save_m=save_m, save_gated=save_gated)
  return pl.pallas_call(
      kernel, grid=(b, h, nc),
      in_specs=[kspec, kspec, vspec, kspec, bspec],
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=cfg.compiler_params("intra_fwd"),
      interpret=cfg.interpret, name="kda_intra_fwd",
  )(q, k, v, g_cum, beta)


# ---------------------------------------------------------------------------
# Inter-chunk (state) kernel
# ---------------------------------------------------------------------------


def state_fwd_chunk(s, rows, last_row, q_ref, k_ref, g_ref, w_ref, u_ref, aqk_ref, o_ref, *,
                    scale, cfg: KernelConfig):
  """One chunk of the forward state recurrence (shared by the GPU and TPU kernels).

  Reads the chunk's `rows` ([C] rows; `last_row` is its last one) and writes
  O = sum_kb (q e^G)_kb S_kb + A_qk V' into o_ref. Every element-wise factor
  is formed on a [C, BK] column slice (BK = cfg.block_k; see `k_slices`)
  so only [C, BK] f32 tiles are live at once.

  Args:
    s: tuple of K/BK f32 [BK, BV] slices of the state S [K, BV] entering the
      chunk (slice kb holds rows kb*BK ... (kb+1)*BK - 1).

  Returns:
    (V' = U - sum_kb W_kb S_kb [C, BV] f32, the state leaving the chunk as a
    tuple of [BK, BV] slices S_kb <- e^{G_last,kb} S_kb + (k e^{G_last - G})_kb^T V').
  """
  slices = k_slices(cfg, q_ref.shape[-1])
  if len(s) != len(slices):
    raise ValueError(f"state has {len(s)} K slices, expected {len(slices)}")
  v_new = u_ref[rows, :].astype(_F32)
  for ks, s_kb in zip(slices, s):
    v_new = v_new - dot(w_ref[rows, ks], s_kb, cfg)
  o = dot(aqk_ref[rows, :], v_new, cfg)
  s_next = []
  for ks, s_kb in zip(slices, s):
    g = g_ref[rows, ks]
    g_last = g_ref[last_row, ks]
    q = q_ref[rows, ks].astype(_F32) * scale
    o = o + dot(q * exp(g), s_kb, cfg)
    k = k_ref[rows, ks].astype(_F32)
    s_next.append(jnp.transpose(exp(g_last)) * s_kb
                  + dot(k * exp(g_last - g), v_new, cfg, ta=True))
  o_ref[rows, :] = o.astype(o_ref.dtype)
  return v_new, tuple(s_next)


def chunk_state_loop(chunk_fn, meta_refs, h0_ref, ht_ref, save_refs, *, num_chunks: int,
                     chunk_size: int, slices, block_v: int, varlen: bool):
  """The GPU forward state kernels' loop over one program's chunks, in order.

  Per chunk i: the entering state is h0's row seq_n[i] where the chunk starts
  a sequence, else the carried one; `chunk_fn` advances it; with `save_refs`
  the entering state and V' are stored; the leaving state is written to ht's
  row seq_n[i] where the chunk ends a sequence.

  Fixed length (not `varlen`) the program's rows are one sequence: h0's only
  row enters chunk 0 and the last chunk's state goes to ht, outside the loop,
  and the metadata is not read. Inside the loop the per-chunk selection would
  load a whole [K, BV] f32 h0 block every chunk (registers and pipelined
  shared memory the loop needs for its operands).

  Args:
    chunk_fn(s, rows, last_row) -> (v_new [C, BV] f32, s_next): one chunk;
      s and s_next are tuples of [block_k, BV] f32 K slices of the state,
      rows / last_row the chunk's row slice and its last row.
    meta_refs: (first_ref, last_ref, seq_ref), int32 [NC] each.
    h0_ref, ht_ref: [Nh', K, BV] initial and final states (Nh' = 1 when not
      varlen).
    save_refs: () or (hs_ref [NC*K, BV], vn_ref [Tp, BV]).
    slices: the K slices (`k_slices`).
    varlen: the chunks hold several sequences (the metadata says where).
  """
  first_ref, last_ref, seq_ref = meta_refs
  c = chunk_size
  dk = sum(ks.size for ks in slices)

  def body(i, s):
    if varlen:
      seq = seq_ref[i]
      s = tuple(jnp.where(first_ref[i] != 0, h0_ref[seq, ks, :].astype(_F32), s_kb)
                for ks, s_kb in zip(slices, s))
    start = pl.multiple_of(i * c, c)
    rows = pl.ds(start, c)
    v_new, s_next = chunk_fn(s, rows, pl.ds(start + c - 1, 1))
    if save_refs:
      hs_ref, vn_ref = save_refs
      base = pl.multiple_of(i * dk, dk)
      for ks, s_kb in zip(slices, s):
        at = pl.multiple_of(base + ks.start, ks.size)
        hs_ref[pl.ds(at, ks.size), :] = s_kb.astype(hs_ref.dtype)
      vn_ref[rows, :] = v_new.astype(vn_ref.dtype)
    if varlen:
      @pl.when(last_ref[i] != 0)
      def _():
        for ks, s_kb in zip(slices, s_next):
          ht_ref[seq, ks, :] = s_kb

    return s_next

  if varlen:
    lax.fori_loop(0, num_chunks, body,
                  tuple(jnp.zeros((ks.size, block_v), _F32) for ks in slices))
    return
  s_last = lax.fori_loop(0, num_chunks, body,
                         tuple(h0_ref[0, ks, :].astype(_F32) for ks in slices))
  for ks, s_kb in zip(slices, s_last):
    ht_ref[0, ks, :] = s_kb


def _state_fwd_kernel(first_ref, last_ref, seq_ref, q_ref, k_ref, g_ref, w_ref, u_ref,
                      aqk_ref, h0_ref, o_ref, ht_ref, *save_refs, scale, chunk_size,
                      cfg, varlen):
  tp, dk = q_ref.shape

  def chunk(s, rows, last_row):
    return state_fwd_chunk(s, rows, last_row, q_ref, k_ref, g_ref, w_ref, u_ref, aqk_ref,
                           o_ref, scale=scale, cfg=cfg)

  chunk_state_loop(chunk, (first_ref, last_ref, seq_ref), h0_ref, ht_ref, save_refs,
                   num_chunks=tp // chunk_size, chunk_size=chunk_size,
                   slices=k_slices(cfg, dk), block_v=u_ref.shape[-1], varlen=varlen)


def _state_fwd_kernel_tpu(first_ref, last_ref, seq_ref, q_ref, k_ref, g_ref, w_ref, u_ref,
                          aqk_ref, h0_ref, o_ref, ht_ref, *rest, scale, cfg, save):
  """One chunk per grid step (last grid axis, sequential); state in VMEM scratch.

  The scratch holds the whole [K, BV] state; it is read and written in the
  same K slices as on the GPU (one slice with the TPU default block_k = K).
  """
  save_refs, s_ref = rest[:-1], rest[-1]
  i = pl.program_id(3)
  c = q_ref.shape[0]
  seq = seq_ref[i]
  slices = k_slices(cfg, q_ref.shape[-1])

  @pl.when(first_ref[i] != 0)
  def _():
    s_ref[...] = h0_ref[seq].astype(_F32)

  s = tuple(s_ref[ks, :] for ks in slices)
  v_new, s_next = state_fwd_chunk(s, pl.ds(0, c), pl.ds(c - 1, 1), q_ref, k_ref, g_ref, w_ref,
                                  u_ref, aqk_ref, o_ref, scale=scale, cfg=cfg)
  if save:
    hs_ref, vn_ref = save_refs
    for ks, s_kb in zip(slices, s):
      hs_ref[ks, :] = s_kb.astype(hs_ref.dtype)
    vn_ref[...] = v_new.astype(vn_ref.dtype)
  for ks, s_kb in zip(slices, s_next):
    s_ref[ks, :] = s_kb

  @pl.when(last_ref[i] != 0)
  def _():
    for ks, s_kb in zip(slices, s_next):
      ht_ref[seq, ks, :] = s_kb


def state_fwd(meta, q, k, g_cum, w, u, a_qk, h0, *, heads, chunk_size, scale,
              cfg: KernelConfig, varlen: bool, save: bool = False, out_dtype=None):
  """Runs the state kernel over all chunks.

  Each program carries S [K, BV] as K/block_k slices of [block_k, BV] and
  does the per-channel work on [C, block_k] tiles (`k_slices`).

  Args:
    meta: (first_n, last_n, seq_n), int32 [NC] each: chunk starts / ends a
      sequence, and its state row (index into h0 / ht within the block).
    q, k, g_cum, w: [B, Tp, H*K]; u: [B, Tp, H*V]; a_qk: [B, H, Tp, C].
    h0: [Nh, H, K, V] f32. Fixed-length: Nh = B, one row per batch row;
      varlen (B == 1): all sequence rows.
    save: also return per-chunk entry states [B, H, NC*K, V] f32 and V'
      [B, Tp, H*V] f32 for the backward.

  Returns:
    o [B, Tp, H*V] (out_dtype), ht [Nh, H, K, V] f32 (rows of sequences that
    end; others untouched), and (hs, v_new) if save.
  """
  b, tp, _ = q.shape
  dv = u.shape[-1] // heads
  grid = state_grid(q.shape, dv, heads=heads, chunk_size=chunk_size, cfg=cfg, varlen=varlen,
                    num_state_rows=h0.shape[0])
  out_shape = [jax.ShapeDtypeStruct((b, tp, heads * dv), out_dtype or q.dtype),
               jax.ShapeDtypeStruct(h0.shape, _F32)]
  out_specs = [grid.v, grid.state]
  if save:
    out_shape += [jax.ShapeDtypeStruct((b, heads, (tp // chunk_size) * grid.dk, dv), _F32),
                  jax.ShapeDtypeStruct((b, tp, heads * dv), _F32)]
    out_specs += [grid.chunk_states, grid.v]
  if cfg.is_tpu:
    kernel = functools.partial(_state_fwd_kernel_tpu, scale=scale, cfg=cfg, save=save)
  else:
    kernel = functools.partial(_state_fwd_kernel, scale=scale, chunk_size=chunk_size, cfg=cfg,
                               varlen=varlen)
  return pl.pallas_call(
      kernel, grid=grid.grid,
      in_specs=[grid.meta] * 3 + [grid.k] * 4 + [grid.v, grid.a, grid.state],
      out_specs=out_specs, out_shape=out_shape, interpret=cfg.interpret,
      name="kda_state_fwd", **state_launch_options(cfg, "state_fwd", grid),
  )(*meta, q, k, g_cum, w, u, a_qk, h0)
