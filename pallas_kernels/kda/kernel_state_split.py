"""Forward state pass of chunked KDA on the GPU: recurrence, then outputs.

Only the state carries a dependency from chunk to chunk, so the sequential
loop keeps just the recurrence and a second, fully parallel kernel forms the
outputs:

1. `state_recurrence` (`kda_state_rec`), grid (V/BV, B, H), chunks in order:
     V' = U - W S,   S <- e^{G_last} S + kg^T V',
   with kg = k e^{G_last - G} written by the intra kernel (`save_gated`), so
   the loop reads W, U, kg and one gate row per chunk, and does no exp on a
   [C, K] tile. It writes the entry state of every chunk and V'.
2. `output_fwd` (`kda_output_fwd`), grid (B, H, NC): O = qg S_entry + A_qk V'
   with the gated queries qg = (scale q) e^G, also written by the intra
   kernel: two products per program. The reverse state kernel reads qg and
   kg too (`kernel_state_bwd.state_bwd`, gated).

Numerics match the TPU's fused pass (`kernel_state_fwd`): it rounds S, V' and
k e^{G_last - G} to the matmul dtype as operands, which is what storing them
in that dtype does. Not lowered for TPU, whose state kernels stream one chunk
per grid step and stay fused.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_common import (dot, exp, k_slices, run_flags, run_state_loop, state_grid,
                                              store_state_rows, width_slices)
from pallas_kernels.kda.kernel_config import KernelConfig

_F32 = jnp.float32


class StateRecOut(NamedTuple):
  """Outputs of `state_recurrence`: hs [B, H, NC*K, V] (entry state of every
  chunk), v_new [B, Tp, H*V] (V'), ht [Nh, H, K, V] f32."""
  hs: jax.Array
  v_new: jax.Array
  ht: jax.Array


def chunk_state_loop(chunk_fn, meta_refs, h0_ref, ht_ref, save_refs, *, num_chunks: int,
                     chunk_size: int, slices, block_v: int, varlen: bool):
  """The GPU recurrence's loop over one program's chunks, in order
  (`kernel_common.run_state_loop`: h0's rows enter sequences, ht's take their
  final states).

  Per chunk i: `chunk_fn` advances the entering state; with `save_refs` the
  entering state and V' are stored.

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
  c = chunk_size

  def step(i, s):
    start = pl.multiple_of(i * c, c)
    rows = pl.ds(start, c)
    v_new, s_next = chunk_fn(s, rows, pl.ds(start + c - 1, 1))
    if save_refs:
      hs_ref, vn_ref = save_refs
      store_state_rows(hs_ref, i, slices, s)
      vn_ref[rows, :] = v_new.astype(vn_ref.dtype)
    return s_next

  run_state_loop(step, num_chunks, slices, block_v, h0_ref, ht_ref, meta_refs, varlen=varlen)


def _recurrence_kernel(first_ref, last_ref, seq_ref, w_ref, u_ref, kg_ref, g_ref, h0_ref, *refs,
                       chunk_size, cfg, varlen, runs):
  """Block shapes: w_ref, kg_ref, g_ref [Tp, K]; u_ref, vn_ref [Tp, BV];
  h0_ref, ht_ref [Nh', K, BV]; hs_ref [NC*K, BV]; with `runs` first the run
  codes [Tp, 1] (`kernel_common.run_codes`). The state is carried as
  K slices of [<= block_k, BV] f32 (`kernel_common.k_slices`)."""
  code_ref, (hs_ref, vn_ref, ht_ref) = (refs[0], refs[1:]) if runs else (None, refs)
  tp, dk = w_ref.shape
  slices = k_slices(cfg, dk)

  def chunk(s, rows, last_row):
    v_new = u_ref[rows, :].astype(_F32)
    for ks, s_kb in zip(slices, s):
      v_new = v_new - dot(w_ref[rows, ks], s_kb, cfg)
    decay = [jnp.transpose(exp(g_ref[last_row, ks])) for ks in slices]
    if runs:
      # The carried state survives the chunk only if its last row still
      # belongs to the run that entered it (W and kg are masked already).
      carried = run_flags(code_ref, rows=rows, last_row=last_row).carry_last  # [1, 1]
      decay = [jnp.where(carried, d, 0.0) for d in decay]
    s_next = tuple(d * s_kb + dot(kg_ref[rows, ks], v_new, cfg, ta=True)
                   for ks, s_kb, d in zip(slices, s, decay))
    return v_new, s_next

  chunk_state_loop(chunk, (first_ref, last_ref, seq_ref), h0_ref, ht_ref, (hs_ref, vn_ref),
                   num_chunks=tp // chunk_size, chunk_size=chunk_size, slices=slices,
                   block_v=u_ref.shape[-1], varlen=varlen)


def state_recurrence(meta, w, u, kg, g_cum, h0, *, heads, chunk_size, cfg: KernelConfig,
                     varlen: bool, state_dtype=_F32, v_new_dtype=None, run_code=None):
  """Kernel 1: the state recurrence alone.

  Args:
    meta: (first_n, last_n, seq_n) int32 [NC], as for `kernel_state_fwd.state_fwd`.
    w, kg, g_cum: [B, Tp, H*K]; u: [B, Tp, H*V]; h0: [Nh, H, K, V] f32.
    state_dtype: storage dtype of the entry states (f32 when the backward
      keeps them; the matmul dtype when only the output reads them).
    v_new_dtype: storage dtype of V' (default state_dtype).
    run_code: None, or [B, Tp, 1] int32 run codes (`kernel_common.run_codes`;
      w and kg masked by `intra_fwd`): a chunk whose last row starts no run
      after its entry keeps e^{G_last} S, any other drops it.

  Returns:
    StateRecOut: hs in state_dtype, v_new in v_new_dtype, ht's rows of
    sequences that end (others untouched).
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
  runs = run_code is not None
  kernel = functools.partial(_recurrence_kernel, chunk_size=chunk_size, cfg=cfg, varlen=varlen,
                             runs=runs)
  extra = [run_code] if runs else []
  extra_specs = [grid.code] if runs else []
  return StateRecOut(*pl.pallas_call(
      kernel, grid=grid.grid,
      in_specs=[grid.meta] * 3 + [grid.k, grid.v, grid.k, grid.k, grid.state] + extra_specs,
      out_specs=[grid.chunk_states, grid.v, grid.state],
      out_shape=[jax.ShapeDtypeStruct((b, heads, nc * grid.dk, dv), state_dtype),
                 jax.ShapeDtypeStruct((b, tp, heads * dv), v_new_dtype or state_dtype),
                 jax.ShapeDtypeStruct(h0.shape, _F32)],
      compiler_params=cfg.compiler_params("state_rec"), interpret=cfg.interpret,
      name="kda_state_rec",
  )(*meta, w, u, kg, g_cum, h0, *extra))


def _output_kernel(qg_ref, aqk_ref, hs_ref, vn_ref, o_ref, *, cfg):
  """Block shapes: qg_ref [C, K]; aqk_ref [C, C]; hs_ref [K, BV]; vn_ref,
  o_ref [C, BV]. O = A_qk V' + qg S, per `width_slices` of K and V (the
  whole widths at powers of two)."""
  dk, bv = hs_ref.shape
  aqk = aqk_ref[...]
  for vs in width_slices(bv):
    o = dot(aqk, vn_ref[:, vs], cfg)
    for ks in width_slices(dk):
      o = o + dot(qg_ref[:, ks], hs_ref[ks, vs], cfg)
    o_ref[:, vs] = o.astype(o_ref.dtype)


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
  bv = dv
  nv = 1  # one V tile per program
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
