"""Expert parallelism: routed experts sharded over the mesh's expert axis.

Inside `jax.shard_map`, every device holds a block of tokens (sharded over
all mesh axes) and E / P experts (P = expert-axis size). Per device:

1. dispatch: every kept (token, expert) assignment takes a slot, in token
   order, in its destination shard's block of a fixed [P, capacity, d] send
   buffer (`moe_dispatch.plan_slots` with the shards as groups; assignments
   past a block's capacity are dropped), and the token rows are gathered
   into it in the compute dtype;
2. `all_to_all` over the expert axis: block p goes to shard p, which
   receives [P, capacity, d] rows from every source;
3. the received rows go through the one-device computation, with the local
   experts as groups: `local_impl="buffered"` plans per-local-expert buffers
   of `local_capacity` rows and runs the batched einsum (the GPU choice);
   `local_impl="ragged"` plans the ragged layout for a grouped matmul
   (`grouped_matmul`). The outputs are gathered back into received order;
4. combine: the results travel back with the inverse `all_to_all`, and each
   token's k rows are gathered and summed with the combine weights.

Every movement of rows is a gather, in both directions (the custom VJPs of
`moe_dispatch`).

Capacity. `capacity_factor=None` sizes each (source, destination) slot
block for the worst case (all local assignments to one shard), so nothing
is ever dropped and the result equals the unsharded layer. A factor c gives
ceil(c * n_local * k / P) slots: communication and expert compute shrink by
about P / c, and assignments beyond the slots are dropped (their output is
zero), in token order within each source device (the latest tokens lose their slots).

Local capacity. A local expert's buffer holds ceil(local_capacity_factor *
rows received / E_l) rows, at most every received row; rows past it are
dropped (in source-device order, then slot order) and counted in the
dropped fraction with the dispatch drops.

Routing (scores, router statistics and state) runs outside, with the
semantics of the unsharded layer; only dispatch, expert math and combine are
inside the shard_map.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from k3jax.layers import grouped_matmul
from k3jax.layers import moe_dispatch
from k3jax.sharding import mesh as mesh_lib
from k3jax.routing import capacity as capacity_lib

TOKEN_AXES = mesh_lib.AXES


def current_mesh():
  """The mesh set with `jax.set_mesh` (or `jax.sharding.use_mesh`), or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def expert_axis_size(mesh=None, expert_axis: str = mesh_lib.EXPERT) -> int:
  """Size of the expert axis of `mesh` (default: the current mesh); 1 if none."""
  mesh = current_mesh() if mesh is None else mesh
  if mesh is None or expert_axis not in mesh.axis_names:
    return 1
  return int(mesh.shape[expert_axis])


def capacity(n_local: int, top_k: int, n_shards: int, capacity_factor: float | None) -> int:
  """Slots per (source device, destination shard) pair."""
  worst = n_local * top_k
  if capacity_factor is None:
    return worst
  if not capacity_factor > 0:
    raise ValueError(f"capacity_factor={capacity_factor!r}; must be > 0 or None (lossless)")
  return capacity_lib.share(worst, n_shards, capacity_factor, at_most=worst)


def local_capacity(rows: int, num_local: int, local_capacity_factor: float) -> int:
  """Rows per local-expert buffer when `rows` real rows are expected for `num_local` experts."""
  if not local_capacity_factor > 0:
    raise ValueError(f"local_capacity_factor={local_capacity_factor!r}; must be > 0 or None")
  return capacity_lib.share(rows, num_local, local_capacity_factor, at_most=rows)


def routed_experts(x_nd: jax.Array, idx_nk: jax.Array, w_nk: jax.Array, wi_gate_edh: jax.Array,
                   wi_up_edh: jax.Array, wo_ehd: jax.Array, *, mesh: Mesh | None = None,
                   expert_axis: str = mesh_lib.EXPERT,
                   token_axes: Sequence[str] = TOKEN_AXES,
                   capacity_factor: float | None = None,
                   dtype=jnp.float32, return_dropped: bool = False,
                   local_impl: str = "ragged",
                   local_capacity_factor: float | None = None,
                   grouped_backend: str = "auto"):
  """Routed SwiGLU experts with experts sharded over `expert_axis`.

  Args:
    x_nd: [N, d] tokens.
    idx_nk: [N, k] int expert ids; w_nk: [N, k] combine weights (0 = dropped
      by the router; such assignments are not sent).
    wi_gate_edh, wi_up_edh: [E, d, h]; wo_ehd: [E, h, d].
    mesh: the device mesh; None uses the current mesh (`jax.set_mesh`).
    expert_axis: mesh axis that shards the experts.
    token_axes: mesh axes that shard the tokens (those present in the mesh).
    capacity_factor: None for lossless dispatch, else slots per destination
      relative to an even split (see module docstring).
    dtype: compute dtype of the expert matmuls (accumulation is float32).
    return_dropped: also return the fraction of router-kept assignments that
      the dispatch or local capacity dropped (float32 scalar, over all devices).
    local_impl: "ragged" (`ragged_dot` on sorted rows) or "buffered"
      (per-local-expert buffers, one batched matmul; the GPU choice).
    local_capacity_factor: buffered only: buffer rows per local expert
      relative to an even split of the received rows (the expected number
      of real rows when capacity_factor is None); None = every received
      row fits (lossless, E_l x the work).
    grouped_backend: ragged only: the grouped-matmul backend
      (`grouped_matmul.BACKENDS`; buffered always uses the batched einsum).

  Returns:
    y_nd [N, d] float32: sum_k w[n, k] * expert_{idx[n, k]}(x[n]);
    with return_dropped, (y_nd, dropped_fraction).
  """
  mesh = current_mesh() if mesh is None else mesh
  if mesh is None:
    raise ValueError("routed_experts needs a mesh (argument or jax.set_mesh)")
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
  if local_impl not in ("ragged", "buffered"):
    raise ValueError(f"local_impl={local_impl!r}; allowed: 'ragged', 'buffered'")
  e_local = num_experts // n_shards
  n_local = n // n_tok_shards
  cap = capacity(n_local, k, n_shards, capacity_factor)
  # Buffers are sized from the rows a device expects (n_local * k on average),
  # not from the padded all_to_all slots.
  if local_impl == "buffered":
    local_cap = n_shards * cap
    if local_capacity_factor is not None:
      local_cap = min(local_cap, local_capacity(n_local * k, e_local, local_capacity_factor))
    backend = "einsum"
  else:
    local_cap, backend = None, grouped_backend

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
    # Receive side: the one-device computation on the received rows.
    recv_e = recv_e.reshape(-1, 1)
    recv_kept = recv_e < e_local
    grouped = moe_dispatch.plan_slots(recv_e, recv_kept, e_local, local_cap)
    rows = moe_dispatch.dispatch_rows(recv_x.reshape(-1, d), grouped.source_s, grouped.slot_nk)
    y_sd = grouped_matmul.grouped_swiglu(rows, wi_gate, wi_up, wo,
                                         group_sizes=grouped.group_sizes, capacity=local_cap,
                                         backend=backend, dtype=dtype)
    # Back to received order: with one slot per row this is the same gather
    # with the roles of the two index maps exchanged.
    y_r = moe_dispatch.dispatch_rows(y_sd, grouped.slot_nk[:, 0], grouped.source_s[:, None])
    back = jax.lax.all_to_all(y_r.reshape(n_shards, cap, d), expert_axis, 0, 0, tiled=True)
    y_nd = moe_dispatch.combine_rows(back.reshape(n_shards * cap, d), w_nk, send.slot_nk,
                                     send.assign_s)
    dropped = send.overflow_count(kept_nk) + grouped.overflow_count(recv_kept)
    counts = jnp.stack([dropped, jnp.sum(kept_nk.astype(jnp.float32))])
    if t_axes:
      counts = jax.lax.psum(counts, t_axes)
    return y_nd, counts

  tok = P(t_axes if t_axes else None)
  wspec = P(expert_axis)
  y, counts = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, wspec, wspec, wspec),
                            out_specs=(tok, P()))(x_nd, idx_nk, w_nk, wi_gate_edh, wi_up_edh,
                                                  wo_ehd)
  if return_dropped:
    return y, counts[0] / jnp.maximum(counts[1], 1.0)
  return y
