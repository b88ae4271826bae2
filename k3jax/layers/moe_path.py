"""The routed experts' one execution path: plan, dispatch, experts, combine.

A `MoEPath` is built once with its layer (`MoE`, from the `MoEConfig`) and
runs the routed experts on the router's decision (ids [N, k], combine
weights [N, k]). Its mode (`impl`):

- "buffered" (capacity mode): every expert has `capacity.expert_capacity`
  slots, the capacity the router enforces, so every kept assignment fits and
  one batched matmul runs over the [E, capacity, d] buffers;
- "ragged" (dropless mode): tokens sorted by expert in groups of any size,
  through a grouped matmul (`grouped_matmul`, or `routed_gmm` for the
  "pallas" backend);
- "dense": every expert on every token; the reference.

Local execution (`routed_swiglu`): each token row is gathered once into the
grouped layout (`moe_dispatch.plan_slots`, `dispatch_rows`), the grouped
SwiGLU runs, and each token's k rows are gathered back and summed with the
combine weights (`combine_rows`), with gathers in the backward too.

Expert-parallel execution (`ExpertParallel` given, and the layer traced
under a mesh whose expert axis is > 1; `expert_parallel_swiglu`): inside
`jax.shard_map` every device holds a block of tokens (sharded over all mesh
axes) and E / P experts (P = expert-axis size). Per device:

1. dispatch: every kept (token, expert) assignment takes a slot, in token
   order, in its destination shard's block of a fixed [P, slots, d] send
   buffer (`plan_slots` with the shards as groups; assignments past a
   block's slots are dropped), and the token rows are gathered into it;
2. `all_to_all` over the expert axis: block p goes to shard p, which
   receives [P, slots, d] rows from every source;
3. the received rows go through the local computation with the local experts
   as groups: "buffered" plans per-local-expert buffers of
   `capacity.local_expert_capacity` rows and runs the batched einsum;
   "ragged" plans the ragged layout for a grouped matmul (the "pallas"
   kernels, which `"auto"` picks on NVIDIA GPUs, read the received rows
   through that plan instead of a gathered copy). The outputs are gathered
   back into received order;
4. combine: the results travel back with the inverse `all_to_all`, and each
   token's k rows are gathered and summed with the combine weights.

Dispatch slots (`ExpertParallel.dispatch_slot_factor`, `capacity.dispatch_slots`):
None sizes each (source, destination) block for the worst case, so nothing
is dropped and the result equals the unsharded layer; a factor f gives
ceil(f * n_local * k / P) slots (communication and expert compute shrink by
about P / f), and assignments past them are dropped in token order within
each source device. Rows past a local expert's buffer are dropped in
source-device order, then slot order. Both kinds of drop are reported as
the layer's `dispatch_drop_fraction`.

On one device, or under a mesh whose expert axis is 1, an expert-parallel
path runs the local computation: there is nothing to distribute.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from k3jax.layers import grouped_matmul
from k3jax.layers import moe_dispatch
from k3jax.layers import routed_gmm
from k3jax.routing import capacity as capacity_lib
from k3jax.sharding import mesh as mesh_lib
from pallas_kernels.gmm.config import GmmConfig

IMPLS = ("ragged", "buffered", "dense")
LOCAL_IMPLS = ("ragged", "buffered")
# Tokens are split over every axis inside one pipeline stage (not over stages).
TOKEN_AXES = mesh_lib.WITHIN_STAGE_AXES


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
  """Routed experts sharded over a mesh axis, rows moved by `all_to_all`.

  Attributes:
    axis: the mesh axis that shards the experts.
    dispatch_slot_factor: send slots per (source device, destination shard)
      pair, as a multiple of an even split of the device's assignments; None
      is lossless (worst-case blocks, nothing dropped).
  """

  axis: str = mesh_lib.EXPERT
  dispatch_slot_factor: float | None = None

  def __post_init__(self):
    f = self.dispatch_slot_factor
    if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or f <= 0):
      raise ValueError(f"ExpertParallel.dispatch_slot_factor={f!r}; must be > 0 or None "
                       "(lossless)")


@dataclasses.dataclass(frozen=True)
class MoEPath:
  """How a MoE layer runs its routed experts; chosen once, when the layer is built.

  Attributes:
    impl: one of IMPLS (see the module docstring).
    capacity_factor: the router's capacity factor; "buffered" sizes its
      buffers by it (None: dropless, "ragged" and "dense" only).
    grouped_backend: the resolved grouped-matmul backend
      (`grouped_matmul.RESOLVED`, from `grouped_matmul.resolve_backend`);
      None for "dense", which runs no grouped matmul.
    gmm_config: tiles of the "pallas" backend (None: the heuristic).
    dtype: compute dtype of the rows and products (accumulation is float32).
    expert_parallel: None runs locally; an ExpertParallel distributes the
      experts when traced under a mesh whose `axis` is > 1.
  """

  impl: str = "ragged"
  capacity_factor: float | None = None
  grouped_backend: str | None = "xla"
  gmm_config: GmmConfig | None = None
  dtype: jnp.dtype = jnp.float32
  expert_parallel: ExpertParallel | None = None

  def __post_init__(self):
    if self.impl not in IMPLS:
      raise ValueError(f"MoEPath.impl={self.impl!r}; allowed: {IMPLS}")
    if self.impl != "dense":
      grouped_matmul.check_resolved(self.grouped_backend, ragged=self.impl == "ragged")
    if self.expert_parallel is not None and not isinstance(self.expert_parallel, ExpertParallel):
      raise ValueError(f"MoEPath.expert_parallel must be an ExpertParallel or None, got "
                       f"{self.expert_parallel!r}")

  def distributes(self) -> bool:
    """Whether this trace runs expert-parallel: an ExpertParallel path under a mesh whose
    expert axis is > 1 ("dense", the reference, always runs locally)."""
    ep = self.expert_parallel
    return (ep is not None and self.impl != "dense"
            and mesh_lib.axis_size(mesh_lib.current_mesh(), ep.axis) > 1)

  def __call__(self, x_nd: jax.Array, idx_nk: jax.Array, w_nk: jax.Array,
               wi_gate_edh: jax.Array, wi_up_edh: jax.Array, wo_ehd: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """Routed SwiGLU experts on the router's decision.

    Args:
      x_nd: [N, d] tokens.
      idx_nk: [N, k] int expert ids; w_nk: [N, k] float32 combine weights
        (0 = dropped by the router: no slot, no work).
      wi_gate_edh, wi_up_edh: [E, d, h]; wo_ehd: [E, h, d].

    Returns:
      y_nd: [N, d] float32, sum_j w[n, j] * expert_{idx[n, j]}(x[n]).
      dispatch_drop: float32 scalar, the fraction of router-kept assignments
        the expert-parallel dispatch dropped (0 when run locally).
    """
    weights = (wi_gate_edh, wi_up_edh, wo_ehd)
    if self.impl == "dense":
      return dense_swiglu(x_nd, idx_nk, w_nk, *weights, dtype=self.dtype), _no_drops()
    if self.distributes():
      buffered = self.impl == "buffered"
      return expert_parallel_swiglu(
          x_nd, idx_nk, w_nk, *weights, expert_axis=self.expert_parallel.axis,
          dispatch_slot_factor=self.expert_parallel.dispatch_slot_factor, dtype=self.dtype,
          return_dropped=True, local_impl=self.impl,
          local_capacity_factor=self.capacity_factor if buffered else None,
          grouped_backend=self.grouped_backend)
    n, k = idx_nk.shape
    # The router keeps at most this many assignments per expert (the same
    # function), so every kept assignment has a slot; "ragged" places all.
    cap = (None if self.impl == "ragged" else
           capacity_lib.expert_capacity(n, wi_gate_edh.shape[0], k, self.capacity_factor))
    y_nd = routed_swiglu(x_nd, idx_nk, w_nk, *weights, capacity=cap,
                         backend=self.grouped_backend, dtype=self.dtype,
                         gmm_config=self.gmm_config)
    return y_nd, _no_drops()


def _no_drops() -> jax.Array:
  return jnp.zeros((), jnp.float32)


def dense_swiglu(x_nd, idx_nk, w_nk, wi_gate_edh, wi_up_edh, wo_ehd, *, dtype=jnp.float32):
  """Every expert on every token, combined by dense weights. [N, d] float32 (the reference).

  Operands and products are rounded to `dtype` and products accumulated in
  float32: the same arithmetic as the grouped path, on every backend.
  """
  num_experts = wi_gate_edh.shape[0]
  combine_ne = jnp.einsum("nke,nk->ne", jax.nn.one_hot(idx_nk, num_experts, dtype=jnp.float32),
                          w_nk)
  rnd = lambda a: a.astype(dtype).astype(jnp.float32)
  xs = rnd(x_nd)
  gate = rnd(jnp.einsum("nd,edh->neh", xs, rnd(wi_gate_edh)))
  up = rnd(jnp.einsum("nd,edh->neh", xs, rnd(wi_up_edh)))
  h = rnd(jax.nn.silu(gate) * up)
  y_ned = rnd(jnp.einsum("neh,ehd->ned", h, rnd(wo_ehd)))
  return jnp.einsum("ned,ne->nd", y_ned, combine_ne)


def routed_swiglu(x_nd, idx_nk, w_nk, wi_gate_edh, wi_up_edh, wo_ehd, *, capacity: int | None,
                  backend: str, dtype=jnp.float32, positions: str = "auto",
                  gmm_config: GmmConfig | None = None):
  """Local routed SwiGLU experts: plan, dispatch, grouped matmuls, combine.

  Args:
    x_nd: [N, d] tokens.
    idx_nk: [N, k] int expert ids; w_nk: [N, k] float32 combine weights
      (0 = dropped by the router: no slot, no work).
    wi_gate_edh, wi_up_edh: [E, d, h]; wo_ehd: [E, h, d].
    capacity: slots per expert (capacity layout; assignments past it add 0),
      or None (ragged layout, dropless).
    backend: resolved grouped-matmul backend (`grouped_matmul.RESOLVED`).
    dtype: compute dtype of the rows and products.
    positions: `moe_dispatch.plan_slots` rank method.
    gmm_config: tiles of the "pallas" backend (None: the heuristic).

  Returns:
    [N, d] float32: sum_j w[n, j] * expert_{idx[n, j]}(x[n]).
  """
  num_experts = wi_gate_edh.shape[0]
  if backend == "pallas":
    cfg = routed_gmm.kernel_config(dtype, gmm_config)
    plan = moe_dispatch.plan_slots(idx_nk, w_nk > 0, num_experts, capacity, positions=positions,
                                   align=cfg.block_m)
    return routed_gmm.routed_swiglu_gmm(x_nd, w_nk, wi_gate_edh, wi_up_edh, wo_ehd, plan,
                                        dtype=dtype, config=cfg)
  plan = moe_dispatch.plan_slots(idx_nk, w_nk > 0, num_experts, capacity, positions=positions)
  rows_sd = moe_dispatch.dispatch_rows(x_nd.astype(dtype), plan.source_s, plan.slot_nk)
  y_sd = grouped_matmul.grouped_swiglu(rows_sd, wi_gate_edh, wi_up_edh, wo_ehd,
                                       group_sizes=plan.group_sizes, capacity=capacity,
                                       backend=backend, dtype=dtype)
  return moe_dispatch.combine_rows(y_sd, w_nk, plan.slot_nk, plan.assign_s)


def expert_parallel_swiglu(x_nd: jax.Array, idx_nk: jax.Array, w_nk: jax.Array,
                           wi_gate_edh: jax.Array, wi_up_edh: jax.Array, wo_ehd: jax.Array, *,
                           mesh: Mesh | None = None, expert_axis: str = mesh_lib.EXPERT,
                           token_axes: Sequence[str] = TOKEN_AXES,
                           dispatch_slot_factor: float | None = None,
                           dtype=jnp.float32, return_dropped: bool = False,
                           local_impl: str = "ragged",
                           local_capacity_factor: float | None = None,
                           grouped_backend: str = "xla"):
  """Routed SwiGLU experts with the experts sharded over `expert_axis`.

  Args:
    x_nd: [N, d] tokens.
    idx_nk: [N, k] int expert ids; w_nk: [N, k] combine weights (0 = dropped
      by the router; such assignments are not sent).
    wi_gate_edh, wi_up_edh: [E, d, h]; wo_ehd: [E, h, d].
    mesh: the device mesh; None uses the current mesh (`jax.set_mesh`).
    expert_axis: mesh axis that shards the experts.
    token_axes: mesh axes that shard the tokens (those present in the mesh).
    dispatch_slot_factor: None for lossless dispatch, else slots per
      destination relative to an even split (see the module docstring).
    dtype: compute dtype of the expert matmuls (accumulation is float32).
    return_dropped: also return the fraction of router-kept assignments that
      the dispatch or local capacity dropped (float32 scalar, over all devices).
    local_impl: "ragged" (grouped matmul on sorted rows) or "buffered"
      (per-local-expert buffers, one batched matmul).
    local_capacity_factor: buffered only: buffer rows per local expert
      relative to an even split of the rows a device expects (n_local * k);
      None = every received row fits (lossless, E_l x the work).
    grouped_backend: ragged only: the resolved grouped-matmul backend
      (`grouped_matmul.RESOLVED`: "xla", "tokamax" or "pallas"); buffered
      always uses the batched einsum.

  Returns:
    y_nd [N, d] float32: sum_k w[n, k] * expert_{idx[n, k]}(x[n]);
    with return_dropped, (y_nd, dropped_fraction).
  """
  mesh = mesh_lib.current_mesh() if mesh is None else mesh
  if mesh is None:
    raise ValueError("expert_parallel_swiglu needs a mesh (argument or jax.set_mesh)")
  if expert_axis not in mesh.axis_names:
    raise ValueError(f"mesh axes {mesh.axis_names} have no expert axis {expert_axis!r}")
  n, d = x_nd.shape
  k = idx_nk.shape[1]
  num_experts = wi_gate_edh.shape[0]
  n_shards = int(mesh.shape[expert_axis])
  if num_experts % n_shards:
    raise ValueError(f"num_experts={num_experts} must be divisible by the expert axis size "
                     f"{n_shards}")
  t_axes = tuple(a for a in token_axes if a in mesh.axis_names)
  n_tok_shards = math.prod(int(mesh.shape[a]) for a in t_axes)
  if n % n_tok_shards:
    raise ValueError(f"N={n} tokens must be divisible by the token shards {t_axes} "
                     f"(product {n_tok_shards})")
  if local_impl not in LOCAL_IMPLS:
    raise ValueError(f"local_impl={local_impl!r}; allowed: 'ragged', 'buffered'")
  e_local = num_experts // n_shards
  n_local = n // n_tok_shards
  cap = capacity_lib.dispatch_slots(n_local, k, n_shards, dispatch_slot_factor)
  # Buffers are sized from the rows a device expects (n_local * k on average),
  # not from the padded all_to_all slots.
  if local_impl == "buffered":
    local_cap = n_shards * cap
    if local_capacity_factor is not None:
      local_cap = min(local_cap, capacity_lib.local_expert_capacity(n_local * k, e_local,
                                                                    local_capacity_factor))
    backend = "einsum"
  else:
    local_cap = None
    backend = grouped_backend
    grouped_matmul.check_resolved(backend, ragged=True)

  def local(x_nd, idx_nk, w_nk, wi_gate, wi_up, wo):
    expert_nk = idx_nk.astype(jnp.int32)
    kept_nk = w_nk > 0
    # Send side: one slot block of `cap` rows per destination shard.
    send = moe_dispatch.plan_slots(expert_nk // e_local, kept_nk, n_shards, cap)
    send_x = moe_dispatch.dispatch_rows(x_nd.astype(dtype), send.source_s, send.slot_nk)
    send_e = jnp.take((expert_nk % e_local).reshape(-1), send.assign_s, mode="fill",
                      fill_value=e_local)  # e_local marks an empty slot
    recv_x = jax.lax.all_to_all(send_x.reshape(n_shards, cap, d), expert_axis, 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e.reshape(n_shards, cap), expert_axis, 0, 0, tiled=True)
    # Receive side: the local computation on the received rows.
    recv_e = recv_e.reshape(-1, 1)
    recv_kept = recv_e < e_local
    if backend == "pallas":
      # The kernels read the received rows through their own (ragged) plan and
      # write them back in received order (weight 1 per kept row, 0 per empty
      # slot); a ragged layout drops nothing.
      y_r = routed_swiglu(recv_x.reshape(-1, d), recv_e, recv_kept.astype(jnp.float32), wi_gate,
                          wi_up, wo, capacity=None, backend="pallas", dtype=dtype).astype(dtype)
      local_dropped = jnp.zeros((), jnp.float32)
    else:
      grouped = moe_dispatch.plan_slots(recv_e, recv_kept, e_local, local_cap)
      rows = moe_dispatch.dispatch_rows(recv_x.reshape(-1, d), grouped.source_s, grouped.slot_nk)
      y_sd = grouped_matmul.grouped_swiglu(rows, wi_gate, wi_up, wo,
                                           group_sizes=grouped.group_sizes, capacity=local_cap,
                                           backend=backend, dtype=dtype)
      # Back to received order: with one slot per row this is the same gather
      # with the roles of the two index maps exchanged.
      y_r = moe_dispatch.dispatch_rows(y_sd, grouped.slot_nk[:, 0], grouped.source_s[:, None])
      local_dropped = grouped.overflow_count(recv_kept)
    back = jax.lax.all_to_all(y_r.reshape(n_shards, cap, d), expert_axis, 0, 0, tiled=True)
    y_nd = moe_dispatch.combine_rows(back.reshape(n_shards * cap, d), w_nk, send.slot_nk,
                                     send.assign_s)
    dropped = send.overflow_count(kept_nk) + local_dropped
    counts = jnp.stack([dropped, jnp.sum(kept_nk.astype(jnp.float32))])
    if t_axes:
      counts = jax.lax.psum(counts, t_axes)
    return y_nd, counts

  tok = P(t_axes if t_axes else None)
  wspec = P(expert_axis)
  # pallas_call outputs carry no varying-axes type, which check_vma needs.
  y, counts = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, wspec, wspec, wspec),
                            out_specs=(tok, P()), check_vma=backend != "pallas")(
                                x_nd, idx_nk, w_nk, wi_gate_edh, wi_up_edh, wo_ehd)
  if return_dropped:
    return y, counts[0] / jnp.maximum(counts[1], 1.0)
  return y
