"""Expert parallelism: routed experts sharded over the mesh's expert axis.

Inside `jax.shard_map`, every device holds a block of tokens (sharded over
all mesh axes) and E / P experts (P = expert-axis size). Per device:

1. dispatch: the (token, expert) assignments are sorted by expert, so those
   bound for expert shard p are contiguous; each takes a slot in a fixed
   [P, capacity, d] send buffer (slots past the capacity are dropped);
2. `all_to_all` over the expert axis: row p of the buffer goes to shard p,
   which receives [P, capacity, d] rows from every source;
3. the received rows are grouped by local expert and run through the SwiGLU
   experts: `local_impl="ragged"` sorts them for `jax.lax.ragged_dot` (as the
   one-device ragged layer); `local_impl="buffered"` scatters them into
   per-local-expert buffers of `local_capacity` rows and runs one batched
   matmul (as the one-device buffered layer). XLA (jax 0.11.2) expands
   `ragged_dot` on GPU into a product of every row with every expert, so the
   buffered grouping is the GPU choice;
4. combine: the results travel back with the inverse `all_to_all`, are
   weighted by the combine weights and summed over each token's k experts.

Capacity. `capacity_factor=None` sizes each (source, destination) slot
block for the worst case (all local assignments to one shard), so nothing
is ever dropped and the result equals the unsharded layer. A factor c gives
ceil(c * n_local * k / P) slots: communication and expert compute shrink by
about P / c, and assignments beyond the slots are dropped (their output is
zero), in expert order then token order within each source device.

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

from k3jax.layers import moe as moe_lib
from k3jax.parallel import mesh as mesh_lib

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
  return max(1, min(worst, math.ceil(capacity_factor * worst / n_shards)))


def local_capacity(rows: int, num_local: int, local_capacity_factor: float) -> int:
  """Rows per local-expert buffer when `rows` real rows are expected for `num_local` experts."""
  if not local_capacity_factor > 0:
    raise ValueError(f"local_capacity_factor={local_capacity_factor!r}; must be > 0 or None")
  return max(1, min(rows, math.ceil(local_capacity_factor * rows / num_local)))


def routed_experts(x_nd: jax.Array, idx_nk: jax.Array, w_nk: jax.Array, wi_gate_edh: jax.Array,
                   wi_up_edh: jax.Array, wo_ehd: jax.Array, *, mesh: Mesh | None = None,
                   expert_axis: str = mesh_lib.EXPERT,
                   token_axes: Sequence[str] = TOKEN_AXES,
                   capacity_factor: float | None = None,
                   dtype=jnp.float32, return_dropped: bool = False,
                   local_impl: str = "ragged",
                   local_capacity_factor: float | None = None):
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
  lcap = n_shards * cap
  if local_capacity_factor is not None:
    lcap = min(lcap, local_capacity(n_local * k, e_local, local_capacity_factor))

  def local(x_nd, idx_nk, w_nk, wi_gate, wi_up, wo):
    nl = x_nd.shape[0]
    expert_a = idx_nk.reshape(-1).astype(jnp.int32)
    kept_a = (w_nk > 0).reshape(-1)
    key_a = jnp.where(kept_a, expert_a, num_experts)
    order = jnp.argsort(key_a, stable=True)  # sorted slot s -> assignment a
    key_s = key_a[order]
    dest_s = key_s // e_local  # == n_shards for router-dropped assignments
    counts = jnp.bincount(dest_s, length=n_shards + 1)[:n_shards]
    starts = jnp.cumsum(counts) - counts
    pos_s = jnp.arange(nl * k) - starts[jnp.minimum(dest_s, n_shards - 1)]
    ok_s = (dest_s < n_shards) & (pos_s < cap)
    # Out-of-range rows are dropped by the scatter; they never reach a buffer.
    row_s = jnp.where(ok_s, dest_s, n_shards)
    token_s = order // k
    send_x = jnp.zeros((n_shards, cap, d), dtype).at[row_s, pos_s].set(
        x_nd[token_s].astype(dtype), mode="drop")
    send_e = jnp.full((n_shards, cap), e_local, jnp.int32).at[row_s, pos_s].set(
        key_s % e_local, mode="drop")
    recv_x = jax.lax.all_to_all(send_x, expert_axis, 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e, expert_axis, 0, 0, tiled=True)
    rows = n_shards * cap
    row_args = (recv_x.reshape(rows, d), jnp.arange(rows, dtype=jnp.int32), recv_e.reshape(-1),
                e_local)
    if local_impl == "ragged":
      y_r = moe_lib.ragged_swiglu(*row_args, wi_gate, wi_up, wo, dtype)
      local_dropped = jnp.float32(0.0)
    else:
      y_r, overflow = moe_lib.buffered_swiglu(*row_args, lcap, wi_gate, wi_up, wo, dtype)
      local_dropped = jnp.sum(overflow.astype(jnp.float32))
    back = jax.lax.all_to_all(y_r.reshape(n_shards, cap, d), expert_axis, 0, 0, tiled=True)
    y_s = back[jnp.minimum(row_s, n_shards - 1), jnp.minimum(pos_s, cap - 1)]
    y_s = jnp.where(ok_s[:, None], y_s * w_nk.reshape(-1)[order][:, None], 0.0)
    y_a = jnp.zeros_like(y_s).at[order].set(y_s)
    kept = (dest_s < n_shards).astype(jnp.float32)
    counts = jnp.stack([jnp.sum(kept * (1.0 - ok_s)) + local_dropped, jnp.sum(kept)])
    if t_axes:
      counts = jax.lax.psum(counts, t_axes)
    return jnp.sum(y_a.reshape(nl, k, d), axis=1), counts

  tok = P(t_axes if t_axes else None)
  wspec = P(expert_axis)
  y, counts = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, wspec, wspec, wspec),
                            out_specs=(tok, P()))(x_nd, idx_nk, w_nk, wi_gate_edh, wi_up_edh,
                                                  wo_ehd)
  if return_dropped:
    return y, counts[0] / jnp.maximum(counts[1], 1.0)
  return y
