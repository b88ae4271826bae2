"""Routed SwiGLU experts on the Pallas grouped matmuls, gathers fused into the loads.

The layer's expert work in five kernels, forward and backward, none of which
writes a dispatched copy of the tokens (`pallas_kernels.gmm`):

  forward   gate_up = gmm(x, [W_gate W_up], rows x[source])     [S, 2h]
            h       = silu(gate) * up                            [S, h]  (XLA, one pass)
            y       = gmm(h, W_out)                              [S, d]
            out[n]  = sum_j w[n, j] y[slot[n, j]]                (XLA gather, one pass)
  backward  dh      = w_s * gmm(g, W_out^T, rows g[token])       (combine's VJP fused)
            d gate_up, w_s h = SwiGLU VJP of dh                  (XLA, one pass)
            dW_out  = tgmm(w_s h, g[token])
            dx_s    = gmm(d gate_up, [W_gate W_up]^T);  dx[n] = sum_j dx_s[slot[n, j]]
            dW_in   = tgmm(x[source], d gate_up)

`fuse_swiglu=True` moves the SwiGLU into the output product's operand load
and its VJP into the dgrad's epilogue, so neither h nor dh is written. It
is opt-in because it measured slower on the H200 (docs/benchmarks.md,
"Where the layer's time goes"): the load recomputes silu(gate) * up once per column tile
of the output (d / block_n times) and reads twice the operand bytes.

S is the slot layout of a `moe_dispatch.SlotPlan` built with `align` =
the kernels' block_m, capacity or ragged: the same kernels serve both modes.
Weight gradients accumulate in float32 and are returned in the parameters'
dtype; activations are in the compute dtype, as in `grouped_matmul`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.layers.ffn import silu_mul
from k3jax.layers.moe_dispatch import SlotPlan, combine_grad_parts, slot_sums, weighted_rows
from pallas_kernels import platform
from pallas_kernels.gmm import api as gmm_api
from pallas_kernels.gmm import config as gmm_config
from pallas_kernels.gmm.layout import TileMap, tile_map


class _Index(NamedTuple):
  """The plan's int32 arrays the kernels read (no gradients)."""
  source_s: jax.Array
  assign_s: jax.Array
  slot_nk: jax.Array
  tile_group: jax.Array
  group_tile_start: jax.Array
  group_tile_count: jax.Array


@dataclasses.dataclass(frozen=True)
class _Static:
  """Hashable launch settings (a custom_vjp static argument, not a pytree)."""
  dtype: jnp.dtype
  config: gmm_config.GmmConfig
  interpret: bool
  grad_dtypes: tuple  # of x, wi_gate, wi_up, wo: the cotangents' dtypes
  fuse_swiglu: bool = False


def kernel_config(dtype, config: gmm_config.GmmConfig | None = None) -> gmm_config.GmmConfig:
  """The tile config the layer runs (`config`, or the heuristic for `dtype`)."""
  return config or gmm_config.default_config(dtype)


def routed_swiglu_gmm(x_nd, w_nk, wi_gate_edh, wi_up_edh, wo_ehd, plan: SlotPlan, *, dtype,
                      config: gmm_config.GmmConfig | None = None,
                      interpret: bool | None = None, fuse_swiglu: bool = False):
  """sum_j w[n, j] * expert_{plan's group}(x[n]) through the grouped-matmul kernels.

  Args:
    x_nd: [N, d] tokens (any float dtype; the rows are read in `dtype`).
    w_nk: [N, k] float32 combine weights.
    wi_gate_edh, wi_up_edh: [E, d, h]; wo_ehd: [E, h, d] (parameter dtype).
    plan: a SlotPlan with `align == config.block_m`.
    dtype: compute dtype of the rows and products.
    config: kernel tiles (default: `gmm_config.default_config(dtype)`).
    interpret: run the kernels in the Pallas interpreter (default: off the GPU).
    fuse_swiglu: the SwiGLU and its VJP inside the products, or as separate
      elementwise passes (the default, measured faster).

  Returns:
    [N, d] float32.
  """
  cfg = kernel_config(dtype, config)
  if plan.align != cfg.block_m:
    raise ValueError(f"the slot plan is aligned to {plan.align} rows, the kernels' tiles to "
                     f"block_m={cfg.block_m}: build it with plan_slots(..., align=block_m)")
  tiles = tile_map(plan.group_starts, plan.group_sizes, plan.num_slots, cfg.block_m)
  index = _Index(plan.source_s, plan.assign_s, plan.slot_nk, tiles.tile_group,
                 tiles.group_tile_start, tiles.group_tile_count)
  interpret = platform.interprets("gmm") if interpret is None else interpret
  static = _Static(jnp.dtype(dtype), cfg, interpret,
                   tuple(jnp.dtype(a.dtype) for a in (x_nd, wi_gate_edh, wi_up_edh, wo_ehd)),
                   bool(fuse_swiglu))
  return _experts(x_nd, w_nk.astype(jnp.float32), wi_gate_edh, wi_up_edh, wo_ehd, index, static)


def _tiles(index: _Index, static: _Static) -> TileMap:
  return TileMap(index.tile_group, index.group_tile_start, index.group_tile_count,
                 static.config.block_m)


def _gate_up(gu_sf, dtype):
  hidden = gu_sf.shape[1] // 2
  return silu_mul(gu_sf[:, :hidden], gu_sf[:, hidden:], dtype)


def _forward(x_nd, w_nk, wi_gate, wi_up, wo, index: _Index, static: _Static):
  dt, kw = static.dtype, dict(config=static.config, interpret=static.interpret)
  tiles = _tiles(index, static)
  xc = x_nd.astype(dt)
  w_in = jnp.concatenate([wi_gate, wi_up], axis=-1).astype(dt)
  w_out = wo.astype(dt)
  gu = gmm_api.gmm(xc, w_in, tiles, row_index=index.source_s, **kw)
  if static.fuse_swiglu:
    y = gmm_api.gmm(gu, w_out, tiles, lhs_swiglu=True, **kw)
  else:
    y = gmm_api.gmm(_gate_up(gu, dt), w_out, tiles, **kw)
  return weighted_rows(y, w_nk, index.slot_nk), (xc, w_nk, w_in, w_out, gu, y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _experts(x_nd, w_nk, wi_gate, wi_up, wo, index, static):
  return _forward(x_nd, w_nk, wi_gate, wi_up, wo, index, static)[0]


def _experts_fwd(x_nd, w_nk, wi_gate, wi_up, wo, index, static):
  out, res = _forward(x_nd, w_nk, wi_gate, wi_up, wo, index, static)
  return out, (res, index)


def _experts_bwd(static, saved, g_nd):
  (xc, w_nk, w_in, wo, gu, y), index = saved
  x_dt, wg_dt, wu_dt, wo_dt = static.grad_dtypes
  dt, kw = static.dtype, dict(config=static.config, interpret=static.interpret)
  tiles = _tiles(index, static)
  gc = g_nd.astype(dt)
  w_s, token_s, dw_nk = combine_grad_parts(y, w_nk, index.slot_nk, index.assign_s, g_nd)
  # The combine weight scales the activations (with their recomputation)
  # rather than the gathered rows inside tgmm, which would take them through
  # registers.
  if static.fuse_swiglu:
    dgu, h_scaled = gmm_api.gmm_swiglu_grad(gc, wo, gu, tiles, row_index=token_s,
                                            row_scale=w_s, **kw)
  else:
    dh = gmm_api.gmm(gc, wo, tiles, row_index=token_s, row_scale=w_s, transpose_rhs=True, **kw)
    h_scaled = (_gate_up(gu, dt).astype(jnp.float32) * w_s[:, None]).astype(dt)
    _, gate_up_vjp = jax.vjp(lambda a: _gate_up(a, dt), gu)
    (dgu,) = gate_up_vjp(dh)
  d_wo = gmm_api.tgmm(h_scaled, gc, tiles, rhs_index=token_s, **kw)
  dx_s = gmm_api.gmm(dgu, w_in, tiles, transpose_rhs=True, **kw)
  dx = slot_sums(dx_s, index.slot_nk)
  d_win = gmm_api.tgmm(xc, dgu, tiles, lhs_index=index.source_s, **kw)
  hidden = d_win.shape[-1] // 2
  return (dx.astype(x_dt), dw_nk, d_win[..., :hidden].astype(wg_dt),
          d_win[..., hidden:].astype(wu_dt), d_wo.astype(wo_dt), None)


_experts.defvjp(_experts_fwd, _experts_bwd)
