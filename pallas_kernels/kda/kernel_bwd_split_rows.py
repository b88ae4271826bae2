"""Row-tile variant of the split backward's second kernel (`intra_bwd_impl="split_rows"`).

`kernel_bwd_split.intra_bwd_k` gives each (chunk, K slice) program all C
rows. Its anchored score gradients then take one masked [C, C] x [C, BK]
product per row tile and side, four times the useful work at C = 64, L = 16,
and the body holds a dozen [C, BK] f32 accumulators: on the H200 (B16 T2048
H16 D128 bf16) Nsight Compute showed 255 registers per thread, 12.5%
occupancy and 5.1 ms.

Here the grid gains the row-tile axis, (B, H, NC, K / BK, C / L), and each
program writes only the L rows of its tile c, from:

* the state and W terms of rows c ([L, V] x [V, BK] products);
* the row side of the scores: rows c of dA_qk and dA ([L, C], stored by
  kernel 1, already masked) times tile c's anchored column operand [C, BK];
* the column side: for each row tile r >= c (r > c for `pairwise`), the
  [L, L] block (r, c) read as rows c, columns r of the stored transposes,
  times tile r's anchored row operand [L, BK], with tile r's anchor on both
  sides (as `kernel_bwd.add_score_grads`, so dG's reverse cumsum cancels);
* `pairwise`: the explicit pair decay of the diagonal tile c.

The state decay's gradient at the chunk's last row, sum over all C rows of
(k e^{G_last - G}) * (V' dS^T), is formed by the last tile's program alone
(`lax.cond`), so every output element has one writer. Same outputs and
contract as `intra_bwd_k`. Not lowered for TPU.

Measured on the H200 (B16 T2048 H16 D128 bf16, same call as "split"): it
passes the GPU gradient checks, but the kernel took 13.1 ms at 8 warps and
7.0 ms at 4, against 5.0 ms for `intra_bwd_k`. Not profiled; the likely
cost is that four programs per (chunk, slice) each re-read the whole-chunk
q, k, g and the state slices for little work. So it stays opt-in.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_bwd import fold_pair_tile_grads
from pallas_kernels.kda.kernel_config import KernelConfig
from pallas_kernels.kda.kernel_fwd import dot, iota, k_slices

_F32 = jnp.float32


def _at(tile, ell):
  """First row of row tile `tile` (a Python int, or a traced grid index)."""
  return tile * ell if isinstance(tile, int) else pl.multiple_of(tile * ell, ell)


def _next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def tile_grads(tile, q_ref, k_ref, g_ref, beta_ref, do_ref, vn_ref, du_ref, hs_ref, dhs_ref,
               da_ref, daq_ref, dat_ref, daqt_ref, *, scale, ell, diagonal, cfg: KernelConfig):
  """Gradients of the L rows of row tile `tile` of one chunk, one K slice.

  Refs are the whole chunk's blocks: q_ref, k_ref, g_ref [C, BK]; beta_ref
  [C, 1]; do_ref, vn_ref, du_ref [C, V]; hs_ref, dhs_ref [BK, V]; da_ref,
  daq_ref, dat_ref, daqt_ref [C, C]. `tile` is a Python int (the row loop of
  `row_loop_kernel`: the row side then reads only the next power of two of
  the visible columns) or a traced grid index (`intra_bwd_k_rows`).

  Returns:
    dq (w.r.t. the scaled q), dk, dG [L, BK] f32 (dG without the chunk's
    G_last term), dbeta [L, 1] f32, and the tile's part of the G_last term's
    row sum, sum over its rows of (k e^{G_last - G}) * (V' dS^T), [1, BK].
  """
  cfg = cfg.intra(backward=True)
  c = q_ref.shape[0]
  nr = c // ell
  start = _at(tile, ell)
  rows = pl.ds(start, ell)
  sdt = cfg.score_mm_dtype
  rnd = lambda x: x.astype(sdt).astype(_F32)

  q_c = q_ref[rows, :].astype(_F32) * scale
  k_c = k_ref[rows, :].astype(_F32)
  g_c = g_ref[rows, :]
  beta_c = beta_ref[rows, :]
  s = hs_ref[...]            # [BK, V] rows of the state entering the chunk
  ds = dhs_ref[...]          # [BK, V] rows of the gradient of the state leaving it
  eg = jnp.exp(g_c)
  g_last = g_ref[pl.ds(c - 1, 1), :]

  # O += (q e^G) S.
  dqt = dot(do_ref[rows, :], s, cfg, tb=True)
  dq = eg * dqt
  dg = q_c * eg * dqt
  # S_next = e^{G_last} S + (k e^{G_last - G})^T V'.
  kk = k_c * jnp.exp(g_last - g_c)
  dkt = dot(vn_ref[rows, :], ds, cfg, tb=True)
  dk = jnp.exp(g_last - g_c) * dkt
  dg = dg - kk * dkt
  last_part = jnp.sum(kk * dkt, axis=0, keepdims=True)
  # W = M (beta k e^G): d(beta k e^G) = -dU~ S^T.
  dbkg = -dot(du_ref[rows, :], s, cfg, tb=True)
  dbeta = jnp.sum(dbkg * k_c * eg, axis=1, keepdims=True)
  dk = dk + beta_c * eg * dbkg
  dg = dg + beta_c * k_c * eg * dbkg

  # Scores, row side: rows of the tile against the columns its anchored
  # product sees (masked: zero beyond them, exponents masked before exp).
  anchor = g_ref[pl.ds(start, 1), :]
  row_f = jnp.exp(g_c - anchor)
  xq_c = rnd(q_c * row_f)
  xk_c = rnd(beta_c * k_c * row_f)
  vis_end = start + ell if diagonal == "dense" else start
  ncol = c if not isinstance(tile, int) else min(c, _next_pow2(vis_end))
  r_acc = jnp.zeros_like(dq)  # sum_j dA_ij k_j e^{G_i - G_j}
  if ncol:
    cols = pl.ds(0, ncol)
    visible = iota((ncol, 1), 0) < vis_end
    yk = rnd(jnp.where(visible, k_ref[cols, :].astype(_F32)
                       * jnp.exp(jnp.where(visible, anchor - g_ref[cols, :], 0.0)), 0.0))
    t_q = dot(rnd(daq_ref[rows, cols].astype(_F32)), yk, cfg, dtype=sdt)
    t_k = dot(rnd(da_ref[rows, cols].astype(_F32)), yk, cfg, dtype=sdt)
    dq = dq + row_f * t_q
    r_acc = row_f * t_k
    dg = dg + xq_c * t_q + xk_c * t_k

  # Scores, column side: block (r, tile) of every later row tile r, anchored at r.
  def column_block(r, carry):
    dk, dg = carry
    rows_r = pl.ds(_at(r, ell), ell)
    anchor_r = g_ref[pl.ds(_at(r, ell), 1), :]
    row_f_r = jnp.exp(g_ref[rows_r, :] - anchor_r)
    xq_r = rnd(q_ref[rows_r, :].astype(_F32) * scale * row_f_r)
    xk_r = rnd(beta_ref[rows_r, :] * k_ref[rows_r, :].astype(_F32) * row_f_r)
    t_c = (dot(rnd(daqt_ref[rows, rows_r].astype(_F32)), xq_r, cfg, dtype=sdt)
           + dot(rnd(dat_ref[rows, rows_r].astype(_F32)), xk_r, cfg, dtype=sdt))
    col_f = jnp.exp(anchor_r - g_c)
    return dk + col_f * t_c, dg - rnd(k_c * col_f) * t_c

  first = tile if diagonal == "dense" else tile + 1
  if isinstance(tile, int):
    for r in range(first, nr):
      dk, dg = column_block(r, (dk, dg))
  else:
    dk, dg = lax.fori_loop(first, nr, column_block, (dk, dg))

  if diagonal == "pairwise":
    diag = (rows, rows)
    dq, r_acc, dk, dg = fold_pair_tile_grads(
        (dq, r_acc, dk, dg), q_c, k_c, beta_c, (q_ref, k_ref, g_ref, beta_ref),
        daq_ref[diag].astype(_F32), da_ref[diag].astype(_F32), start, scale)

  dk = dk + beta_c * r_acc
  dbeta = dbeta + jnp.sum(k_c * r_acc, axis=1, keepdims=True)
  return dq, dk, dg, dbeta, last_part


def _last_row(dg, dglast):
  """Adds the chunk's G_last term [1, BK] to the last row of a tile's dG [L, BK]."""
  ell = dg.shape[0]
  return dg + jnp.where(iota((ell, 1), 0) == ell - 1, dglast, 0.0)


def _state_decay_grad(g_ref, hs_ref, dhs_ref):
  """sum_v dS * S * e^{G_last}, the state-decay part of G_last's gradient, [1, BK]."""
  c = g_ref.shape[0]
  g_last = g_ref[pl.ds(c - 1, 1), :]
  s, ds = hs_ref[...], dhs_ref[...]
  return jnp.transpose(jnp.sum(ds * s, axis=1, keepdims=True)) * jnp.exp(g_last)


def _row_tile_kernel(q_ref, k_ref, g_ref, beta_ref, do_ref, vn_ref, du_ref, hs_ref, dhs_ref,
                     da_ref, daq_ref, dat_ref, daqt_ref, dq_ref, dk_ref, dg_ref, dbeta_ref,
                     *, scale, ell, diagonal, cfg):
  """One row tile (grid axis 4) of one chunk and K slice. Inputs: whole-chunk
  blocks as `tile_grads`; outputs: dq_ref, dk_ref, dg_ref [L, BK], dbeta_ref
  [L, 1] (rows of the tile)."""
  tile = pl.program_id(4)
  nr = q_ref.shape[0] // ell
  refs = (q_ref, k_ref, g_ref, beta_ref, do_ref, vn_ref, du_ref, hs_ref, dhs_ref, da_ref,
          daq_ref, dat_ref, daqt_ref)
  dq, dk, dg, dbeta, _ = tile_grads(tile, *refs, scale=scale, ell=ell, diagonal=diagonal,
                                    cfg=cfg)

  # d(S_next)/d(G_last), a sum over the whole chunk: the last tile's program adds it.
  def last_row_grad():
    return (_whole_chunk_decay_part(k_ref, g_ref, vn_ref, dhs_ref, cfg)
            + _state_decay_grad(g_ref, hs_ref, dhs_ref))

  dglast = lax.cond(tile == nr - 1, last_row_grad, lambda: jnp.zeros_like(dg[:1]))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dg_ref[...] = _last_row(dg, dglast)
  dbeta_ref[...] = dbeta


def _whole_chunk_decay_part(k_ref, g_ref, vn_ref, dhs_ref, cfg):
  """sum over the chunk's rows of (k e^{G_last - G}) * (V' dS^T), [1, BK]."""
  cfg = cfg.intra(backward=True)
  c = k_ref.shape[0]
  g_last = g_ref[pl.ds(c - 1, 1), :]
  dkt = dot(vn_ref[...], dhs_ref[...], cfg, tb=True)
  kk = k_ref[...].astype(_F32) * jnp.exp(g_last - g_ref[...])
  return jnp.sum(kk * dkt, axis=0, keepdims=True)


def row_loop_kernel(q_ref, k_ref, g_ref, beta_ref, do_ref, hs_ref, dhs_ref, vn_ref, du_ref,
                    da_ref, daq_ref, dat_ref, daqt_ref, dq_ref, dk_ref, dg_ref, dbeta_ref,
                    *, scale, ell, diagonal, cfg):
  """`intra_bwd_impl="split_loop"`: one (chunk, K slice) program, as
  `kernel_bwd_split._intra_bwd_k_kernel` (same refs and outputs), looping over
  the row tiles and writing each tile's L rows (`tile_grads`): every tile is
  [L, BK], so no [C, BK] accumulator or masked [C, C] operand is live."""
  nr = q_ref.shape[0] // ell
  refs = (q_ref, k_ref, g_ref, beta_ref, do_ref, vn_ref, du_ref, hs_ref, dhs_ref, da_ref,
          daq_ref, dat_ref, daqt_ref)
  dglast = _state_decay_grad(g_ref, hs_ref, dhs_ref)
  for tile in range(nr):
    dq, dk, dg, dbeta, part = tile_grads(tile, *refs, scale=scale, ell=ell, diagonal=diagonal,
                                         cfg=cfg)
    dglast = dglast + part     # complete once the last tile's rows are in
    rows = pl.ds(tile * ell, ell)
    dq_ref[rows, :] = (dq * scale).astype(dq_ref.dtype)
    dk_ref[rows, :] = dk.astype(dk_ref.dtype)
    dg_ref[rows, :] = _last_row(dg, dglast) if tile == nr - 1 else dg
    dbeta_ref[rows, :] = dbeta


def intra_bwd_k_rows(q, k, g_cum, beta, do, hs, dhs, v_new, du, da, daq, dat, daqt, *, heads,
                     chunk_size, sub_chunk, diagonal, scale, cfg: KernelConfig,
                     grad_dtype=_F32):
  """Kernel 2 of the split backward by row tile, grid (B, H, NC, K / bwd_block_k, C / L).

  Args and returns as `kernel_bwd_split.intra_bwd_k`: dq, dk [B, Tp, H*K]
  (grad_dtype), dG [B, Tp, H*K] f32, dbeta's per-slice parts
  [B, H, NK, Tp, 1] f32.
  """
  b, tp, hk = q.shape
  h, c, ell = heads, chunk_size, sub_chunk
  dk_, dv_ = hk // h, do.shape[-1] // h
  nc, nr = tp // c, c // ell
  slices = k_slices(cfg, dk_, cfg.bwd_block_k)
  bk, nk = slices[0].size, len(slices)
  grid = (b, h, nc, nk, nr)
  chunk_k = pl.BlockSpec((None, c, bk), lambda ib, ih, ic, ik, ir: (ib, ic, ih * nk + ik))
  chunk_b = pl.BlockSpec((None, None, c, 1), lambda ib, ih, ic, ik, ir: (ib, ih, ic, 0))
  chunk_v = pl.BlockSpec((None, c, dv_), lambda ib, ih, ic, ik, ir: (ib, ic, ih))
  state = pl.BlockSpec((None, None, bk, dv_),
                       lambda ib, ih, ic, ik, ir: (ib, ih, ic * nk + ik, 0))
  chunk_cc = pl.BlockSpec((None, None, c, c), lambda ib, ih, ic, ik, ir: (ib, ih, ic, 0))
  tile_k = pl.BlockSpec((None, ell, bk),
                        lambda ib, ih, ic, ik, ir: (ib, ic * nr + ir, ih * nk + ik))
  tile_b = pl.BlockSpec((None, None, None, ell, 1),
                        lambda ib, ih, ic, ik, ir: (ib, ih, ik, ic * nr + ir, 0))
  kernel = functools.partial(_row_tile_kernel, scale=scale, ell=ell, diagonal=diagonal, cfg=cfg)
  return pl.pallas_call(
      kernel, grid=grid,
      in_specs=[chunk_k, chunk_k, chunk_k, chunk_b] + [chunk_v] * 3 + [state] * 2
      + [chunk_cc] * 4,
      out_specs=[tile_k] * 3 + [tile_b],
      out_shape=[jax.ShapeDtypeStruct((b, tp, hk), grad_dtype)] * 2
      + [jax.ShapeDtypeStruct((b, tp, hk), _F32), jax.ShapeDtypeStruct((b, h, nk, tp, 1), _F32)],
      compiler_params=cfg.compiler_params("intra_bwd_k", grid_rank=5),
      interpret=cfg.interpret, name="kda_intra_bwd_k_rows",
  )(q, k, g_cum, beta, do, v_new, du, hs, dhs, da, daq, dat, daqt)
