"""Split intra-chunk backward of chunked KDA (`KernelConfig.intra_bwd="split"`).

The same gradients as `kernel_intra_bwd`, in two pallas_calls:

1. `kda_intra_bwd_cc`, grid (B, H, NC): the terms without a per-channel gate
   factor, all [C, C] or [C, V]:
     z    = beta v - sum_kb (beta k e^G)_kb S_kb           (U - W S before M)
     dM   = dV' z^T
     dA   = -(M^T dM) M^T, strictly lower (gradient of A_kk)
     dAqk = dO V'^T, lower (gradient of A_qk)
     dU~  = M^T dV'
   and writes dv = beta dU~, dbeta's rowsum(dU~ * v), dU~, dA, dAqk and the
   exact transposes dA^T, dAqk^T.
2. `kda_intra_bwd_k`, grid (B, H, NC, K / bwd_block_k): one K slice per
   program, every per-channel tile [C, bwd_block_k]: the state terms, the W term
   d(beta k e^G) = -dU~ S_kb^T, the anchored score gradients and the pairwise
   diagonal, giving dq, dk, dG of the slice and a partial dbeta (summed over
   the slices by the wrapper).

Why split: the one-program body holds [C, K] f32 tiles next to the [C, C]
ones. A K-sliced single kernel gave wrong f32 gradients on the GPU while
matching in interpret mode. Here the only transposed-left products (M^T dM,
M^T dV') have N = C or V and live in kernel 1; kernel 2 gets the column-side
score gradients as plain products with the stored transposes,
t_qc = dAqk^T @ xq (xq is zero outside tile r; see `add_score_grads`).

The GPU's body at sub_chunk >= 16 (`KernelConfig.intra_bwd="split"`); not
lowered for TPU (Mosaic).

With runs (`segment_ids`, `kernel_common.RunFlags`) kernel 1 masks dA and
dAqk to same-run pairs and z's state term to the rows that carry the
incoming state (M is block-diagonal by run, so V' = M z still); kernel 2
masks the state terms: dO S^T and dU~ S^T to carrying rows, V' dS^T to the
chunk's last run, and the decay's dG_last to a carrying last row. The score
gradients then read only masked dA and dAqk.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_common import (IntraBwdOut, add_all, chunk_specs, dot, exp,
                                              finish_intra_bwd, iota, k_slices, keep_rows,
                                              run_flags, width_slices, same_block,
                                              state_decay_grad)
from pallas_kernels.kda import kernel_diag
from pallas_kernels.kda.kernel_config import KernelConfig

_F32 = jnp.float32


def cc_store_dtype(cfg: KernelConfig):
  """Storage dtype of dA, dAqk and their transposes between the two kernels:
  the score products' operand dtype (cfg.mm_dtype). Every use is a score
  product that rounds them to it first (A_qk's exact diagonal of `pairwise`
  takes the rounded value, as the dense diagonal product does), so storing
  them rounded loses nothing, and bf16 halves kernel 2's reads of them (once
  per K slice)."""
  return cfg.mm_dtype


def state_term_grads(q, k, g, beta, g_ref, do_ref, vn_ref, du_ref, s, ds, cfg: KernelConfig, *,
                     last_row: bool = False, flags=None):
  """Gradients through a chunk's state terms, for some of its rows and one K slice.

  The terms: O += (q e^G) S (entry state S), S_next = e^{G_last} S +
  (k e^{G_last - G})^T V', and W = M (beta k e^G), whose gradient
  d(beta k e^G) = M^T dW = -dU~ S^T.

  Every V contraction is a sum over `width_slices(V)` (one slice at a power
  of two).

  Args:
    q (scaled), k, g: [R, K'] f32 rows of the chunk; beta: [R, 1] f32.
    g_ref: [C, K'] ref of the chunk's G (its last row is G_last).
    do_ref, vn_ref, du_ref: [R, V] refs of dO, V' and dU~ of those rows.
    s, ds: the slice's rows of the entry state and of the exit-state
      gradient (either dtype), each a tuple of [K', BV'] column slices, one
      per `width_slices(V)`. cfg: the intra-backward config.
    last_row: also return dG's last-row term from the state decay,
      sum_rows (k e^{G_last - G}) * (V' dS^T) + (sum_v dS * S)^T e^{G_last}
      (meaningful only when the R rows are the whole chunk).
    flags: None, or the rows' `kernel_common.RunFlags` (runs): the state
      terms of rows that do not carry the incoming state, the decayed keys
      outside the chunk's last run and the decay of a last row that does not
      carry are zero.

  Returns:
    dq [R, K'] (w.r.t. the scaled q), dk [R, K'], dG [R, K'], dbeta [R, 1],
    all f32; then the [1, K'] last-row term if last_row.
  """
  vslices = width_slices(do_ref.shape[1])
  if len(s) != len(vslices) or len(ds) != len(vslices):
    raise ValueError(f"s and dS need {len(vslices)} V slices, got {len(s)} and {len(ds)}")
  eg = exp(g)
  g_last = g_ref[pl.ds(g_ref.shape[0] - 1, 1), :]
  kdec = exp(g_last - g)
  # O += (q e^G) S.
  carry, last, carried = (None,) * 3 if flags is None else flags[1:]
  dqt = keep_rows(add_all(dot(do_ref[:, vs], s_v, cfg, tb=True) for vs, s_v in zip(vslices, s)),
                  carry)
  dq = eg * dqt
  dgc = q * eg * dqt
  # S_next = e^{G_last} S + (k e^{G_last - G})^T V'.
  dkt = keep_rows(add_all(dot(vn_ref[:, vs], ds_v, cfg, tb=True)
                          for vs, ds_v in zip(vslices, ds)), last)
  kk = k * kdec
  dk = kdec * dkt
  dgc = dgc - kk * dkt
  if last_row:
    dglast = (jnp.sum(kk * dkt, axis=0, keepdims=True)
              + add_all(state_decay_grad(ds_v, s_v, g_last, carried)
                        for s_v, ds_v in zip(s, ds)))
  # W = M (beta k e^G): d(beta k e^G) = M^T dW = -dU~ S^T.
  dbkg = -keep_rows(add_all(dot(du_ref[:, vs], s_v, cfg, tb=True)
                            for vs, s_v in zip(vslices, s)), carry)
  dbeta = jnp.sum(dbkg * k * eg, axis=1, keepdims=True)
  dk = dk + beta * eg * dbkg
  dgc = dgc + beta * k * eg * dbkg
  return (dq, dk, dgc, dbeta) + ((dglast,) if last_row else ())


def _intra_bwd_cc_kernel(k_ref, v_ref, g_ref, beta_ref, do_ref, hs_ref, vn_ref, dvn_ref,
                         m_ref, *refs, cfg, runs):
  """[C, C] and [C, V] terms of one chunk (kernel 1). Block shapes:

  k_ref, g_ref [C, K]; v_ref, do_ref, vn_ref, dvn_ref [C, V]; beta_ref [C, 1];
  hs_ref [K, V] (entry state); m_ref [C, C]. Outputs: dv_ref [C, V] f32,
  dbeta_ref [C, 1] f32, du_ref [C, V], da_ref / daq_ref / dat_ref / daqt_ref
  [C, C]. [C, V] data is read and written in `width_slices(V)` (the whole V
  at a power of two), and V contractions are sums over them. With `runs` the
  first two refs are the chunk's run refs (code [C, 1], run [1, C]).
  """
  run_refs, outs = (refs[:2], refs[2:]) if runs else (None, refs)
  dv_ref, dbeta_ref, du_ref, da_ref, daq_ref, dat_ref, daqt_ref = outs
  flags = None if run_refs is None else run_flags(*run_refs)
  cfg = cfg.backward()
  c, dk = k_ref.shape
  vslices = width_slices(v_ref.shape[1])
  beta = beta_ref[...]
  v = [v_ref[:, vs].astype(_F32) for vs in vslices]
  # z = beta v - (beta k e^G) S, summed over K slices: no [C, K] f32 tile.
  z = [beta * v_v for v_v in v]
  for ks in k_slices(cfg, dk):
    bkg = beta * k_ref[:, ks].astype(_F32) * exp(g_ref[:, ks])
    if flags is not None:   # rows that start runs here see S = 0
      bkg = keep_rows(bkg, flags.carry)
    z = [z_v - dot(bkg, hs_ref[ks, vs], cfg) for vs, z_v in zip(vslices, z)]
  m = m_ref[...]
  dvn = [dvn_ref[:, vs] for vs in vslices]
  dm = add_all(dot(dvn_v, z_v, cfg, tb=True) for dvn_v, z_v in zip(dvn, z))
  row, col = iota((c, c), 0), iota((c, c), 1)
  kk_mask, qk_mask = row > col, row >= col
  if flags is not None:
    kk_mask, qk_mask = kk_mask & flags.same, qk_mask & flags.same
  # M = (I + A_kk)^-1  =>  dA = -M^T dM M^T on the strictly lower part.
  da = jnp.where(kk_mask, -dot(dot(m, dm, cfg, ta=True), m, cfg, tb=True), 0.0)
  daq = jnp.where(qk_mask, add_all(dot(do_ref[:, vs], vn_ref[:, vs], cfg, tb=True)
                                   for vs in vslices), 0.0)
  # dU~ = M^T dV' = d(beta v), also feeds d(beta k e^G)
  du = [dot(m, dvn_v, cfg, ta=True) for dvn_v in dvn]
  for vs, du_v in zip(vslices, du):
    dv_ref[:, vs] = (beta * du_v).astype(dv_ref.dtype)
  dbeta_ref[...] = add_all(jnp.sum(du_v * v_v, axis=1, keepdims=True)
                           for du_v, v_v in zip(du, v))
  for vs, du_v in zip(vslices, du):
    du_ref[:, vs] = du_v.astype(du_ref.dtype)
  da_ref[...] = da.astype(da_ref.dtype)
  daq_ref[...] = daq.astype(daq_ref.dtype)
  # Exact transposes (not recomputed products): the row and column sides of
  # each score pair must see identical values for dG's reverse cumsum to cancel.
  dat_ref[...] = jnp.transpose(da).astype(dat_ref.dtype)
  daqt_ref[...] = jnp.transpose(daq).astype(daqt_ref.dtype)


def _intra_bwd_k_kernel(q_ref, k_ref, g_ref, beta_ref, do_ref, hs_ref, dhs_ref, vn_ref, du_ref,
                        da_ref, daq_ref, dat_ref, daqt_ref, *refs, scale, ell, diagonal, cfg,
                        diag_grads, runs):
  """Per-channel gradients of one K slice of one chunk (kernel 2). Block shapes:

  q_ref, k_ref, g_ref [C, BK] (BK = cfg.bwd_block_k); beta_ref [C, 1]; do_ref,
  vn_ref, du_ref [C, V]; hs_ref, dhs_ref [BK, V] (rows of the entry state and
  of the exit-state gradient); da_ref, daq_ref, dat_ref, daqt_ref [C, C].
  With `diag_grads`, three more [C, BK] f32 refs: the pairwise diagonal
  tiles' dq, dk and dG (`kernel_diag.diag_grads`), where the accumulators
  start. Outputs: dq_ref, dk_ref, dg_ref [C, BK] f32, dbeta_ref [C, 1] f32
  (this slice's part). [*, V] data is read in `width_slices(V)`
  (`state_term_grads`). With `runs`, then the run codes [C, 1].
  """
  init, refs = (refs[:3], refs[3:]) if diag_grads else (None, refs)
  code_ref, (dq_ref, dk_ref, dg_ref, dbeta_ref) = (refs[0], refs[1:]) if runs else (None, refs)
  flags = None if code_ref is None else run_flags(code_ref)
  sdt = cfg.mm_dtype       # the score products' operands, as in the forward
  cfg = cfg.backward()
  c = q_ref.shape[0]
  q = q_ref[...].astype(_F32) * scale
  k = k_ref[...].astype(_F32)
  g = g_ref[...]
  beta = beta_ref[...]
  vslices = width_slices(hs_ref.shape[1])
  s = tuple(hs_ref[:, vs] for vs in vslices)     # [BK, V]: rows of the entry state
  ds = tuple(dhs_ref[:, vs] for vs in vslices)   # [BK, V]: of the exit state's gradient
  row_c = iota((c, 1), 0)
  dq, dk, dgc, dbeta, dglast = state_term_grads(q, k, g, beta, g_ref, do_ref, vn_ref, du_ref,
                                                s, ds, cfg, last_row=True, flags=flags)
  if init is not None:
    dq, dk, dgc = (acc + ref[...] for acc, ref in zip((dq, dk, dgc), init))

  # Scores (`kernel_common.add_score_grads`): every product reads a whole stored
  # [C, C] gradient; the row side's plain products, the column side's the
  # stored transposes. Read at each use, not held across the tile loop.
  stored = {"q_row": daq_ref, "q_col": daqt_ref, "k_row": da_ref, "k_col": dat_ref}

  def tile_product(side, x, block=None):
    lhs = stored[side][...]
    if block is not None:
      lhs = jnp.where(same_block(c, block), lhs, 0)
    return dot(lhs, x, cfg, dtype=sdt)

  def qk_diagonal():
    eye = iota((c, c), 0) == iota((c, c), 1)
    return jnp.sum(jnp.where(eye, daq_ref[...].astype(_F32), 0.0), axis=1, keepdims=True)

  finish_intra_bwd((dq, dk, dbeta, dgc), q, k, g, beta, (q_ref, k_ref, g_ref, beta_ref),
                   (dq_ref, dk_ref, dg_ref, dbeta_ref), dglast=dglast, row_c=row_c,
                   scale=scale, ell=ell, diagonal=diagonal, cfg=cfg, score_dtype=sdt,
                   tile_product=tile_product, qk_diagonal=qk_diagonal, levels=not diag_grads)


def intra_bwd_split(q, k, v, g_cum, beta, do, hs, dhs, v_new, dv_new, m, *, heads, chunk_size,
                    sub_chunk, diagonal, scale, cfg: KernelConfig, grad_dtype=_F32, runs=None):
  """Intra-chunk backward as two kernels; same contract as `kernel_intra_bwd.intra_bwd_tiles`.

  Args:
    q, k, g_cum: [B, Tp, H*K]; v, do, v_new, dv_new: [B, Tp, H*V];
    beta: [B, H, Tp, 1] f32; hs, dhs: [B, H, NC*K, V] (entry state and
    gradient of the exit state, f32 or bf16); m: [B, H, Tp, C] f32 or bf16.

    grad_dtype: storage dtype of dq, dk, dv.
    runs: None, or the (code [B, Tp, 1], run [B, NC, 1, C]) int32 run codes
      (`kernel_common.run_codes`; the masks of the module docstring).

  Returns:
    IntraBwdOut.

  Intermediates in HBM: dU~ [B, Tp, H*V] (intra-bwd matmul dtype, the dtype
  of every product that reads it), dA, dAqk and their transposes
  [B, H, Tp, C] (`cc_store_dtype`), dbeta per slice
  [B, H, NK, Tp, 1] f32.
  """
  if chunk_size % sub_chunk:
    raise ValueError(f"sub_chunk must divide chunk_size={chunk_size}, got {sub_chunk}")
  dv, dbeta_v, *cc = intra_bwd_cc(k, v, g_cum, beta, do, hs, v_new, dv_new, m, heads=heads,
                                  chunk_size=chunk_size, cfg=cfg, dv_dtype=grad_dtype, runs=runs)
  diag = None
  if diagonal == "pairwise" and cfg.diag_kernels:
    *diag, dbeta_d = kernel_diag.diag_grads(q, k, g_cum, beta, *cc[1:], heads=heads,
                                            chunk_size=chunk_size, sub_chunk=sub_chunk,
                                            scale=scale, cfg=cfg)
    dbeta_v = dbeta_v + dbeta_d
  dq, dk, dg, dbeta_k = intra_bwd_k(
      q, k, g_cum, beta, do, hs, dhs, v_new, *cc, heads=heads, chunk_size=chunk_size,
      sub_chunk=sub_chunk, diagonal=diagonal, scale=scale, cfg=cfg, grad_dtype=grad_dtype,
      diag=diag, run_code=None if runs is None else runs[0])
  return IntraBwdOut(dq, dk, dv, dg, dbeta_v + jnp.sum(dbeta_k, axis=2))


def intra_bwd_cc(k, v, g_cum, beta, do, hs, v_new, dv_new, m, *, heads, chunk_size,
                 cfg: KernelConfig, dv_dtype=_F32, runs=None):
  """Kernel 1 of the split backward, grid (B, H, NC). Shapes as `intra_bwd_split`.

  Returns:
    dv [B, Tp, H*V] (dv_dtype), dbeta's dU~ part [B, H, Tp, 1] f32, dU~ [B, Tp, H*V]
    (intra-bwd matmul dtype), dA, dAqk, dA^T, dAqk^T [B, H, Tp, C]
    (`cc_store_dtype`).
  """
  b, tp, hk = k.shape
  h, c = heads, chunk_size
  dk_, dv_ = hk // h, v.shape[-1] // h
  nc = tp // c
  mdt = cfg.intra_bwd_mm_dtype
  sdt = cc_store_dtype(cfg)
  spec = chunk_specs(c, dk_, dv_)
  kspec, vspec, cspec, bspec, sspec = spec.k, spec.v, spec.cc, spec.beta, spec.state
  cc_shape = jax.ShapeDtypeStruct((b, h, tp, c), sdt)
  return pl.pallas_call(
      functools.partial(_intra_bwd_cc_kernel, cfg=cfg, runs=runs is not None), grid=(b, h, nc),
      in_specs=[kspec, vspec, kspec, bspec, vspec, sspec, vspec, vspec, cspec]
      + list(spec.runs if runs else ()),
      out_specs=[vspec, bspec, vspec] + [cspec] * 4,
      out_shape=[jax.ShapeDtypeStruct((b, tp, h * dv_), dv_dtype),
                 jax.ShapeDtypeStruct((b, h, tp, 1), _F32),
                 jax.ShapeDtypeStruct((b, tp, h * dv_), mdt)] + [cc_shape] * 4,
      compiler_params=cfg.compiler_params("intra_bwd_cc"),
      interpret=cfg.interpret, name="kda_intra_bwd_cc",
  )(k, v, g_cum, beta, do, hs, v_new, dv_new, m, *(runs or ()))


def intra_bwd_k(q, k, g_cum, beta, do, hs, dhs, v_new, du, da, daq, dat, daqt, *, heads,
                chunk_size, sub_chunk, diagonal, scale, cfg: KernelConfig, grad_dtype=_F32,
                diag=None, run_code=None):
  """Kernel 2 of the split backward, grid (B, H, NC, K / bwd_block_k).

  Args: as `intra_bwd_split`, plus kernel 1's dU~, dA, dAqk, dA^T, dAqk^T;
    diag: None, or the pairwise diagonal tiles' (dq, dk, dG) [B, Tp, H*K]
    f32 from `kernel_diag.diag_grads` (this kernel then adds only the
    off-diagonal tiles' terms to them).
    run_code: None, or [B, Tp, 1] int32 run codes (`kernel_common.run_codes`).

  Returns:
    dq, dk [B, Tp, H*K] (grad_dtype), dG [B, Tp, H*K] f32, dbeta's per-slice
    parts [B, H, NK, Tp, 1] f32.
  """
  b, tp, hk = q.shape
  h, c = heads, chunk_size
  dk_, dv_ = hk // h, do.shape[-1] // h
  nc = tp // c
  slices = k_slices(cfg, dk_, cfg.bwd_block_k)
  bk, nk = slices[0].size, len(slices)
  kslice = pl.BlockSpec((None, c, bk), lambda ib, ih, ic, ik: (ib, ic, ih * nk + ik))
  vfull = pl.BlockSpec((None, c, dv_), lambda ib, ih, ic, ik: (ib, ic, ih))
  cfull = pl.BlockSpec((None, None, c, c), lambda ib, ih, ic, ik: (ib, ih, ic, 0))
  bfull = pl.BlockSpec((None, None, c, 1), lambda ib, ih, ic, ik: (ib, ih, ic, 0))
  srows = pl.BlockSpec((None, None, bk, dv_), lambda ib, ih, ic, ik: (ib, ih, ic * nk + ik, 0))
  bpart = pl.BlockSpec((None, None, None, c, 1), lambda ib, ih, ic, ik: (ib, ih, ik, ic, 0))
  kernel = functools.partial(_intra_bwd_k_kernel, scale=scale, ell=sub_chunk,
                             diagonal=diagonal, cfg=cfg, diag_grads=diag is not None,
                             runs=run_code is not None)
  diag = list(diag or ())
  runs = [] if run_code is None else [run_code]
  code_spec = pl.BlockSpec((None, c, 1), lambda ib, ih, ic, ik: (ib, ic, 0))
  return pl.pallas_call(
      kernel, grid=(b, h, nc, nk),
      in_specs=[kslice, kslice, kslice, bfull, vfull, srows, srows, vfull, vfull] + [cfull] * 4
      + [kslice] * len(diag) + [code_spec] * len(runs),
      out_specs=[kslice] * 3 + [bpart],
      out_shape=[jax.ShapeDtypeStruct((b, tp, hk), grad_dtype)] * 2
      + [jax.ShapeDtypeStruct((b, tp, hk), _F32), jax.ShapeDtypeStruct((b, h, nk, tp, 1), _F32)],
      compiler_params=cfg.compiler_params("intra_bwd_k", grid_rank=4),
      interpret=cfg.interpret, name="kda_intra_bwd_k",
  )(q, k, g_cum, beta, do, hs, dhs, v_new, du, da, daq, dat, daqt, *diag, *runs)
