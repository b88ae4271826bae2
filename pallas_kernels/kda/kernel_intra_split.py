"""Split intra-chunk forward of chunked KDA (`intra_fwd_impl="split"`).

The fused `kernel_fwd.intra_fwd` ("blocked" body) forms the anchored
scores, the blocked inverse M = (I + A_kk)^-1, then W and U in one program
per chunk. Here two pallas_calls share that work, each with fewer live
tiles than the fused program:

1. `kda_intra_fwd` (grid B x H x NC): the scores and the inverse
   (`kernel_fwd.blocked_scores_inverse`); writes A_qk and M.
2. `kda_intra_wu` (grid B x H x NC): reads M and writes
   W = M (beta k e^G), U = M (beta v) (`kernel_fwd.write_w_u`), and the
   decayed keys kg = k e^{G_last - G} and gated queries qg = (scale q) e^G
   when asked.

Numerics match the fused kernel: M is stored in the W/U operand dtype
(`KernelConfig.intra_mm_dtype`), to which the fused kernel rounds it as a
matmul operand anyway, or wider when the backward keeps M in a wider
residual dtype. The cost is one [C]-per-row write and read of M (in
inference too). Opt-in, because it is slower: on the H200 (bf16, B16 T2048
H16 D128, 2026-12-01, `tune_kda.py --stages=intra_fwd,intra_fwd+M
--grid="intra_fwd_impl=fused,split;warps.intra_wu=4,8"`) the two kernels
took 1.507-1.692 ms (inference) and 1.658-1.817 ms (with M) against
1.381-1.425 and 1.439-1.564 ms fused. Its GPU twin tests pass.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_config import KernelConfig
from pallas_kernels.kda.kernel_fwd import blocked_scores_inverse, chunk_specs, write_w_u

_F32 = jnp.float32


def _scores_inverse_kernel(q_ref, k_ref, g_ref, beta_ref, aqk_ref, m_ref, *, scale, ell,
                           diagonal, cfg):
  """Block shapes: q_ref, k_ref, g_ref [C, K]; beta_ref [C, 1]; aqk_ref, m_ref [C, C]."""
  m = blocked_scores_inverse(q_ref, k_ref, g_ref, beta_ref, aqk_ref, scale=scale, ell=ell,
                             diagonal=diagonal, cfg=cfg.intra())
  m_ref[...] = m.astype(m_ref.dtype)


def _w_u_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, m_ref, w_ref, u_ref, *gated_refs, scale,
                cfg):
  """Block shapes: q_ref, k_ref, g_ref, w_ref and the optional kg_ref, qg_ref
  [C, K]; v_ref, u_ref [C, V]; beta_ref [C, 1]; m_ref [C, C]."""
  gated = (q_ref, scale, *gated_refs) if gated_refs else None
  write_w_u(m_ref[...], k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, cfg.intra(), gated)


def m_store_dtype(cfg: KernelConfig, save_m: bool, m_dtype):
  """Dtype in which kernel 1 stores M: the W/U operand dtype, or the promotion
  of it and `m_dtype` when the backward keeps M (so neither use loses bits)."""
  mm = jnp.dtype(cfg.intra().mm_dtype)
  return jnp.promote_types(mm, m_dtype) if save_m else mm


def intra_fwd_split(q, k, v, g_cum, beta, *, heads, chunk_size, sub_chunk, diagonal, scale,
                    cfg: KernelConfig, save_m: bool = False, save_gated: bool = False,
                    m_dtype=_F32):
  """The intra-chunk forward as two kernels; same contract as `kernel_fwd.intra_fwd`.

  Args:
    q, k: [B, Tp, H*K]; v: [B, Tp, H*V]; g_cum: [B, Tp, H*K] f32 within-chunk
      cumsum; beta: [B, H, Tp, 1] f32.
    save_m: also return M = (I + A_kk)^-1 (m_dtype) for the backward.
    save_gated: also return the decayed keys k e^{G_last - G} and the gated
      queries (scale q) e^G (cfg.mm_dtype).

  Returns:
    w [B, Tp, H*K], u [B, Tp, H*V], a_qk [B, H, Tp, C] (cfg.mm_dtype), then
    m [B, H, Tp, C] (m_dtype) if save_m, then kg and qg [B, Tp, H*K] if
    save_gated.
  """
  b, tp, hk = q.shape
  h, c = heads, chunk_size
  dk, dv = hk // h, v.shape[-1] // h
  spec = chunk_specs(c, dk, dv)
  kspec, vspec, cspec, bspec = spec.k, spec.v, spec.cc, spec.beta
  a_qk, m = pl.pallas_call(
      functools.partial(_scores_inverse_kernel, scale=scale, ell=sub_chunk, diagonal=diagonal,
                        cfg=cfg),
      grid=(b, h, tp // c), in_specs=[kspec, kspec, kspec, bspec], out_specs=[cspec, cspec],
      out_shape=[jax.ShapeDtypeStruct((b, h, tp, c), cfg.mm_dtype),
                 jax.ShapeDtypeStruct((b, h, tp, c), m_store_dtype(cfg, save_m, m_dtype))],
      compiler_params=cfg.compiler_params("intra_fwd"), interpret=cfg.interpret,
      name="kda_intra_fwd",
  )(q, k, g_cum, beta)
  out_shape = [jax.ShapeDtypeStruct((b, tp, hk), cfg.mm_dtype),
               jax.ShapeDtypeStruct((b, tp, h * dv), cfg.mm_dtype)]
  out_specs = [kspec, vspec]
  if save_gated:
    out_shape += [jax.ShapeDtypeStruct((b, tp, hk), cfg.mm_dtype)] * 2
    out_specs += [kspec] * 2
  w, u, *gated = pl.pallas_call(
      functools.partial(_w_u_kernel, scale=scale, cfg=cfg), grid=(b, h, tp // c),
      in_specs=[kspec, kspec, vspec, kspec, bspec, cspec], out_specs=out_specs,
      out_shape=out_shape, compiler_params=cfg.compiler_params("intra_wu"),
      interpret=cfg.interpret, name="kda_intra_wu",
  )(q, k, v, g_cum, beta, m)
  out = [w, u, a_qk]
  if save_m:
    out.append(m.astype(m_dtype))
  return out + gated
