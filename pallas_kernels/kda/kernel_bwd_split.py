"""Split intra-chunk backward of chunked KDA (`intra_bwd_impl="split"`).

The same gradients as `kernel_bwd._intra_bwd_kernel`, in two pallas_calls:

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
ones. A K-sliced single kernel gave wrong f32 gradients on the H200 while
matching in interpret mode; the suspected cause, not isolated, is its
products with a transposed [C, C] left operand and N = block_k < K (see
docs/benchmarks.md). Here the only transposed-left products (M^T dM,
M^T dV') have N = C or V and live in kernel 1; kernel 2 gets the column-side
score gradients as plain products with the stored transposes,
t_qc = dAqk^T @ xq (xq is zero outside tile r; see `add_score_grads`).

The Triton default (`kernel_bwd.intra_bwd_body`); not lowered for TPU
(Mosaic), where it is a ValueError.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# kernel_bwd imports this module lazily (in `intra_bwd`), so no import cycle.
from pallas_kernels.kda.kernel_bwd import add_score_grads, state_term_grads
from pallas_kernels.kda.kernel_config import KernelConfig
from pallas_kernels.kda.kernel_fwd import chunk_specs, dot, exp, iota, k_slices

_F32 = jnp.float32


def cc_store_dtype(cfg: KernelConfig, diagonal: str):
  """Storage dtype of dA, dAqk and their transposes between the two kernels.

  "dense": cfg.score_mm_dtype. Every use is an anchored score product that
  rounds them to it first (`rnd`, as in `_intra_bwd_kernel`), so storing them
  rounded loses nothing, and bf16 halves kernel 2's reads of them (once per
  K slice). "pairwise": f32, because the explicit pair-decay gradients of the
  diagonal tiles use them unrounded: relative L2 errors of dq / dk / dg vs the
  f32 recurrence were 4.15 / 4.11 / 4.40e-3 with f32 storage (as "tiles")
  and 4.43 / 4.44 / 4.75e-3 with bf16 (interpret, bf16 inputs and intra-bwd
  operands, B1 T200 H2 K=V=32, C=32, L=8, GDN gates). With f32 inputs both
  are f32.
  """
  return cfg.score_mm_dtype if diagonal == "dense" else _F32


def _intra_bwd_cc_kernel(k_ref, v_ref, g_ref, beta_ref, do_ref, hs_ref, vn_ref, dvn_ref,
                         m_ref, dv_ref, dbeta_ref, du_ref, da_ref, daq_ref, dat_ref, daqt_ref,
                         *, cfg):
  """[C, C] and [C, V] terms of one chunk (kernel 1). Block shapes:

  k_ref, g_ref [C, K]; v_ref, do_ref, vn_ref, dvn_ref [C, V]; beta_ref [C, 1];
  hs_ref [K, V] (entry state); m_ref [C, C]. Outputs: dv_ref [C, V] f32,
  dbeta_ref [C, 1] f32, du_ref [C, V], da_ref / daq_ref / dat_ref / daqt_ref
  [C, C].
  """
  cfg = cfg.intra(backward=True)
  c, dk = k_ref.shape
  beta = beta_ref[...]
  v = v_ref[...].astype(_F32)
  # z = beta v - (beta k e^G) S, summed over K slices: no [C, K] f32 tile.
  z = beta * v
  for ks in k_slices(cfg, dk):
    bkg = beta * k_ref[:, ks].astype(_F32) * exp(g_ref[:, ks])
    z = z - dot(bkg, hs_ref[ks, :], cfg)
  m = m_ref[...]
  dvn = dvn_ref[...]
  dm = dot(dvn, z, cfg, tb=True)
  row, col = iota((c, c), 0), iota((c, c), 1)
  # M = (I + A_kk)^-1  =>  dA = -M^T dM M^T on the strictly lower part.
  da = jnp.where(row > col, -dot(dot(m, dm, cfg, ta=True), m, cfg, tb=True), 0.0)
  daq = jnp.where(row >= col, dot(do_ref[...], vn_ref[...], cfg, tb=True), 0.0)
  du = dot(m, dvn, cfg, ta=True)       # dU~ = M^T dV' = d(beta v), also feeds d(beta k e^G)
  dv_ref[...] = (beta * du).astype(dv_ref.dtype)
  dbeta_ref[...] = jnp.sum(du * v, axis=1, keepdims=True)
  du_ref[...] = du.astype(du_ref.dtype)
  da_ref[...] = da.astype(da_ref.dtype)
  daq_ref[...] = daq.astype(daq_ref.dtype)
  # Exact transposes (not recomputed products): the row and column sides of
  # each score pair must see identical values for dG's reverse cumsum to cancel.
  dat_ref[...] = jnp.transpose(da).astype(dat_ref.dtype)
  daqt_ref[...] = jnp.transpose(daq).astype(daqt_ref.dtype)


def _intra_bwd_k_kernel(q_ref, k_ref, g_ref, beta_ref, do_ref, hs_ref, dhs_ref, vn_ref, du_ref,
                        da_ref, daq_ref, dat_ref, daqt_ref, dq_ref, dk_ref, dg_ref, dbeta_ref,
                        *, scale, ell, diagonal, cfg):
  """Per-channel gradients of one K slice of one chunk (kernel 2). Block shapes:

  q_ref, k_ref, g_ref [C, BK] (BK = cfg.bwd_block_k); beta_ref [C, 1]; do_ref,
  vn_ref, du_ref [C, V]; hs_ref, dhs_ref [BK, V] (rows of the entry state and
  of the exit-state gradient); da_ref, daq_ref, dat_ref, daqt_ref [C, C].
  Outputs: dq_ref, dk_ref, dg_ref [C, BK] f32, dbeta_ref [C, 1] f32 (this
  slice's part).
  """
  cfg = cfg.intra(backward=True)
  c = q_ref.shape[0]
  q = q_ref[...].astype(_F32) * scale
  k = k_ref[...].astype(_F32)
  g = g_ref[...]
  beta = beta_ref[...]
  s = hs_ref[...]           # [BK, V] rows of the state entering the chunk
  ds = dhs_ref[...]         # [BK, V] rows of the gradient of the state leaving it
  row_c = iota((c, 1), 0)
  dq, dk, dgc, dbeta, dglast = state_term_grads(q, k, g, beta, g_ref, do_ref, vn_ref, du_ref,
                                                s, ds, cfg, last_row=True)

  # Scores (`kernel_bwd.add_score_grads`): every product reads a whole stored
  # [C, C] gradient; the row side's plain products, the column side's the
  # stored transposes. Read at each use, not held across the tile loop.
  sdt = cfg.score_mm_dtype
  stored = {"q_row": daq_ref, "q_col": daqt_ref, "k_row": da_ref, "k_col": dat_ref}

  def tile_product(side, x):
    return dot(stored[side][...], x, cfg, dtype=sdt)

  def pair_blocks(r, e_cl):
    del e_cl  # the diagonal blocks are read straight from the refs
    diag = (pl.ds(r * ell, ell), pl.ds(r * ell, ell))
    return daq_ref[diag].astype(_F32), da_ref[diag].astype(_F32)

  dq, dk, dbeta, dgc = add_score_grads(
      (dq, dk, dbeta, dgc), q, k, g, beta, (q_ref, k_ref, g_ref, beta_ref), ell=ell,
      diagonal=diagonal, cfg=cfg, scale=scale, tile_product=tile_product,
      pair_blocks=pair_blocks)
  dgc = dgc + jnp.where(row_c == c - 1, dglast, 0.0)

  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dg_ref[...] = dgc
  dbeta_ref[...] = dbeta


def intra_bwd_split(q, k, v, g_cum, beta, do, hs, dhs, v_new, dv_new, m, *, heads, chunk_size,
                    sub_chunk, diagonal, scale, cfg: KernelConfig, grad_dtype=_F32):
  """Intra-chunk backward as two kernels; same contract as `kernel_bwd.intra_bwd`.

  Args:
    q, k, g_cum: [B, Tp, H*K]; v, do, v_new, dv_new: [B, Tp, H*V];
    beta: [B, H, Tp, 1] f32; hs, dhs: [B, H, NC*K, V] (entry state and
    gradient of the exit state, f32 or bf16); m: [B, H, Tp, C] f32 or bf16.

    grad_dtype: storage dtype of dq, dk, dv.

  Returns:
    dq, dk [B, Tp, H*K] (dq w.r.t. the unscaled q), dv [B, Tp, H*V], all
    grad_dtype; dG [B, Tp, H*K] f32 (w.r.t. the within-chunk cumsum), dbeta
    [B, H, Tp, 1] f32.

  Intermediates in HBM: dU~ [B, Tp, H*V] (intra-bwd matmul dtype, the dtype
  of every product that reads it), dA, dAqk and their transposes
  [B, H, Tp, C] (`cc_store_dtype`), dbeta per slice
  [B, H, NK, Tp, 1] f32.
  """
  if chunk_size % sub_chunk:
    raise ValueError(f"sub_chunk must divide chunk_size={chunk_size}, got {sub_chunk}")
  dv, dbeta_v, *cc = intra_bwd_cc(k, v, g_cum, beta, do, hs, v_new, dv_new, m, heads=heads,
                                  chunk_size=chunk_size, diagonal=diagonal, cfg=cfg,
                                  dv_dtype=grad_dtype)
  dq, dk, dg, dbeta_k = second_kernel(cfg)(
      q, k, g_cum, beta, do, hs, dhs, v_new, *cc, heads=heads, chunk_size=chunk_size,
      sub_chunk=sub_chunk, diagonal=diagonal, scale=scale, cfg=cfg, grad_dtype=grad_dtype)
  return dq, dk, dv, dg, dbeta_v + jnp.sum(dbeta_k, axis=2)


def second_kernel(cfg: KernelConfig):
  """`intra_bwd_k` (one program per chunk and K slice) or, for
  intra_bwd_impl="split_rows", `kernel_bwd_split_rows.intra_bwd_k_rows` (one
  per chunk, K slice and row tile); both take and return the same arrays."""
  if cfg.intra_bwd_impl == "split_rows":
    from pallas_kernels.kda import kernel_bwd_split_rows  # pylint: disable=g-import-not-at-top
    return kernel_bwd_split_rows.intra_bwd_k_rows
  return intra_bwd_k


def intra_bwd_cc(k, v, g_cum, beta, do, hs, v_new, dv_new, m, *, heads, chunk_size, diagonal,
                 cfg: KernelConfig, dv_dtype=_F32):
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
  mdt = cfg.intra(backward=True).mm_dtype
  sdt = cc_store_dtype(cfg, diagonal)
  spec = chunk_specs(c, dk_, dv_)
  kspec, vspec, cspec, bspec, sspec = spec.k, spec.v, spec.cc, spec.beta, spec.state
  cc_shape = jax.ShapeDtypeStruct((b, h, tp, c), sdt)
  return pl.pallas_call(
      functools.partial(_intra_bwd_cc_kernel, cfg=cfg), grid=(b, h, nc),
      in_specs=[kspec, vspec, kspec, bspec, vspec, sspec, vspec, vspec, cspec],
      out_specs=[vspec, bspec, vspec] + [cspec] * 4,
      out_shape=[jax.ShapeDtypeStruct((b, tp, h * dv_), dv_dtype),
                 jax.ShapeDtypeStruct((b, h, tp, 1), _F32),
                 jax.ShapeDtypeStruct((b, tp, h * dv_), mdt)] + [cc_shape] * 4,
      compiler_params=cfg.compiler_params("intra_bwd_cc"),
      interpret=cfg.interpret, name="kda_intra_bwd_cc",
  )(k, v, g_cum, beta, do, hs, v_new, dv_new, m)


def intra_bwd_k(q, k, g_cum, beta, do, hs, dhs, v_new, du, da, daq, dat, daqt, *, heads,
                chunk_size, sub_chunk, diagonal, scale, cfg: KernelConfig, grad_dtype=_F32):
  """Kernel 2 of the split backward, grid (B, H, NC, K / bwd_block_k).

  Args: as `intra_bwd_split`, plus kernel 1's dU~, dA, dAqk, dA^T, dAqk^T.

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
                             diagonal=diagonal, cfg=cfg)
  return pl.pallas_call(
      kernel, grid=(b, h, nc, nk),
      in_specs=[kslice, kslice, kslice, bfull, vfull, srows, srows, vfull, vfull] + [cfull] * 4,
      out_specs=[kslice] * 3 + [bpart],
      out_shape=[jax.ShapeDtypeStruct((b, tp, hk), grad_dtype)] * 2
      + [jax.ShapeDtypeStruct((b, tp, hk), _F32), jax.ShapeDtypeStruct((b, h, nk, tp, 1), _F32)],
      compiler_params=cfg.compiler_params("intra_bwd_k", grid_rank=4),
      interpret=cfg.interpret, name="kda_intra_bwd_k",
  )(q, k, g_cum, beta, do, hs, dhs, v_new, du, da, daq, dat, daqt)
