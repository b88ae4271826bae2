"""Intra-chunk backward of chunked KDA in one program per chunk (`kda_intra_bwd`).

Grid (B, H, chunks), all parallel; the TPU's body, and the GPU's when
sub_chunk < 16 (`KernelConfig.intra_bwd="tiles"`; the GPU otherwise runs
`kernel_intra_bwd_split`). From dO, dV', the entry state S and dS of one
chunk it forms dq, dk, dv, dbeta and dG (the gradient of the within-chunk
cumsum G; `pallas_op` turns it into dg with a reverse cumsum) with masked
[C, C] products over the whole chunk. The anchored score gradients use the
same row sub-tiles and anchors as the forward (`kernel_common.add_score_grads`);
`pairwise` handles diagonal tiles by levels of nested anchors
(`kernel_common.level_factors`). With runs (`segment_ids`) the masks of
`kernel_intra_bwd_split` apply: dA and dAqk to same-run pairs, the state
terms to the rows that carry the incoming state (the decayed keys' to the
chunk's last run, dG_last's decay to a carrying last row).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_common import (IntraBwdOut, chunk_specs, dot, exp,
                                              finish_intra_bwd, iota, keep_rows, run_flags,
                                              same_block, state_decay_grad)
from pallas_kernels.kda.kernel_config import KernelConfig

_F32 = jnp.float32


def _intra_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, do_ref, hs_ref, dhs_ref,
                      vn_ref, dvn_ref, m_ref, *refs, scale, ell, diagonal, cfg, runs):
  run_refs, (dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref) = ((refs[:2], refs[2:]) if runs
                                                           else (None, refs))
  carry = last = carried = same = None
  if runs:
    same, carry, last, carried = run_flags(*run_refs)
  sdt = cfg.mm_dtype       # the score products' operands, as in the forward
  cfg = cfg.backward()     # operand dtype of this kernel's other matmuls
  c = q_ref.shape[0]
  q = q_ref[...].astype(_F32) * scale
  k = k_ref[...].astype(_F32)
  v = v_ref[...].astype(_F32)
  g = g_ref[...]
  beta = beta_ref[...]
  do = do_ref[...].astype(_F32)
  s = hs_ref[...]          # [K, V] state entering the chunk
  ds = dhs_ref[...]        # [K, V] gradient of the state leaving it
  vn = vn_ref[...]
  dvn = dvn_ref[...]
  m = m_ref[...]
  row_c = iota((c, 1), 0)
  eg = exp(g)
  g_last = g_ref[pl.ds(c - 1, 1), :]
  kdec = exp(g_last - g)

  # O += (q e^G) S.
  dqt = keep_rows(dot(do, s, cfg, tb=True), carry)
  dq = eg * dqt
  dgc = q * eg * dqt
  # S_next = e^{G_last} S + (k e^{G_last - G})^T V'.
  dkt = keep_rows(dot(vn, ds, cfg, tb=True), last)
  kk = k * kdec
  dk = kdec * dkt
  dgc = dgc - kk * dkt
  dglast = (jnp.sum(kk * dkt, axis=0, keepdims=True)
            + state_decay_grad(ds, s, g_last, carried))
  # V' = U - W S with U = M (beta v), W = M (beta k e^G) (its non-carrying rows zero).
  dw = -keep_rows(dot(dvn, s, cfg, tb=True), carry)
  bkg = beta * k * eg
  bv = beta * v
  dm = dot(dvn, bv, cfg, tb=True) + dot(dw, bkg, cfg, tb=True)
  dbkg = dot(m, dw, cfg, ta=True)
  dbv = dot(m, dvn, cfg, ta=True)
  dv = beta * dbv
  dbeta = jnp.sum(dbv * v, axis=1, keepdims=True) + jnp.sum(dbkg * k * eg, axis=1, keepdims=True)
  dk = dk + beta * eg * dbkg
  dgc = dgc + bkg * dbkg
  # M = (I + A_kk)^-1  =>  dA = -M^T dM M^T on the strictly lower part.
  row, col = iota((c, c), 0), iota((c, c), 1)
  kk_mask, qk_mask = row > col, row >= col
  if runs:
    kk_mask, qk_mask = kk_mask & same, qk_mask & same
  da = jnp.where(kk_mask, -dot(dot(m, dm, cfg, ta=True), m, cfg, tb=True), 0.0)
  daq = jnp.where(qk_mask, dot(do, vn, cfg, tb=True), 0.0)

  # Scores: A_qk = sum_r (q row_r)(k col_r)^T, A_kk = beta (k row_r)(k col_r)^T.
  rnd = lambda x: x.astype(sdt).astype(_F32)

  lhs = {"q": rnd(daq), "k": rnd(da)}        # whole gradients (`add_score_grads`)

  def tile_product(side, x, block=None):
    lhs_cc = lhs[side[0]]
    if block is not None:
      lhs_cc = jnp.where(same_block(c, block), lhs_cc, 0.0)
    return dot(lhs_cc, x, cfg, ta=side.endswith("col"), dtype=sdt)

  def qk_diagonal():
    return jnp.sum(jnp.where(row == col, daq, 0.0), axis=1, keepdims=True)

  finish_intra_bwd((dq, dk, dbeta, dgc), q, k, g, beta, (q_ref, k_ref, g_ref, beta_ref),
                   (dq_ref, dk_ref, dg_ref, dbeta_ref), dglast=dglast, row_c=row_c,
                   scale=scale, ell=ell, diagonal=diagonal, cfg=cfg, score_dtype=sdt,
                   tile_product=tile_product, qk_diagonal=qk_diagonal, dv_out=(dv_ref, dv))


def intra_bwd_tiles(q, k, v, g_cum, beta, do, hs, dhs, v_new, dv_new, m, *, heads, chunk_size,
                    sub_chunk, diagonal, scale, cfg: KernelConfig, grad_dtype=_F32, runs=None):
  """Runs the one-program intra-chunk backward kernel.

  Args:
    q, k, g_cum: [B, Tp, H*K]; v, do, v_new, dv_new: [B, Tp, H*V];
    beta: [B, H, Tp, 1] f32; hs, dhs: [B, H, NC*K, V] f32 or bf16 (entry state and
    gradient of the exit state per chunk; hs may be bf16); m: [B, H, Tp, C]
    f32 or bf16; v_new: f32 or bf16 (saved residuals, `saved_state_dtype`).

    grad_dtype: storage dtype of dq, dk, dv (the inputs' dtype saves a
      separate cast pass over f32 copies; the rounding is the same).
    runs: None, or the (code [B, Tp, 1], run [B, NC, 1, C]) int32 run codes
      (`kernel_common.run_codes`).

  Returns:
    IntraBwdOut.
  """
  b, tp, hk = q.shape
  h, c = heads, chunk_size
  dk_, dv_ = hk // h, v.shape[-1] // h
  nc = tp // c
  spec = chunk_specs(c, dk_, dv_)
  kspec, vspec, cspec, bspec, sspec = spec.k, spec.v, spec.cc, spec.beta, spec.state
  kernel = functools.partial(_intra_bwd_kernel, scale=scale, ell=sub_chunk, diagonal=diagonal,
                             cfg=cfg, runs=runs is not None)
  return IntraBwdOut(*pl.pallas_call(
      kernel, grid=(b, h, nc),
      in_specs=[kspec, kspec, vspec, kspec, bspec, vspec, sspec, sspec, vspec, vspec, cspec]
      + list(spec.runs if runs else ()),
      out_specs=[kspec, kspec, vspec, kspec, bspec],
      out_shape=[jax.ShapeDtypeStruct((b, tp, hk), grad_dtype),
                 jax.ShapeDtypeStruct((b, tp, hk), grad_dtype),
                 jax.ShapeDtypeStruct((b, tp, h * dv_), grad_dtype),
                 jax.ShapeDtypeStruct((b, tp, hk), _F32),
                 jax.ShapeDtypeStruct((b, h, tp, 1), _F32)],
      compiler_params=cfg.compiler_params("intra_bwd"),
      interpret=cfg.interpret, name="kda_intra_bwd",
  )(q, k, v, g_cum, beta, do, hs, dhs, v_new, dv_new, m, *(runs or ())))
