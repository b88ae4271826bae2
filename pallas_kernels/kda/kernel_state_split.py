"""Split forward state pass of chunked KDA (`state_fwd_impl="split"`).

The fused `kernel_fwd.state_fwd` computes each chunk's output inside the
sequential chunk loop. Only the state carries a dependency from chunk to
chunk, so here the loop keeps just the recurrence and a second, fully
parallel kernel forms the outputs:

1. `state_recurrence`, grid (V/BV, B, H), chunks in order: per chunk
     V' = U - W S,   S <- e^{G_last} S + kg^T V',
   with kg = k e^{G_last - G} written by the intra kernel (`save_gated`), so
   the loop reads W, U, kg and one gate row per chunk, and does no exp on a
   [C, K] tile. It writes the entry state of every chunk and V'.
2. `output_fwd`, grid (B, H, NC): O = qg S_entry + A_qk V' with the gated
   queries qg = (scale q) e^G, also written by the intra kernel next to W
   (which shares e^G): two products per program, no element-wise work and
   no f32 gate tile to read. In training the reverse state kernel reads qg
   and kg too (`kernel_bwd.state_bwd`, gated): state_bwd took 0.93 ms
   against 1.82 ms forming both exps in its loop (H200, bf16, B16 T2048 H16
   D128, `tune_kda.py`; docs/benchmarks.md).

On the H200 (bf16, B16 T2048 H16 D128, 2026-11-30, scratch kernels of this
design in one run) the fused kernel took 1.74 ms (2.32 ms saving the states
and V' for the backward); the recurrence 0.55 ms (f32 states) or 0.44 ms
(bf16) and the output kernel 0.58 / 0.44 ms. Computing kg inside the loop
instead of reading it took the recurrence to 0.87 ms. In-tree, in the
training forward (states and V' kept), the pass took 1.43-1.50 ms against
2.15-2.26 ms fused (`tune_kda.py`, same shape, 21:40 UTC; docs/benchmarks.md).
Since the fixed-length loop carries h0 in and ht out around the chunks
(`kernel_fwd.chunk_state_loop`) and the training states are bf16
(`KernelConfig.residual_dtype`), the recurrence takes 0.58-0.64 ms and the
training pass 0.95 ms (2026-12-01).

Numerics match the fused kernel: it rounds S, V' and k e^{G_last - G} to the
matmul dtype as operands, which is what storing them in that dtype does.

GPU (Triton) and interpret mode only; the TPU state kernels already stream
one chunk per grid step (`kernel_fwd.state_grid`) and stay fused there.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_config import KernelConfig
from pallas_kernels.kda.kernel_fwd import chunk_state_loop, dot, exp, k_slices, state_grid

_F32 = jnp.float32

# Forward state bodies (KernelConfig.state_fwd_impl, besides "auto").
STATE_FWD_BODIES = ("fused", "split")


def state_fwd_body(cfg: KernelConfig) -> str:
  """Which forward state pass runs, one of STATE_FWD_BODIES (validates the choice).

  "auto" picks "split" on Triton and in interpret mode, "fused" on TPU; an
  explicit "split" on TPU is a ValueError (its whole-sequence blocks are the
  GPU layout).
  """
  impl = cfg.state_fwd_impl
  if impl not in ("auto",) + STATE_FWD_BODIES:
    raise ValueError(f"state_fwd_impl must be 'auto' or one of {STATE_FWD_BODIES}, "
                     f"got {impl!r}")
  if impl == "split" and cfg.is_tpu:
    raise ValueError(f"state_fwd_impl='split' is not lowered for TPU (backend "
                     f"{cfg.backend!r}); use 'fused' or 'auto'")
  if impl != "auto":
    return impl
  return "fused" if cfg.is_tpu else "split"


def _recurrence_kernel(first_ref, last_ref, seq_ref, w_ref, u_ref, kg_ref, g_ref, h0_ref,
                       hs_ref, vn_ref, ht_ref, *, chunk_size, cfg, varlen):
  """Block shapes: w_ref, kg_ref, g_ref [Tp, K]; u_ref, vn_ref [Tp, BV];
  h0_ref, ht_ref [Nh', K, BV]; hs_ref [NC*K, BV]. The state is carried as
  K/block_k slices of [block_k, BV] f32 (`kernel_fwd.k_slices`)."""
  tp, dk = w_ref.shape
  slices = k_slices(cfg, dk)

  def chunk(s, rows, last_row):
    v_new = u_ref[rows, :].astype(_F32)
    for ks, s_kb in zip(slices, s):
      v_new = v_new - dot(w_ref[rows, ks], s_kb, cfg)
    s_next = tuple(jnp.transpose(exp(g_ref[last_row, ks])) * s_kb
                   + dot(kg_ref[rows, ks], v_new, cfg, ta=True)
                   for ks, s_kb in zip(slices, s))
    return v_new, s_next

  chunk_state_loop(chunk, (first_ref, last_ref, seq_ref), h0_ref, ht_ref, (hs_ref, vn_ref),
                   num_chunks=tp // chunk_size, chunk_size=chunk_size, slices=slices,
                   block_v=u_ref.shape[-1], varlen=varlen)


def state_recurrence(meta, w, u, kg, g_cum, h0, *, heads, chunk_size, cfg: KernelConfig,
                     varlen: bool, state_dtype=_F32, v_new_dtype=None):
  """Kernel 1: the state recurrence alone.

  Args:
    meta: (first_n, last_n, seq_n) int32 [NC], as for `kernel_fwd.state_fwd`.
    w, kg, g_cum: [B, Tp, H*K]; u: [B, Tp, H*V]; h0: [Nh, H, K, V] f32.
    state_dtype: storage dtype of the entry states (f32 when the backward
      keeps them; the matmul dtype when only the output reads them).
    v_new_dtype: storage dtype of V' (default state_dtype).

  Returns:
    hs [B, H, NC*K, V] (entry state of every chunk; state_dtype), v_new
    [B, Tp, H*V] (v_new_dtype), ht [Nh, H, K, V] f32 (rows of sequences that
    end; others untouched).
  """
  if cfg.is_tpu:
    raise ValueError("the split state recurrence is not lowered for TPU")
  b, tp, hk = w.shape
  dv = u.shape[-1] // heads
  if cfg.rec_block_v is not None:
    cfg = dataclasses.replace(cfg, block_v=cfg.rec_block_v)
  grid = state_grid(w.shape, dv, heads=heads, chunk_size=chunk_size, cfg=cfg, varlen=varlen,
                    num_state_rows=h0.shape[0])
  nc = tp // chunk_size
  kernel = functools.partial(_recurrence_kernel, chunk_size=chunk_size, cfg=cfg, varlen=varlen)
  return pl.pallas_call(
      kernel, grid=grid.grid,
      in_specs=[grid.meta] * 3 + [grid.k, grid.v, grid.k, grid.k, grid.state],
      out_specs=[grid.chunk_states, grid.v, grid.state],
      out_shape=[jax.ShapeDtypeStruct((b, heads, nc * grid.dk, dv), state_dtype),
                 jax.ShapeDtypeStruct((b, tp, heads * dv), v_new_dtype or state_dtype),
                 jax.ShapeDtypeStruct(h0.shape, _F32)],
      compiler_params=cfg.compiler_params("state_rec"), interpret=cfg.interpret,
      name="kda_state_rec",
  )(*meta, w, u, kg, g_cum, h0)


def _output_kernel(qg_ref, aqk_ref, hs_ref, vn_ref, o_ref, *, cfg):
  """Block shapes: qg_ref [C, K]; aqk_ref [C, C]; hs_ref [K, BV]; vn_ref,
  o_ref [C, BV]. O = A_qk V' + qg S."""
  o = dot(aqk_ref[...], vn_ref[...], cfg) + dot(qg_ref[...], hs_ref[...], cfg)
  o_ref[...] = o.astype(o_ref.dtype)


def output_fwd(qg, a_qk, hs, v_new, *, heads, chunk_size, cfg: KernelConfig, out_dtype):
  """Kernel 2: the outputs of all chunks in parallel.

  Args:
    qg: [B, Tp, H*K] gated queries (scale q) e^G (the intra kernel's
      `save_gated` output); a_qk: [B, H, Tp, C]; hs: [B, H, NC*K, V] entry
      states; v_new: [B, Tp, H*V].

  Returns:
    o [B, Tp, H*V] in out_dtype.
  """
  b, tp, hk = qg.shape
  h, c = heads, chunk_size
  dk, dv = hk // h, v_new.shape[-1] // h
  bv = cfg.out_block_v or dv
  nv = dv // bv
  kspec = pl.BlockSpec((None, c, dk), lambda ib, ih, ic, iv: (ib, ic, ih))
  vspec = pl.BlockSpec((None, c, bv), lambda ib, ih, ic, iv: (ib, ic, ih * nv + iv))
  cspec = pl.BlockSpec((None, None, c, c), lambda ib, ih, ic, iv: (ib, ih, ic, 0))
  sspec = pl.BlockSpec((None, None, dk, bv), lambda ib, ih, ic, iv: (ib, ih, ic, iv))
  return pl.pallas_call(
      functools.partial(_output_kernel, cfg=cfg), grid=(b, h, tp // c, nv),
      in_specs=[kspec, cspec, sspec, vspec], out_specs=vspec,
      out_shape=jax.ShapeDtypeStruct((b, tp, h * dv), out_dtype),
      compiler_params=cfg.compiler_params("output_fwd"), interpret=cfg.interpret,
      name="kda_output_fwd",
  )(qg, a_qk, hs, v_new)
