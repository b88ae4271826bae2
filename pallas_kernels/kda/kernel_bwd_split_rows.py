"""Row-tile variant of the split backward's second kernel (`intra_bwd_impl="split_rows"`).

`kernel_bwd_split.intra_bwd_k` gives each (chunk, K slice) program all C
rows. Its anchored score gradients then take one whole [C, C] x [C, BK]
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

from pallas_kernels.kda.kernel_bwd import fold_pair_tile_grads, state_decay_grad, state_term_grads
from pallas_kernels.kda.kernel_config import KernelConfig
from pallas_kernels.kda.kernel_fwd import dot, exp, iota, k_slices

_F32 = jnp.float32


def _row_tile_kernel(q_ref, k_ref, g_ref, beta_ref, do_ref, vn_ref, vn_all_ref, du_ref, hs_ref,
                     dhs_ref, da_ref, daq_ref, dat_ref, daqt_ref, dq_ref, dk_ref, dg_ref,
                     dbeta_ref, *, scale, ell, diagonal, cfg):
  """Rows of one row tile, one K slice. Block shapes:

  q_ref, k_ref, g_ref [C, BK] (the whole chunk); beta_ref [C, 1]; do_ref,
  vn_ref, du_ref [L, V] (rows of the tile); vn_all_ref [C, V]; hs_ref,
  dhs_ref [BK, V]; da_ref, daq_ref, dat_ref, daqt_ref [L, C] (rows of the
  tile). Outputs: dq_ref, dk_ref, dg_ref [L, BK] f32, dbeta_ref [L, 1] f32.
  """
  cfg = cfg.intra(backward=True)
  c = q_ref.shape[0]
  nr = c // ell
  tile = pl.program_id(4)
  start = pl.multiple_of(tile * ell, ell)
  rows = pl.ds(start, ell)
  sdt = cfg.score_mm_dtype
  rnd = lambda x: x.astype(sdt).astype(_F32)

  q_c = q_ref[rows, :].astype(_F32) * scale
  k_c = k_ref[rows, :].astype(_F32)
  g_c = g_ref[rows, :]
  beta_c = beta_ref[rows, :]
  s = hs_ref[...]            # [BK, V] rows of the state entering the chunk
  ds = dhs_ref[...]          # [BK, V] rows of the gradient of the state leaving it
  dq, dk, dg, dbeta = state_term_grads(q_c, k_c, g_c, beta_c, g_ref, do_ref, vn_ref, du_ref,
                                       s, ds, cfg)
  g_last = g_ref[pl.ds(c - 1, 1), :]

  # Scores, row side: rows c against the columns tile c's anchored product sees.
  anchor = g_ref[pl.ds(start, 1), :]
  row_f = exp(g_c - anchor)
  xq_c = rnd(q_c * row_f)
  xk_c = rnd(beta_c * k_c * row_f)
  row_all = iota((c, 1), 0)
  visible = row_all < (start + ell if diagonal == "dense" else start)
  yk = rnd(jnp.where(visible, k_ref[...].astype(_F32)
                     * exp(jnp.where(visible, anchor - g_ref[...], 0.0)), 0.0))
  t_q = dot(rnd(daq_ref[...].astype(_F32)), yk, cfg, dtype=sdt)
  t_k = dot(rnd(da_ref[...].astype(_F32)), yk, cfg, dtype=sdt)
  dq = dq + row_f * t_q
  r_acc = row_f * t_k        # sum_j dA_ij k_j e^{G_i - G_j}
  dg = dg + xq_c * t_q + xk_c * t_k

  # Scores, column side: block (r, c) of every later row tile r, anchored at r.
  def column_block(r, carry):
    dk, dg = carry
    rows_r = pl.ds(pl.multiple_of(r * ell, ell), ell)
    anchor_r = g_ref[pl.ds(r * ell, 1), :]
    row_f_r = exp(g_ref[rows_r, :] - anchor_r)
    xq_r = rnd(q_ref[rows_r, :].astype(_F32) * scale * row_f_r)
    xk_r = rnd(beta_ref[rows_r, :] * k_ref[rows_r, :].astype(_F32) * row_f_r)
    t_c = (dot(rnd(daqt_ref[:, rows_r].astype(_F32)), xq_r, cfg, dtype=sdt)
           + dot(rnd(dat_ref[:, rows_r].astype(_F32)), xk_r, cfg, dtype=sdt))
    col_f = exp(anchor_r - g_c)
    return dk + col_f * t_c, dg - rnd(k_c * col_f) * t_c

  first = tile if diagonal == "dense" else tile + 1
  dk, dg = lax.fori_loop(first, nr, column_block, (dk, dg))

  if diagonal == "pairwise":
    diag = (slice(None), rows)
    dq, r_acc, dk, dg = fold_pair_tile_grads(
        (dq, r_acc, dk, dg), q_c, k_c, beta_c, (q_ref, k_ref, g_ref, beta_ref),
        daq_ref[diag].astype(_F32), da_ref[diag].astype(_F32), start, scale)

  dk = dk + beta_c * r_acc
  dbeta = dbeta + jnp.sum(k_c * r_acc, axis=1, keepdims=True)

  # d(S_next)/d(G_last), a sum over the whole chunk: the last tile's program adds it.
  def last_row_grad():
    k_all = k_ref[...].astype(_F32)
    dkt_all = dot(vn_all_ref[...], ds, cfg, tb=True)
    kk_all = k_all * exp(g_last - g_ref[...])
    return (jnp.sum(kk_all * dkt_all, axis=0, keepdims=True)
            + state_decay_grad(ds, s, g_last))

  dglast = lax.cond(tile == nr - 1, last_row_grad, lambda: jnp.zeros_like(g_last))
  dg = dg + jnp.where(iota((ell, 1), 0) == ell - 1, dglast, 0.0)

  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dg_ref[...] = dg
  dbeta_ref[...] = dbeta


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
  tile_v = pl.BlockSpec((None, ell, dv_), lambda ib, ih, ic, ik, ir: (ib, ic * nr + ir, ih))
  chunk_v = pl.BlockSpec((None, c, dv_), lambda ib, ih, ic, ik, ir: (ib, ic, ih))
  state = pl.BlockSpec((None, None, bk, dv_),
                       lambda ib, ih, ic, ik, ir: (ib, ih, ic * nk + ik, 0))
  tile_cc = pl.BlockSpec((None, None, ell, c),
                         lambda ib, ih, ic, ik, ir: (ib, ih, ic * nr + ir, 0))
  tile_k = pl.BlockSpec((None, ell, bk),
                        lambda ib, ih, ic, ik, ir: (ib, ic * nr + ir, ih * nk + ik))
  tile_b = pl.BlockSpec((None, None, None, ell, 1),
                        lambda ib, ih, ic, ik, ir: (ib, ih, ik, ic * nr + ir, 0))
  kernel = functools.partial(_row_tile_kernel, scale=scale, ell=ell, diagonal=diagonal, cfg=cfg)
  return pl.pallas_call(
      kernel, grid=grid,
      in_specs=[chunk_k, chunk_k, chunk_k, chunk_b, tile_v, tile_v, chunk_v, tile_v, state,
                state] + [tile_cc] * 4,
      out_specs=[tile_k] * 3 + [tile_b],
      out_shape=[jax.ShapeDtypeStruct((b, tp, hk), grad_dtype)] * 2
      + [jax.ShapeDtypeStruct((b, tp, hk), _F32), jax.ShapeDtypeStruct((b, h, nk, tp, 1), _F32)],
      compiler_params=cfg.compiler_params("intra_bwd_k", grid_rank=5),
      interpret=cfg.interpret, name="kda_intra_bwd_k_rows",
  )(q, k, g_cum, beta, do, v_new, v_new, du, hs, dhs, da, daq, dat, daqt)
