"""Capacity limits with overflow reassignment: the next choice with room, else drop."""
import math

import jax
import jax.numpy as jnp


def share(total: int | jax.Array, parts: int, factor: float, *,
          at_most: int | jax.Array) -> int | jax.Array:
  """ceil(factor * total / parts), clipped to [1, at_most]: the one capacity formula.

  `total` items spread over `parts` buffers, each sized `factor` times an even
  share. Every buffer size in the package comes from here, through the three
  functions below: an expert's capacity (`expert_capacity`, also the quantile
  router's balanced count at factor 1), and the expert-parallel slots per
  device pair (`dispatch_slots`) and per local expert (`local_expert_capacity`).
  A traced `total` (the unmasked tokens of a masked batch, `counted_tokens`)
  gives a traced int32 by the same formula in float32 arithmetic, which is
  exact for the factors in use (1, 1.25) below 2^24 items.
  """
  if isinstance(total, jax.Array):
    raw = jnp.ceil(factor * total.astype(jnp.float32) / parts).astype(jnp.int32)
    return jnp.maximum(1, jnp.minimum(at_most, raw))
  return max(1, min(at_most, math.ceil(factor * total / parts)))


def counted_tokens(num_tokens: int, valid_t: jax.Array | None) -> int | jax.Array:
  """The tokens a router counts: `num_tokens`, or the unmasked ones of `valid_t` [T] bool
  (a traced int32 scalar)."""
  if valid_t is None:
    return num_tokens
  return jnp.sum(valid_t.astype(jnp.int32))


def expert_capacity(num_tokens: int | jax.Array, num_experts: int, k: int,
                    capacity_factor: float | None) -> int | jax.Array | None:
  """Assignments one expert may keep per batch: ceil(cf * T * k / E), at most T.

  None (dropless) when capacity_factor is None. A traced T (`counted_tokens`
  of a masked batch) gives a traced capacity.
  """
  if capacity_factor is None:
    return None
  return share(num_tokens * k, num_experts, capacity_factor, at_most=num_tokens)


def dispatch_slots(n_local: int, top_k: int, n_shards: int, slot_factor: float | None) -> int:
  """Expert-parallel send slots per (source device, destination shard) pair.

  ceil(f * n_local * k / P), at most n_local * k; None sizes the block for the
  worst case (every local assignment to one shard: nothing is dropped).
  """
  worst = n_local * top_k
  if slot_factor is None:
    return worst
  if not slot_factor > 0:
    raise ValueError(f"dispatch_slot_factor={slot_factor!r}; must be > 0 or None (lossless)")
  return share(worst, n_shards, slot_factor, at_most=worst)


def local_expert_capacity(rows: int, num_local: int, capacity_factor: float) -> int:
  """Rows per local-expert buffer when `rows` real rows are expected for `num_local` experts.

  ceil(cf * rows / E_l), at most `rows`: the router's formula applied to one
  expert shard's share of the assignments.
  """
  if not capacity_factor > 0:
    raise ValueError(f"capacity_factor={capacity_factor!r}; must be > 0 or None")
  return share(rows, num_local, capacity_factor, at_most=rows)


POSITIONS = ("auto", "sort", "count")
# With at most this many keys a one-hot running count ([A, keys + 1] int32) is
# cheaper than a sort of the A items. On the H200 at 256 keys the count took
# 0.32 ms against the sort's 1.34 (capacity pass, 16 ranks of 32768 tokens)
# and 0.14 against 0.20 (slot plan, 262144 assignments).
_COUNT_MAX_KEYS = 256


def assign_with_capacity(cand_tm: jax.Array, *, k: int, num_experts: int,
                         capacity: int | jax.Array | None,
                         positions: str = "auto",
                         valid_t: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Fills each token's k slots from its ranked candidates under a capacity.

  Candidates are visited rank by rank (all tokens' first choices, then all
  second choices, ...); within a rank, earlier tokens come first. A candidate
  is accepted while the token still has a free slot and the expert has room,
  so overflow falls to the token's next choice with room. Slots left empty
  after all M candidates are dropped.

  The M ranks are unrolled (M is static and small, at most 2k by default), so
  the compiler fuses each rank's few small steps instead of running a loop.

  Args:
    cand_tm: [T, M] int32 expert ids in preference order, M >= k, no repeats
      within a row.
    k: slots per token.
    num_experts: E.
    capacity: per-expert limit (an int, or a traced int32 scalar), or None
      for dropless (first k candidates).
    positions: how a token's place among the same rank's tokens wanting the
      same expert is found: "sort" (a stable sort of the candidates), "count"
      (a one-hot running count, cheaper for few experts) or "auto" ("count"
      up to 256 experts). The result is the same either way.
    valid_t: [T] bool or None; a False token takes no slot and keeps nothing,
      so the others fill as if it were absent.

  Returns:
    indices_tk: [T, k] int32. Dropped slots hold the token's original choice
      for that slot (a valid id; its weight is zeroed by the caller).
    kept_tk: [T, k] bool.
  """
  num_tokens, num_cand = cand_tm.shape
  if num_cand < k:
    raise ValueError(f"need at least k={k} candidates per token, got {num_cand}")
  check_positions(positions)
  cand_tm = cand_tm.astype(jnp.int32)
  if capacity is None:
    kept_tk = jnp.ones((num_tokens, k), bool)
    return cand_tm[:, :k], kept_tk if valid_t is None else kept_tk & valid_t[:, None]

  token_ids = jnp.arange(num_tokens, dtype=jnp.int32)
  counts_e = jnp.zeros((num_experts,), jnp.int32)
  filled_t = jnp.zeros((num_tokens,), jnp.int32)
  out_tk = cand_tm[:, :k]
  for rank in range(num_cand):
    e_t = cand_tm[:, rank]
    want_t = filled_t < k
    if valid_t is not None:
      want_t = want_t & valid_t
    key_t = jnp.where(want_t, e_t, num_experts)
    pos_t = rank_within_key(key_t, num_experts, positions=positions)
    accept_t = want_t & (counts_e[e_t] + pos_t < capacity)
    counts_e = counts_e + jnp.bincount(
        jnp.where(accept_t, e_t, num_experts), length=num_experts + 1)[:num_experts]
    slot_t = jnp.where(accept_t, filled_t, k)  # k is out of range: no write
    out_tk = out_tk.at[token_ids, slot_t].set(e_t, mode="drop")
    filled_t = filled_t + accept_t.astype(jnp.int32)
  kept_tk = jnp.arange(k, dtype=jnp.int32)[None, :] < filled_t[:, None]
  return out_tk, kept_tk


def check_positions(positions: str) -> None:
  """Raises for a `positions` method outside POSITIONS."""
  if positions not in POSITIONS:
    raise ValueError(f"positions={positions!r}; allowed: {POSITIONS}")


def rank_within_key(key_a: jax.Array, num_keys: int, *, positions: str = "auto") -> jax.Array:
  """[A] int32: how many earlier items carry the same key as item a.

  Args:
    key_a: [A] int keys in [0, num_keys] (num_keys itself is a valid key,
      the callers' "no group" sentinel).
    num_keys: the largest real key + 1.
    positions: "sort" (a stable sort groups equal keys in item order),
      "count" (a one-hot running count, cheaper for few keys) or "auto"
      ("count" up to 256 keys). The result is the same either way.
  """
  check_positions(positions)
  if positions == "auto":
    positions = "count" if num_keys <= _COUNT_MAX_KEYS else "sort"
  key_a = key_a.astype(jnp.int32)
  if positions == "count":
    onehot = key_a[:, None] == jnp.arange(num_keys + 1, dtype=jnp.int32)[None, :]
    running = jnp.cumsum(onehot.astype(jnp.int32), axis=0)
    return jnp.take_along_axis(running, key_a[:, None], axis=1)[:, 0] - 1
  item_ids = jnp.arange(key_a.shape[0], dtype=jnp.int32)
  # Group starts in the sorted order, found by cummax over start flags.
  order = jnp.argsort(key_a, stable=True)
  key_sorted = key_a[order]
  is_start = jnp.concatenate([jnp.ones((1,), bool), key_sorted[1:] != key_sorted[:-1]])
  start = jax.lax.cummax(jnp.where(is_start, item_ids, 0))
  return jnp.zeros_like(item_ids).at[order].set(item_ids - start)
