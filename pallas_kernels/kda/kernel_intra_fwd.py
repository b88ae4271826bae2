"""Intra-chunk forward of chunked KDA (`kda_intra_fwd`).

Grid (B, H, chunks), all parallel. Per chunk it builds the anchored scores
A_kk (strictly lower) and A_qk (lower), inverts the unit lower-triangular
I + A_kk in f32, and writes W = M (beta k e^G), U = M (beta v), A_qk (and M,
and the gated keys and queries, when asked). `KernelConfig.inverse` selects
the body:

* "blocked" (the GPU's): whole-tile score products summed over K slices of
  at most `KernelConfig.block_k` channels, then M by recursive 2 x 2 blocking, every
  step a tensor-core product;
* "substitution" (the TPU's, and the GPU's when sub_chunk < 16): scores per
  [L, C] row block, then forward substitution over the whole [C, C] tile,
  row by row.

`pairwise` forms the diagonal tiles' scores by levels of nested anchors
(`kernel_common.level_factors`) in both bodies; the off-diagonal tiles are
the same anchored products as dense.

Layouts (prepared by `pallas_op`): q, k, g_cum, w as [B, Tp, H*K]; v, u as
[B, Tp, H*V]; beta as [B, H, Tp, 1]; A_qk and M as [B, H, Tp, C]. Tp = NC * C.

With runs (`segment_ids`: the state restarts inside chunks) two int32
inputs describe them (`kernel_common.run_codes`): per position code =
4 run + 2 carry + last ([B, Tp, 1], a column) and each chunk's runs as a
[1, C] row ([B, NC, 1, C]). Both scores keep only same-run pairs, so M is
block-diagonal by run; W and the gated queries keep only the rows that carry
the incoming state, the gated keys only the rows of the chunk's last run
(`tiling.RunMasks`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_common import (DIAG_SHIFT, RunFlags, chunk_specs, dot, exp,
                                              iota, k_slices, keep_rows, anchor_picker,
                                              level_factors, pair_levels, run_flags, same_block,
                                              shifted_pair, tile_factors, width_slices)
from pallas_kernels.kda import kernel_diag
from pallas_kernels.kda.kernel_config import KernelConfig

_F32 = jnp.float32


class IntraFwdOut(NamedTuple):
  """Outputs of `intra_fwd`: w [B, Tp, H*K], u [B, Tp, H*V] and a_qk
  [B, H, Tp, C] (cfg.mm_dtype); m [B, H, Tp, C] (save_m); kg, qg
  [B, Tp, H*K] (cfg.mm_dtype; save_gated). Unrequested ones are None."""
  w: jax.Array
  u: jax.Array
  a_qk: jax.Array
  m: jax.Array | None = None
  kg: jax.Array | None = None
  qg: jax.Array | None = None


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


def recursive_unit_lower_inverse(a_cc, ell: int, cfg: KernelConfig, dtype=None):
  """(I + A)^-1 of a strictly lower-triangular A [C, C] by recursive 2 x 2 blocking.

  With M_s the inverse of I + A restricted to its diagonal s x s blocks and
  E_s the entries of A in the lower-left s x s quadrants of the 2s x 2s
  diagonal blocks, [[P, 0], [X, Q]]^-1 = [[P^-1, 0], [-Q^-1 X P^-1, Q^-1]]
  gives M_2s = M_s - (M_s E_s) M_s, all as [C, C] products. M_2 = I - A_2
  (2 x 2 blocks are nilpotent of order 2). log2(C) - 1 levels, two dependent
  products each: 10 at C = 64. Only
  products of inverse blocks with blocks of A are formed, never powers of A,
  so no large terms cancel (the blocked triangular inversion of LAPACK's
  trtri). Levels whose blocks are at most L wide take `cfg.diag_dtype`
  operands, the wider ones `dtype` (default f32).

  Args:
    a_cc: [C, C] f32, zero on and above the diagonal.

  Returns:
    M [C, C] f32, unit lower triangular.
  """
  c = a_cc.shape[0]
  dtype = _F32 if dtype is None else dtype
  row, col = iota((c, 1), 0), iota((1, c), 1)

  # Reuses row and col: kernel_common.same_block would form fresh iotas per level.
  def in_block(s):                                   # [C, C]: i, j in one s-block
    return jnp.bitwise_and(row, -s) == jnp.bitwise_and(col, -s)

  m = jnp.where(row == col, 1.0, 0.0) - jnp.where(in_block(2), a_cc, 0.0)
  s = 2
  while s < c:
    quadrant = in_block(2 * s) & jnp.logical_not(in_block(s))
    prec = cfg.diag_dtype if 2 * s <= ell else dtype
    t = dot(m, jnp.where(quadrant, a_cc, 0.0), cfg, dtype=prec)
    m = m - dot(t, m, cfg, dtype=prec)
    s *= 2
  return m


def _run_flags(run_refs, rows=None) -> RunFlags | None:
  """`kernel_common.run_flags` of the chunk's run refs (code, run), or None without runs."""
  return None if run_refs is None else run_flags(*run_refs, rows=rows)


def _intra_fwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, scale, ell, diagonal, cfg,
                      save_m, save_gated, runs):
  """Row-block scores and full-tile forward substitution (`inverse="substitution"`)."""
  run_refs, (w_ref, u_ref, aqk_ref, *opt_refs) = (refs[:2], refs[2:]) if runs else (None, refs)
  c = q_ref.shape[0]
  k = k_ref[...].astype(_F32)
  g = g_ref[...]
  sdt = cfg.mm_dtype
  col = iota((1, c), 1)
  row_l = iota((ell, 1), 0)
  akk_blocks = []
  # pairwise: each level's column operand over the whole chunk; the product's
  # 2s-block mask keeps tile r's columns for tile r's rows.
  levels = pair_levels(ell) if diagonal == "pairwise" else []
  level_cols = [k * level_factors(g, s, anchor_picker(cfg, g_ref))[1] for s in levels]
  # Row sub-tile r: its L rows against all columns, anchored at its first row.
  for r in range(c // ell):
    rows = pl.ds(r * ell, ell)
    q_l = q_ref[rows, :].astype(_F32) * scale
    bk_l = beta_ref[rows, :] * k_ref[rows, :].astype(_F32)
    row_g = row_l + r * ell
    if diagonal == "pairwise" and r == 0:
      p_qk = p_kk = jnp.zeros((ell, c), _F32)     # no earlier tile to see
    else:
      anchor = g_ref[pl.ds(r * ell, 1), :]
      row_f = exp(g_ref[rows, :] - anchor, DIAG_SHIFT)   # <= 2^DIAG_SHIFT, as tile_factors'
      _, col_f = tile_factors(g, anchor, r, ell, diagonal)
      yk = k * col_f
      p_qk = dot(q_l * row_f, yk, cfg, tb=True, dtype=sdt)
      p_kk = dot(bk_l * row_f, yk, cfg, tb=True, dtype=sdt)
    for s, yk_s in zip(levels, level_cols):
      row_s, _ = level_factors(g_ref[rows, :], s, anchor_picker(cfg, g_ref, r * ell))
      blk = jnp.bitwise_and(row_g, -2 * s) == jnp.bitwise_and(col, -2 * s)
      p_qk = p_qk + jnp.where(blk, dot(q_l * row_s, yk_s, cfg, tb=True, dtype=sdt), 0.0)
      p_kk = p_kk + jnp.where(blk, dot(bk_l * row_s, yk_s, cfg, tb=True, dtype=sdt), 0.0)
    if diagonal == "pairwise":                           # A_qk[i, i] = q_i . k_i
      k_l = k_ref[rows, :].astype(_F32)
      p_qk = jnp.where(col == row_g, jnp.sum(q_l * k_l, axis=1, keepdims=True), p_qk)
    qk_mask, kk_mask = col <= row_g, col < row_g
    if runs:
      same = _run_flags(run_refs, rows).same
      qk_mask, kk_mask = qk_mask & same, kk_mask & same
    aqk_ref[rows, :] = jnp.where(qk_mask, p_qk, 0.0).astype(aqk_ref.dtype)
    akk_blocks.append(jnp.where(kk_mask, p_kk, 0.0))
  m = unit_lower_inverse(akk_blocks)
  write_outputs(m, q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, opt_refs, scale=scale,
                cfg=cfg, save_m=save_m, save_gated=save_gated, flags=_run_flags(run_refs))


def _blocked_slice_scores(p_qk, p_kk, q_ref, k_ref, g_ref, beta_ref, ks, *, scale, ell,
                          diagonal, cfg, levels=True):
  """Adds one K slice's anchored score products to the [C, C] accumulators.

  The decay e^{G_i - G_j} is a per-channel product, so the scores
  sum_d x_id k_jd e^{G_id - G_jd} split into per-slice sums; every factor
  below is formed on [C, BK] tiles only.

  Args:
    p_qk, p_kk: [C, C] f32 partial sums of A_qk and A_kk (unmasked above the
      diagonal; the caller masks).
    ks: static `pl.ds` of the slice's BK channels.

    levels: pairwise only: form the diagonal tiles here; False when
      `kernel_diag.diag_scores` has formed them.

  Returns:
    (p_qk, p_kk) plus this slice's diagonal-tile products (dense: one
    anchored product per score; pairwise: `_level_slice_scores`, with
    `levels`) and off-diagonal-tile products.
  """
  if diagonal == "pairwise" and levels:
    # First, while none of the anchored operands below is live.
    p_qk, p_kk = _level_slice_scores(p_qk, p_kk, q_ref, k_ref, g_ref, beta_ref, ks,
                                     scale=scale, ell=ell, cfg=cfg)
  c = q_ref.shape[0]
  nt = c // ell
  sdt = cfg.mm_dtype
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
  # The anchored factors carry 2^+-DIAG_SHIFT (`kernel_common.tile_factors`).
  row_f, own_f = shifted_pair(g - a_own)                         # <= 2^DIAG_SHIFT; own tile
  xq = q_ref[:, ks].astype(_F32) * scale * row_f
  xk = beta_ref[...] * k * row_f
  k_next = k * exp(a_next - g, -DIAG_SHIFT)                      # <= 2^-DIAG_SHIFT off the last tile
  if diagonal == "dense":
    same = jnp.zeros((c, c), jnp.bool_)
    for r in range(nt):
      same = same | (in_tile[r] & (col >= r * ell) & (col < (r + 1) * ell))
    k_own = k * own_f                                            # <= e^{|g_min| (L-1)} 2^-DIAG_SHIFT
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


def _level_slice_scores(p_qk, p_kk, q_ref, k_ref, g_ref, beta_ref, ks, *, scale, ell, cfg):
  """Adds one K slice of the pairwise diagonal tiles to the [C, C] accumulators.

  One masked product per level and score (`kernel_common.level_factors`), from
  the unanchored x = scale q, beta k; then A_qk's diagonal q_i . k_i (no decay).
  Shapes as `_blocked_slice_scores`.
  """
  c = q_ref.shape[0]
  sdt = cfg.mm_dtype
  g = g_ref[:, ks]
  k = k_ref[:, ks].astype(_F32)
  xq = q_ref[:, ks].astype(_F32) * scale
  xk = beta_ref[...] * k
  for s in pair_levels(ell):
    row_f, col_f = level_factors(g, s, anchor_picker(cfg, g_ref, cols=ks))
    blk = same_block(c, 2 * s)
    k_s = k * col_f
    p_qk = p_qk + jnp.where(blk, dot(xq * row_f, k_s, cfg, tb=True, dtype=sdt), 0.0)
    p_kk = p_kk + jnp.where(blk, dot(xk * row_f, k_s, cfg, tb=True, dtype=sdt), 0.0)
  eye = iota((c, 1), 0) == iota((1, c), 1)
  return p_qk + jnp.where(eye, jnp.sum(xq * k, axis=1, keepdims=True), 0.0), p_kk


def _intra_fwd_blocked_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, scale, ell, diagonal,
                              cfg, save_m, save_gated, diag_tiles, runs):
  """K-sliced scores and the blocked inverse (`inverse="blocked"`), then W and U:
  `blocked_scores_inverse` followed by `write_w_u` in one program. With
  `diag_tiles` the first two refs are `kernel_diag.diag_scores`' [C, L] tiles;
  with `runs` the next two are the chunk's run refs (code [C, 1], run [1, C])."""
  tiles, refs = (refs[:2], refs[2:]) if diag_tiles else (None, refs)
  run_refs, (w_ref, u_ref, aqk_ref, *opt_refs) = (refs[:2], refs[2:]) if runs else (None, refs)
  flags = _run_flags(run_refs)
  m = blocked_scores_inverse(q_ref, k_ref, g_ref, beta_ref, aqk_ref, scale=scale, ell=ell,
                             diagonal=diagonal, cfg=cfg, diag_tiles=tiles,
                             same=None if flags is None else flags.same)
  write_outputs(m, q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, opt_refs, scale=scale,
                cfg=cfg, save_m=save_m, save_gated=save_gated, flags=flags)


def blocked_scores_inverse(q_ref, k_ref, g_ref, beta_ref, aqk_ref, *, scale, ell, diagonal, cfg,
                           diag_tiles=None, same=None):
  """One chunk's anchored scores and M = (I + A_kk)^-1; writes A_qk.

  Scores, with a_r = G[r L] the first row of tile r and t(i) the tile of row i:
  * diagonal tiles (dense), all at once: (x e^{G - a_t(i)}) (k e^{a_t(j) - G})^T
    masked to i, j in one tile; row factors <= 1, column factors
    <= e^{|g_min| (L - 1)};
  * diagonal tiles (pairwise), one product per level s = L/2, ..., 1
    (`kernel_common.level_factors`): (x e^{G - u_s}) (k e^{u_s - G})^T masked
    to aligned 2s-row blocks, all factors <= 1 for any gate; plus A_qk's
    diagonal q_i . k_i;
  * column tile s against all later rows, anchored at a_{s+1} (between every
    such row and column): (x e^{G - a_t(i)} e^{a_t(i) - a_{s+1}}) (k e^{a_{s+1} - G})^T,
    all factors <= 1.
  Anchors are first rows of tiles at or before every row using them. Both
  are summed over K slices of at most cfg.block_k channels (`_blocked_slice_scores`),
  so the element-wise work holds [C, BK] tiles, never [C, K] ones; per slice
  each score matrix takes C/L products of [C, BK] x [BK, C] (dense), or
  C/L - 1 + log2(L) (pairwise). Then
  M = (I + A_kk)^-1 by `recursive_unit_lower_inverse`.

  Args:
    q_ref, k_ref, g_ref: [C, K] refs of one chunk; beta_ref [C, 1];
    aqk_ref: [C, C] output ref of A_qk (lower triangle, zero above).
    cfg: the kernel config.
    diag_tiles: pairwise only: None (form the diagonal tiles here), or the
      [C, L] refs of their A_qk and A_kk from `kernel_diag.diag_scores`.
    same: None, or [C, C] bool, the same-run pairs: both scores keep only
      these (runs restarting inside the chunk).

  Returns:
    M [C, C] f32.
  """
  c, dk = q_ref.shape
  slices = k_slices(cfg, dk)
  row, col = iota((c, 1), 0), iota((1, c), 1)
  if diag_tiles is None:
    p_qk = p_kk = jnp.zeros((c, c), _F32)
  else:
    p_qk, p_kk = (kernel_diag.expand_tiles(ref, ell) for ref in diag_tiles)
  for ks in slices:
    p_qk, p_kk = _blocked_slice_scores(p_qk, p_kk, q_ref, k_ref, g_ref, beta_ref, ks,
                                       scale=scale, ell=ell, diagonal=diagonal, cfg=cfg,
                                       levels=diag_tiles is None)
  qk_mask, kk_mask = col <= row, col < row
  if same is not None:
    qk_mask, kk_mask = qk_mask & same, kk_mask & same
  aqk_ref[...] = jnp.where(qk_mask, p_qk, 0.0).astype(aqk_ref.dtype)
  return recursive_unit_lower_inverse(jnp.where(kk_mask, p_kk, 0.0), ell, cfg,
                                      dtype=cfg.mm_dtype)


def write_w_u(m, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, cfg, gated=None, flags=None):
  """W = M (beta k e^G) per K slice and U = M (beta v) per V slice.

  The V slices are at most block_k wide when K is sliced, else the whole V
  (one slice, as on TPU, keeps one product each), cut into powers of two
  (`width_slices`: 64 + 32 at V = 96). Operands are read per slice, so
  nothing [C, K]-sized is live next to M.

  Args:
    m: [C, C] (f32, or as stored; cast to cfg.mm_dtype as a matmul operand).
    k_ref, g_ref, w_ref: [C, K]; v_ref, u_ref: [C, V]; beta_ref [C, 1].
    cfg: the kernel config.
    gated: None, or (q_ref, scale, kg_ref, qg_ref) with [C, K] refs: also
      writes the decayed keys kg = k e^{G_last - G} (<= 1; the split state
      recurrence's operand) and the gated queries qg = (scale q) e^G (the
      split output kernel's and the reverse state kernel's), sharing e^G
      with W's slice.
    flags: None, or the chunk's `RunFlags`: W and qg keep the rows that carry
      the incoming state, kg those of the chunk's last run.
  """
  dk, dv = k_ref.shape[1], v_ref.shape[1]
  bk = cfg.block_k
  slices = k_slices(cfg, dk)
  last = pl.ds(k_ref.shape[0] - 1, 1)
  carry = last_run = None
  if flags is not None:
    carry, last_run = flags.carry, flags.last
  for ks in slices:
    k = k_ref[:, ks].astype(_F32)
    g = g_ref[:, ks]
    e_g = exp(g)
    w_ref[:, ks] = keep_rows(dot(m, beta_ref[...] * k * e_g, cfg), carry).astype(w_ref.dtype)
    if gated is not None:
      q_ref, scale, kg_ref, qg_ref = gated
      kg_ref[:, ks] = keep_rows(k * exp(g_ref[last, ks] - g), last_run).astype(kg_ref.dtype)
      qg_ref[:, ks] = keep_rows(q_ref[:, ks].astype(_F32) * scale * e_g, carry).astype(qg_ref.dtype)
  for vs in width_slices(dv, bk if bk < dk else None):
    u_ref[:, vs] = dot(m, beta_ref[...] * v_ref[:, vs].astype(_F32), cfg).astype(u_ref.dtype)


def write_outputs(m, q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, opt_refs, *, scale,
                  cfg, save_m, save_gated, flags=None):
  """The intra kernels' outputs after M: W and U (`write_w_u`, masked by the
  run `flags` if any), then, in the order of `opt_refs`, M (save_m) and the
  gated keys and queries (save_gated)."""
  opt_refs = list(opt_refs)
  if save_m:
    m_ref = opt_refs.pop(0)
    m_ref[...] = m.astype(m_ref.dtype)
  gated = (q_ref, scale, *opt_refs) if save_gated else None
  write_w_u(m, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, cfg, gated, flags)


def intra_fwd(q, k, v, g_cum, beta, *, heads, chunk_size, sub_chunk, diagonal, scale,
              cfg: KernelConfig, save_m: bool = False, save_gated: bool = False,
              m_dtype=_F32, runs=None):
  """Runs the intra-chunk kernel (body by `cfg.inverse`).

  With the pairwise diagonal and `cfg.diag_kernels`, `kernel_diag.diag_scores`
  forms the diagonal tiles first and the blocked body adds them.

  Args:
    q, k: [B, Tp, H*K]; v: [B, Tp, H*V]; g_cum: [B, Tp, H*K] f32 within-chunk
      cumsum; beta: [B, H, Tp, 1] f32.
    save_m: also return M = (I + A_kk)^-1 for the backward, stored in
      m_dtype (formed in f32; bf16 when the backward only uses it as a bf16
      matmul operand, `KernelConfig.saved_state_dtype`).
    save_gated: also return the decayed keys kg = k e^{G_last - G} (G_last
      the chunk's last row) and the gated queries qg = (scale q) e^G, the
      operands of `kernel_state_split` and of the gated reverse state kernel.
    runs: None, or the (code [B, Tp, 1], run [B, NC, 1, C]) int32 pair of
      `kernel_common.run_codes`: the state restarts inside chunks (the masks of the module
      docstring).

  Returns:
    IntraFwdOut (m only with save_m, kg and qg only with save_gated).
  """
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
  kw = dict(scale=scale, ell=sub_chunk, diagonal=diagonal, cfg=cfg, save_m=save_m,
            save_gated=save_gated, runs=runs is not None)
  args, in_specs = [q, k, v, g_cum, beta], [kspec, kspec, vspec, kspec, bspec]
  if cfg.inverse == "blocked":
    diag_tiles = diagonal == "pairwise" and cfg.diag_kernels
    kernel = functools.partial(_intra_fwd_blocked_kernel, diag_tiles=diag_tiles, **kw)
    if diag_tiles:
      args += kernel_diag.diag_scores(q, k, g_cum, beta, heads=h, chunk_size=c,
                                      sub_chunk=sub_chunk, scale=scale, cfg=cfg)
      in_specs += [pl.BlockSpec((None, None, c, sub_chunk),
                                lambda ib, ih, ic: (ib, ih, ic, 0))] * 2
  else:
    kernel = functools.partial(_intra_fwd_kernel, **kw)
  if runs is not None:
    args += list(runs)
    in_specs += list(spec.runs)
  w, u, a_qk, *rest = pl.pallas_call(
      kernel, grid=(b, h, nc),
      in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=cfg.compiler_params("intra_fwd"),
      interpret=cfg.interpret, name="kda_intra_fwd",
  )(*args)
  m = rest.pop(0) if save_m else None
  kg, qg = rest if save_gated else (None, None)
  return IntraFwdOut(w, u, a_qk, m, kg, qg)
