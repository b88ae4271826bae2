"""Dispatch and combine for routed experts: each token row moves once each way.

A routing decision sends token n to the k groups `group_nk[n]` (experts, or
expert shards). A `SlotPlan` gives every kept assignment one row ("slot") of
a grouped layout with S rows:

- capacity layout (`capacity=c`): group g owns slots [g c, (g + 1) c); an
  assignment past its group's c-th is not placed. S = G c.
- ragged layout (`capacity=None`): slots sorted by group, group g holding
  `group_sizes[g]` consecutive rows; S = N k, rows past the last group empty.

With `align=a`, every group starts on a multiple of a (the tile of the
Pallas grouped matmuls, `pallas_kernels.gmm`): capacity c is rounded up to
a multiple of a, and ragged groups are padded to one, so S grows to at most
N k + G (a - 1) rows, rounded up to a multiple of a. Padding slots are empty.

Within a group, assignments keep token order. `dispatch_rows` gathers token
rows into slots; `combine_rows` gathers each token's k slot rows back and
sums them with the combine weights. Both run as gathers in both directions
(custom VJPs): no [N k, d] scatter, no float32 copy of the dispatched rows.
Only int32 index vectors are ever scattered, when the plan is built.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.routing import capacity as capacity_lib


class SlotPlan(NamedTuple):
  """Where each assignment goes in the grouped layout.

  Attributes:
    slot_nk: [N, k] int32 slot of assignment (n, j); S where it was not
      placed (dropped by the router, or past its group's capacity).
    source_s: [S] int32 token that fills slot s; N where the slot is empty.
    assign_s: [S] int32 flat assignment n k + j in slot s; N k where empty.
    group_sizes: [G] int32 slots filled per group.
    group_starts: [G] int32 first slot of each group (a multiple of `align`).
    capacity: slots per group (capacity layout, before alignment) or None
      (ragged layout).
    align: the row multiple every group starts on.
  """

  slot_nk: jax.Array
  source_s: jax.Array
  assign_s: jax.Array
  group_sizes: jax.Array
  group_starts: jax.Array
  capacity: int | None
  align: int = 1

  @property
  def num_slots(self) -> int:
    """S, the rows of the grouped layout."""
    return self.source_s.shape[0]

  def overflow_count(self, kept_nk: jax.Array) -> jax.Array:
    """Kept assignments the layout could not place (past a group's capacity), float32."""
    placed = self.slot_nk < self.num_slots
    return jnp.sum((kept_nk & ~placed).astype(jnp.float32))


def plan_slots(group_nk: jax.Array, kept_nk: jax.Array, num_groups: int,
               capacity: int | None = None, *, positions: str = "auto",
               align: int = 1) -> SlotPlan:
  """Assigns every kept (token, choice) pair a slot of the grouped layout.

  Args:
    group_nk: [N, k] int group ids in [0, num_groups).
    kept_nk: [N, k] bool; False assignments get no slot.
    num_groups: G.
    capacity: slots per group (capacity layout; later assignments of a full
      group are not placed), or None (ragged layout; all kept ones placed).
    positions: how an assignment's rank within its group is found
      (`capacity.rank_within_key`: "sort", "count" or "auto"). The plan is
      the same either way.
    align: every group's first slot is a multiple of it (see the module
      docstring); 1 packs the groups.

  Returns:
    SlotPlan.
  """
  if group_nk.ndim != 2 or kept_nk.shape != group_nk.shape:
    raise ValueError(f"group_nk and kept_nk must be [N, k] of one shape, got "
                     f"{group_nk.shape} and {kept_nk.shape}")
  if capacity is not None and not (isinstance(capacity, int) and capacity >= 1):
    raise ValueError(f"capacity={capacity!r}; must be an int >= 1 or None (ragged layout)")
  if not (isinstance(align, int) and align >= 1):
    raise ValueError(f"align={align!r}; must be an int >= 1")
  capacity_lib.check_positions(positions)
  n, k = group_nk.shape
  num_assign = n * k
  group_a = jnp.where(kept_nk, group_nk, num_groups).reshape(-1).astype(jnp.int32)
  counts = jnp.bincount(group_a, length=num_groups + 1).astype(jnp.int32)
  rank_a = capacity_lib.rank_within_key(group_a, num_groups, positions=positions)
  real = group_a < num_groups
  round_up = lambda x: (x + align - 1) // align * align
  if capacity is None:
    num_slots = round_up(num_assign + num_groups * (align - 1))
    placed = real
    group_sizes = counts[:num_groups]
    padded = round_up(group_sizes)
    starts = jnp.cumsum(padded) - padded  # first row of each group
    slot_a = jnp.where(placed, starts[jnp.minimum(group_a, num_groups - 1)] + rank_a, num_slots)
  else:
    stride = round_up(capacity)
    num_slots = num_groups * stride
    placed = real & (rank_a < capacity)
    slot_a = jnp.where(placed, group_a * stride + rank_a, num_slots)
    group_sizes = jnp.minimum(counts[:num_groups], capacity)
    starts = jnp.arange(num_groups, dtype=jnp.int32) * stride
  assign = jnp.arange(num_assign, dtype=jnp.int32)
  # Placed slots are distinct; unplaced assignments write out of range (dropped).
  assign_s = jnp.full((num_slots,), num_assign, jnp.int32).at[slot_a].set(assign, mode="drop")
  source_s = jnp.where(assign_s < num_assign, assign_s // k, n)
  return SlotPlan(slot_a.reshape(n, k), source_s, assign_s, group_sizes,
                  starts.astype(jnp.int32), capacity, align)


def take_rows(x_rd: jax.Array, index_i: jax.Array) -> jax.Array:
  """x_rd[index] with zero rows for out-of-range indices (the empty sentinel)."""
  return jnp.take(x_rd, index_i, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def dispatch_rows(x_nd: jax.Array, source_s: jax.Array, slot_nk: jax.Array) -> jax.Array:
  """Token rows in slot order: out[s] = x[source_s[s]], zero for empty slots.

  Args:
    x_nd: [N, d] token rows, already in the compute dtype.
    source_s: [S] int32 (SlotPlan.source_s).
    slot_nk: [N, k] int32 (SlotPlan.slot_nk); used by the backward only,
      which sums each token's k slot cotangents (a gather, not a scatter-add).

  Returns:
    [S, d] in x's dtype.
  """
  del slot_nk
  return take_rows(x_nd, source_s)


def _dispatch_fwd(x_nd, source_s, slot_nk):
  return take_rows(x_nd, source_s), slot_nk


def slot_sums(x_sd: jax.Array, slot_nk: jax.Array) -> jax.Array:
  """Each token's sum over its k slot rows, float32 [N, d]: the dispatch's VJP,
  a gather (unplaced assignments add 0)."""
  return jnp.sum(take_rows(x_sd, slot_nk).astype(jnp.float32), axis=1)


def _dispatch_bwd(slot_nk, g_sd):
  # The output has x's dtype, and so does its cotangent.
  return slot_sums(g_sd, slot_nk).astype(g_sd.dtype), None, None


dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def combine_rows(y_sd: jax.Array, w_nk: jax.Array, slot_nk: jax.Array,
                 assign_s: jax.Array) -> jax.Array:
  """Weighted sum of each token's k expert rows: out[n] = sum_j w[n, j] y[slot[n, j]].

  Args:
    y_sd: [S, d] expert outputs in slot order (any float dtype).
    w_nk: [N, k] float32 combine weights.
    slot_nk: [N, k] int32 (SlotPlan.slot_nk); unplaced assignments add 0.
    assign_s: [S] int32 (SlotPlan.assign_s); used by the backward, which
      gathers each slot's token cotangent instead of scattering.

  Returns:
    [N, d] float32.
  """
  del assign_s
  return weighted_rows(y_sd, w_nk, slot_nk)


def weighted_rows(y_sd: jax.Array, w_nk: jax.Array, slot_nk: jax.Array) -> jax.Array:
  """The combine itself, float32 [N, d]: what `combine_rows` and the routed
  experts' forward (`routed_gmm`) return."""
  rows_nkd = take_rows(y_sd, slot_nk).astype(jnp.float32)
  return jnp.einsum("nkd,nk->nd", rows_nkd, w_nk.astype(jnp.float32))


def combine_grad_parts(y_sd: jax.Array, w_nk: jax.Array, slot_nk: jax.Array,
                       assign_s: jax.Array, g_nd: jax.Array):
  """What the combine's VJP needs, by gathers only: each slot's weight w_s [S]
  and token token_s [S], and the weights' gradient dw_nk [N, k], all float32.

  Slot s holds assignment assign_s = n k + j; an empty slot (N k) reads token
  N, out of range, so `take_rows(g_nd, token_s)` gives it a zero row.
  """
  k = slot_nk.shape[1]
  w_s = jnp.take(w_nk.reshape(-1).astype(jnp.float32), assign_s, mode="fill", fill_value=0)
  rows_nkd = take_rows(y_sd, slot_nk).astype(jnp.float32)
  dw_nk = jnp.einsum("nkd,nd->nk", rows_nkd, g_nd.astype(jnp.float32))
  return w_s, assign_s // k, dw_nk


def _combine_fwd(y_sd, w_nk, slot_nk, assign_s):
  return weighted_rows(y_sd, w_nk, slot_nk), (y_sd, w_nk, slot_nk, assign_s)


def _combine_bwd(res, g_nd):
  y_sd, w_nk, slot_nk, assign_s = res
  w_s, token_s, dw_nk = combine_grad_parts(y_sd, w_nk, slot_nk, assign_s, g_nd)
  dy_sd = (take_rows(g_nd.astype(jnp.float32), token_s) * w_s[:, None]).astype(y_sd.dtype)
  return dy_sd, dw_nk.astype(w_nk.dtype), None, None


combine_rows.defvjp(_combine_fwd, _combine_bwd)
