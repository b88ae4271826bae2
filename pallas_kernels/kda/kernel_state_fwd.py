"""Forward state pass of chunked KDA on TPU (`kda_state_fwd`).

Grid (B, H, V/BV, chunks), the chunk axis sequential with the f32 state
S [K, BV] in VMEM scratch, so one chunk of each input is resident. Per chunk:
V' = U - W S; O = (q e^G) S + A_qk V'; S <- e^{G_last} S + (k e^{G_last - G})^T V'.
The GPU runs `kernel_state_split` instead (the recurrence alone, then a
parallel output kernel).

Layouts as in `kernel_intra_fwd`; states [N, H, K, V]; per-chunk states
[B, H, NC*K, V].
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_common import (dot, exp, k_slices, keep_rows, run_flags, state_grid,
                                              state_grid_step, state_launch_options)
from pallas_kernels.kda.kernel_config import KernelConfig

_F32 = jnp.float32


class StateFwdOut(NamedTuple):
  """Outputs of `state_fwd`: o [B, Tp, H*V], ht [Nh, H, K, V] f32, and with
  save the per-chunk entry states hs [B, H, NC*K, V] and V' [B, Tp, H*V]
  (f32; None otherwise)."""
  o: jax.Array
  ht: jax.Array
  hs: jax.Array | None = None
  v_new: jax.Array | None = None


def state_fwd_chunk(s, rows, last_row, q_ref, k_ref, g_ref, w_ref, u_ref, aqk_ref, o_ref, *,
                    scale, cfg: KernelConfig, code_ref=None):
  """One chunk of the forward state recurrence and its outputs.

  Reads the chunk's `rows` ([C] rows; `last_row` is its last one) and writes
  O = sum_kb (q e^G)_kb S_kb + A_qk V' into o_ref. Every element-wise factor
  is formed on a [C, BK] column slice (BK = cfg.block_k; see `k_slices`)
  so only [C, BK] f32 tiles are live at once.

  Args:
    s: tuple of K/BK f32 [BK, BV] slices of the state S [K, BV] entering the
      chunk (slice kb holds rows kb*BK ... (kb+1)*BK - 1).
    code_ref: None, or the chunk's run codes [C, 1] (`kernel_common.run_codes`;
      W and A_qk arrive masked): only carrying rows read S, only the last
      run's keys write the state leaving, which keeps e^{G_last} S only
      where the last row carries.

  Returns:
    (V' = U - sum_kb W_kb S_kb [C, BV] f32, the state leaving the chunk as a
    tuple of [BK, BV] slices S_kb <- e^{G_last,kb} S_kb + (k e^{G_last - G})_kb^T V').
  """
  slices = k_slices(cfg, q_ref.shape[-1])
  if len(s) != len(slices):
    raise ValueError(f"state has {len(s)} K slices, expected {len(slices)}")
  v_new = u_ref[rows, :].astype(_F32)
  for ks, s_kb in zip(slices, s):
    v_new = v_new - dot(w_ref[rows, ks], s_kb, cfg)
  o = dot(aqk_ref[rows, :], v_new, cfg)
  carry = last = carried = None
  if code_ref is not None:
    flags = run_flags(code_ref, rows=rows, last_row=last_row)
    carry, last, carried = flags.carry, flags.last, flags.carry_last
  s_next = []
  for ks, s_kb in zip(slices, s):
    g = g_ref[rows, ks]
    g_last = g_ref[last_row, ks]
    q = q_ref[rows, ks].astype(_F32) * scale
    o = o + dot(keep_rows(q * exp(g), carry), s_kb, cfg)
    k = k_ref[rows, ks].astype(_F32)
    decay = jnp.transpose(exp(g_last))
    if carried is not None:
      decay = jnp.where(carried, decay, 0.0)
    s_next.append(decay * s_kb + dot(keep_rows(k * exp(g_last - g), last), v_new, cfg, ta=True))
  o_ref[rows, :] = o.astype(o_ref.dtype)
  return v_new, tuple(s_next)


def _state_fwd_kernel_tpu(first_ref, last_ref, seq_ref, q_ref, k_ref, g_ref, w_ref, u_ref,
                          aqk_ref, h0_ref, *rest, scale, cfg, save, runs):
  """One chunk per grid step (last grid axis, sequential); state in VMEM scratch.

  The scratch holds the whole [K, BV] state; it is read and written in K
  slices (one with the TPU default block_k = K). With `runs` the first of
  `rest` holds the chunk's run codes [C, 1].
  """
  code_ref, rest = (rest[0], rest[1:]) if runs else (None, rest)
  o_ref, ht_ref, *save_refs, s_ref = rest
  i = pl.program_id(3)
  c = q_ref.shape[0]
  slices = k_slices(cfg, q_ref.shape[-1])

  def step(s):
    v_new, s_next = state_fwd_chunk(s, pl.ds(0, c), pl.ds(c - 1, 1), q_ref, k_ref, g_ref,
                                    w_ref, u_ref, aqk_ref, o_ref, scale=scale, cfg=cfg,
                                    code_ref=code_ref)
    if save:
      hs_ref, vn_ref = save_refs
      for ks, s_kb in zip(slices, s):
        hs_ref[ks, :] = s_kb.astype(hs_ref.dtype)
      vn_ref[...] = v_new.astype(vn_ref.dtype)
    return s_next

  state_grid_step(step, i, slices, s_ref, h0_ref, ht_ref, (first_ref, last_ref, seq_ref))


def state_fwd(meta, q, k, g_cum, w, u, a_qk, h0, *, heads, chunk_size, scale,
              cfg: KernelConfig, varlen: bool, save: bool = False, out_dtype=None,
              run_code=None):
  """Runs the TPU state kernel over all chunks.

  Each program carries S [K, BV] as K/block_k slices of [block_k, BV] and
  does the per-channel work on [C, block_k] tiles (`k_slices`).

  Args:
    meta: (first_n, last_n, seq_n), int32 [NC] each: chunk starts / ends a
      sequence, and its state row (index into h0 / ht within the block).
    q, k, g_cum, w: [B, Tp, H*K]; u: [B, Tp, H*V]; a_qk: [B, H, Tp, C].
    h0: [Nh, H, K, V] f32. Fixed-length: Nh = B, one row per batch row;
      varlen (B == 1): all sequence rows.
    save: also return per-chunk entry states [B, H, NC*K, V] f32 and V'
      [B, Tp, H*V] f32 for the backward.
    run_code: None, or [B, Tp, 1] int32 run codes (`kernel_common.run_codes`),
      with W and A_qk from the intra kernel run with the same runs.

  Returns:
    StateFwdOut: o in out_dtype; ht's rows of sequences that end (others
    untouched); hs and v_new only with save.
  """
  if not cfg.is_tpu:
    raise ValueError(f"state_fwd is the TPU state pass (backend {cfg.backend!r}); the GPU "
                     "runs kernel_state_split")
  b, tp, _ = q.shape
  dv = u.shape[-1] // heads
  grid = state_grid(q.shape, dv, heads=heads, chunk_size=chunk_size, cfg=cfg, varlen=varlen,
                    num_state_rows=h0.shape[0])
  out_shape = [jax.ShapeDtypeStruct((b, tp, heads * dv), out_dtype or q.dtype),
               jax.ShapeDtypeStruct(h0.shape, _F32)]
  out_specs = [grid.v, grid.state]
  if save:
    out_shape += [jax.ShapeDtypeStruct((b, heads, (tp // chunk_size) * grid.dk, dv), _F32),
                  jax.ShapeDtypeStruct((b, tp, heads * dv), _F32)]
    out_specs += [grid.chunk_states, grid.v]
  runs = run_code is not None
  kernel = functools.partial(_state_fwd_kernel_tpu, scale=scale, cfg=cfg, save=save, runs=runs)
  return StateFwdOut(*pl.pallas_call(
      kernel, grid=grid.grid,
      in_specs=[grid.meta] * 3 + [grid.k] * 4 + [grid.v, grid.a, grid.state]
      + ([grid.code] if runs else []),
      out_specs=out_specs, out_shape=out_shape, interpret=cfg.interpret,
      name="kda_state_fwd", **state_launch_options(cfg, "state_fwd", grid),
  )(*meta, q, k, g_cum, w, u, a_qk, h0, *([run_code] if runs else [])))
