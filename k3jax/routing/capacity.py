"""Capacity limits with overflow reassignment: the next choice with room, else drop."""
import math

import jax
import jax.numpy as jnp


def expert_capacity(num_tokens: int, num_experts: int, k: int,
                    capacity_factor: float | None) -> int | None:
  """Assignments one expert may keep per batch: ceil(cf * T * k / E), at most T.

  None (dropless) when capacity_factor is None.
  """
  if capacity_factor is None:
    return None
  return max(1, min(num_tokens, math.ceil(capacity_factor * num_tokens * k / num_experts)))


def assign_with_capacity(cand_tm: jax.Array, *, k: int, num_experts: int,
                         capacity: int | None) -> tuple[jax.Array, jax.Array]:
  """Fills each token's k slots from its ranked candidates under a capacity.

  Candidates are visited rank by rank (all tokens' first choices, then all
  second choices, ...); within a rank, earlier tokens come first. A candidate
  is accepted while the token still has a free slot and the expert has room,
  so overflow falls to the token's next choice with room. Slots left empty
  after all M candidates are dropped.

  Args:
    cand_tm: [T, M] int32 expert ids in preference order, M >= k, no repeats
      within a row.
    k: slots per token.
    num_experts: E.
    capacity: per-expert limit, or None for dropless (first k candidates).

  Returns:
    indices_tk: [T, k] int32. Dropped slots hold the token's original choice
      for that slot (a valid id; its weight is zeroed by the caller).
    kept_tk: [T, k] bool.
  """
  num_tokens, num_cand = cand_tm.shape
  if num_cand < k:
    raise ValueError(f"need at least k={k} candidates per token, got {num_cand}")
  cand_tm = cand_tm.astype(jnp.int32)
  if capacity is None:
    return cand_tm[:, :k], jnp.ones((num_tokens, k), bool)

  token_ids = jnp.arange(num_tokens, dtype=jnp.int32)

  def visit_rank(carry, e_t):
    counts_e, filled_t, out_tk = carry
    want_t = filled_t < k
    key_t = jnp.where(want_t, e_t, num_experts)
    # Position of each token among the wanting tokens of the same expert,
    # in token order: a stable sort groups them, cummax finds group starts.
    order = jnp.argsort(key_t, stable=True)
    key_sorted = key_t[order]
    is_start = jnp.concatenate(
        [jnp.ones((1,), bool), key_sorted[1:] != key_sorted[:-1]])
    start = jax.lax.cummax(jnp.where(is_start, token_ids, 0))
    pos_t = jnp.zeros_like(token_ids).at[order].set(token_ids - start)
    accept_t = want_t & (counts_e[e_t] + pos_t < capacity)
    counts_e = counts_e + jnp.bincount(
        jnp.where(accept_t, e_t, num_experts), length=num_experts + 1)[:num_experts]
    slot_t = jnp.where(accept_t, filled_t, k)  # k is out of range: no write
    out_tk = out_tk.at[token_ids, slot_t].set(e_t, mode="drop")
    return (counts_e, filled_t + accept_t.astype(jnp.int32), out_tk), None

  init = (jnp.zeros((num_experts,), jnp.int32), jnp.zeros((num_tokens,), jnp.int32),
          cand_tm[:, :k])
  (_, filled_t, indices_tk), _ = jax.lax.scan(visit_rank, init, cand_tm.T)
  kept_tk = jnp.arange(k, dtype=jnp.int32)[None, :] < filled_t[:, None]
  return indices_tk, kept_tk
