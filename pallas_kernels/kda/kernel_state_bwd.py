"""Reverse state pass of chunked KDA (`kda_state_bwd`).

Grid (V/BV, B, H) on the GPU, each program looping over the chunks last to
first; on TPU (B, H, V/BV, chunks) with a sequential chunk axis and dS in
VMEM scratch. Carries dS, the gradient of the state leaving the chunk:
    dV' = A_qk^T dO + (k e^{G_last - G}) dS
    dS  <- e^{G_last} dS + (q e^G)^T dO - W^T dV'
and writes dV', the per-chunk dS and d initial_state. With runs
(`segment_ids`) the gated operands and A_qk arrive masked from the forward,
and the decay term keeps e^{G_last} dS only where the chunk's last row
carries the state that entered it (`kernel_common.RunFlags.carry_last`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_common import (dot, exp, k_slices, keep_rows, run_flags, run_state_loop,
                                              state_grid, state_grid_step,
                                              state_launch_options, store_state_rows)
from pallas_kernels.kda.kernel_config import KernelConfig

_F32 = jnp.float32


class StateBwdOut(NamedTuple):
  """Outputs of `state_bwd`: dv_new [B, Tp, H*V] (dV'), dhs [B, H, NC*K, V]
  (dS of every chunk), dh0 [Nh, H, K, V] f32."""
  dv_new: jax.Array
  dhs: jax.Array
  dh0: jax.Array


def state_bwd_chunk(ds, rows, last_row, q_ref, k_ref, g_ref, w_ref, aqk_ref, do_ref, dvn_ref,
                    *, scale, gated: bool, cfg: KernelConfig, code_ref=None):
  """One chunk of the reverse state recurrence (shared by the GPU and TPU kernels).

  Writes dV' = A_qk^T dO + sum_kb (k e^{G_last - G})_kb dS_kb into dvn_ref's
  `rows`. Every element-wise factor is formed on a [C, BK] column slice
  (BK = cfg.block_k; see `kernel_common.k_slices`) so only [C, BK] f32
  tiles are live at once.

  Args:
    ds: tuple of K/BK f32 [BK, BV] slices of dS [K, BV], the gradient of the
      state leaving the chunk.
    q_ref, k_ref: the queries and keys, or, when `gated`, the gated queries
      qg = (scale q) e^G and keys kg = k e^{G_last - G} the forward stored
      (cfg.mm_dtype, the dtype these products round them to anyway): then
      no exp is formed on a [C, BK] tile and `scale` is unused.
    code_ref: None, or the run codes (`kernel_common.run_codes`) of the rows:
      the gated operands are masked (the stored ones are already), and the
      decay keeps dS only where the last row carries.

  Returns:
    dS entering the chunk as a tuple of [BK, BV] slices:
    dS_kb <- e^{G_last,kb} dS_kb + (q e^G)_kb^T dO - W_kb^T dV'.
  """
  slices = k_slices(cfg, q_ref.shape[-1])
  if len(ds) != len(slices):
    raise ValueError(f"dS has {len(ds)} K slices, expected {len(slices)}")

  carry = last = carried = None
  if code_ref is not None:
    flags = run_flags(code_ref, rows=rows, last_row=last_row)
    carried = flags.carry_last
    if not gated:
      carry, last = flags.carry, flags.last

  def gated_k(ks):
    if gated:
      return k_ref[rows, ks]
    return keep_rows(k_ref[rows, ks].astype(_F32) * exp(g_ref[last_row, ks] - g_ref[rows, ks]),
                     last)

  def gated_q(ks):
    if gated:
      return q_ref[rows, ks]
    return keep_rows(q_ref[rows, ks].astype(_F32) * scale * exp(g_ref[rows, ks]), carry)

  do = do_ref[rows, :]
  dvn = dot(aqk_ref[rows, :], do, cfg, ta=True)
  for ks, ds_kb in zip(slices, ds):
    dvn = dvn + dot(gated_k(ks), ds_kb, cfg)
  dvn_ref[rows, :] = dvn.astype(dvn_ref.dtype)
  ds_prev = []
  for ks, ds_kb in zip(slices, ds):
    decay = jnp.transpose(exp(g_ref[last_row, ks]))
    if carried is not None:
      decay = jnp.where(carried, decay, 0.0)
    ds_prev.append(decay * ds_kb + dot(gated_q(ks), do, cfg, ta=True)
                   - dot(w_ref[rows, ks], dvn, cfg, ta=True))
  return tuple(ds_prev)


def _state_bwd_kernel(first_ref, last_ref, seq_ref, q_ref, k_ref, g_ref, w_ref, aqk_ref,
                      do_ref, dht_ref, *refs, scale, gated, chunk_size, cfg, varlen, runs):
  """Chunks last to first (`kernel_common.run_state_loop`, reversed: dht's rows
  enter sequences at their last chunk, dh0's take the gradients leaving their
  first). With `runs` the first of `refs` holds the run codes [Tp, 1]."""
  code_ref, (dvn_ref, dhs_ref, dh0_ref) = (refs[0], refs[1:]) if runs else (None, refs)
  c = chunk_size
  tp, dk = q_ref.shape
  nc = tp // c
  bv = do_ref.shape[-1]
  slices = k_slices(cfg, dk)

  def step(i, ds):
    store_state_rows(dhs_ref, i, slices, ds)
    start = pl.multiple_of(i * c, c)
    return state_bwd_chunk(ds, pl.ds(start, c), pl.ds(start + c - 1, 1), q_ref, k_ref, g_ref,
                           w_ref, aqk_ref, do_ref, dvn_ref, scale=scale, gated=gated, cfg=cfg,
                           code_ref=code_ref)

  run_state_loop(step, nc, slices, bv, dht_ref, dh0_ref, (first_ref, last_ref, seq_ref),
                 varlen=varlen, reverse=True)


def _state_bwd_kernel_tpu(first_ref, last_ref, seq_ref, q_ref, k_ref, g_ref, w_ref, aqk_ref,
                          do_ref, dht_ref, *refs, scale, gated, cfg, runs):
  """One chunk per grid step, last chunk first; dS in VMEM scratch.

  The scratch holds the whole [K, BV] dS; it is read and written in K slices
  (one with the TPU default block_k = K). With `runs` the first of `refs`
  holds the chunk's run codes [C, 1].
  """
  code_ref, (dvn_ref, dhs_ref, dh0_ref, ds_ref) = (refs[0], refs[1:]) if runs else (None, refs)
  nc = pl.num_programs(3)
  i = nc - 1 - pl.program_id(3)
  c = q_ref.shape[0]
  slices = k_slices(cfg, q_ref.shape[-1])

  def step(ds):
    for ks, ds_kb in zip(slices, ds):
      dhs_ref[ks, :] = ds_kb.astype(dhs_ref.dtype)
    return state_bwd_chunk(ds, pl.ds(0, c), pl.ds(c - 1, 1), q_ref, k_ref, g_ref, w_ref,
                           aqk_ref, do_ref, dvn_ref, scale=scale, gated=gated, cfg=cfg,
                           code_ref=code_ref)

  state_grid_step(step, i, slices, ds_ref, dht_ref, dh0_ref, (first_ref, last_ref, seq_ref),
                  reverse=True)


def state_bwd(meta, q, k, g_cum, w, a_qk, do, dht, *, heads, chunk_size, scale,
              cfg: KernelConfig, varlen: bool, gated: bool = False, run_code=None):
  """Runs the reverse state kernel.

  Each program carries dS [K, BV] as K slices of [<= block_k, BV] and
  does the per-channel work on [C, block_k] tiles (`kernel_common.k_slices`).

  Args:
    meta: (first_n, last_n, seq_n) int32 [NC], as for `kernel_state_fwd.state_fwd`.
    q, k, g_cum, w: [B, Tp, H*K]; a_qk: [B, H, Tp, C]; do: [B, Tp, H*V].
      With `gated`, q and k are the gated queries (scale q) e^G and keys
      k e^{G_last - G} in cfg.mm_dtype (`kernel_intra_fwd.intra_fwd`'s
      save_gated outputs): the chunk loop then
      forms no exp on a [C, K] tile, the same products with the same
      rounded operands.
    dht: [Nh, H, K, V] f32, gradient of the final states.
    run_code: None, or [B, Tp, 1] int32 run codes (`kernel_common.run_codes`),
      with the forward's masked W and A_qk (and gated operands).

  Returns:
    StateBwdOut: dv_new in the intra backward's matmul dtype
    (`KernelConfig.intra_bwd_mm_dtype`; every later use is an operand of
    such a matmul, so storing it rounded loses nothing), dS per chunk
    [B, H, NC*K, V] in `cfg.saved_state_dtype`, like the entry states
    (gradient of the state leaving each chunk; the loop carries it in f32,
    and the intra backward uses it as a matmul operand, rounded to its
    matmul dtype, and in dG's f32 last-row sum(dS * S), `state_decay_grad`), dh0
    [Nh, H, K, V] f32 (rows of sequences that start; others untouched).
  """
  b, tp, _ = q.shape
  dv = do.shape[-1] // heads
  if cfg.bwd_block_v is not None:
    cfg = dataclasses.replace(cfg, block_v=cfg.bwd_block_v)
  grid = state_grid(q.shape, dv, heads=heads, chunk_size=chunk_size, cfg=cfg, varlen=varlen,
                    num_state_rows=dht.shape[0], reverse=True)
  runs = run_code is not None
  if cfg.is_tpu:
    kernel = functools.partial(_state_bwd_kernel_tpu, scale=scale, gated=gated, cfg=cfg,
                               runs=runs)
  else:
    kernel = functools.partial(_state_bwd_kernel, scale=scale, gated=gated,
                               chunk_size=chunk_size, cfg=cfg, varlen=varlen, runs=runs)
  extra = [run_code] if runs else []
  extra_specs = [grid.code] if runs else []
  return StateBwdOut(*pl.pallas_call(
      kernel, grid=grid.grid,
      in_specs=[grid.meta] * 3 + [grid.k] * 4 + [grid.a, grid.v, grid.state] + extra_specs,
      out_specs=[grid.v, grid.chunk_states, grid.state],
      out_shape=[jax.ShapeDtypeStruct((b, tp, heads * dv), cfg.intra_bwd_mm_dtype),
                 jax.ShapeDtypeStruct((b, heads, (tp // chunk_size) * grid.dk, dv),
                                      cfg.saved_state_dtype),
                 jax.ShapeDtypeStruct(dht.shape, _F32)],
      interpret=cfg.interpret, name="kda_state_bwd",
      **state_launch_options(cfg, "state_bwd", grid),
  )(*meta, q, k, g_cum, w, a_qk, do, dht, *extra))
