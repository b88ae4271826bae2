"""Shared tail of the top-k-style routers: rank, apply capacity, weigh, measure."""
import jax
import jax.numpy as jnp

from k3jax.routing import capacity as capacity_lib
from k3jax.routing import quantiles
from k3jax.routing import stats as stats_lib
from k3jax.routing.config import RouterConfig


# Up to this many experts a token's top-m comes from an [E, E] comparison per
# token (one fused pass) instead of `lax.top_k` (0.11 ms on the H200 for the
# top 4 of 16 at 32768 tokens).
_COMPARE_MAX_EXPERTS = 32


def top_k(v_te: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """`jax.lax.top_k(v_te, m)` along the expert axis: the same values, ids and tie order.

  For few experts each value's rank in its row is counted from pairwise
  comparisons in float32's total order (-0.0 below 0.0; ties to the lower
  id), as `lax.top_k` ranks, and the ids of ranks 0..m-1 are read off;
  otherwise `lax.top_k`.

  Args:
    v_te: [T, E] float32 values (no NaN).
    m: static int in [1, E].

  Returns:
    values_tm [T, m] (v's dtype), ids_tm [T, m] int32, in descending order.
  """
  num_experts = v_te.shape[1]
  if num_experts > _COMPARE_MAX_EXPERTS:
    values, ids = jax.lax.top_k(v_te, m)
    return values, ids.astype(jnp.int32)
  e = jnp.arange(num_experts, dtype=jnp.int32)
  key_te = quantiles.ordered_keys(v_te)
  other, this = key_te[:, None, :], key_te[:, :, None]    # [T, e, e']
  beats = (other > this) | ((other == this) & (e[None, None, :] < e[None, :, None]))
  rank_te = jnp.sum(beats.astype(jnp.int32), axis=-1)
  at_rank = rank_te[:, None, :] == jnp.arange(m, dtype=jnp.int32)[None, :, None]  # [T, m, e]
  ids_tm = jnp.sum(jnp.where(at_rank, e[None, None, :], 0), axis=-1)
  return jnp.take_along_axis(v_te, ids_tm, axis=1), ids_tm


def combine_weights(scores_te: jax.Array, indices_tk: jax.Array,
                    kept_tk: jax.Array) -> jax.Array:
  """Unbiased scores of the kept experts, renormalised to sum to 1 per token.

  Args:
    scores_te: [T, E] router scores (sigmoid outputs); gradients flow here.
    indices_tk: [T, k] int expert ids.
    kept_tk: [T, k] bool.

  Returns:
    weights_tk: [T, k] float32, zero where not kept (and for tokens with
    nothing kept).
  """
  s_tk = jnp.take_along_axis(scores_te.astype(jnp.float32), indices_tk, axis=1)
  s_tk = jnp.where(kept_tk, s_tk, 0.0)
  denom = jnp.sum(s_tk, axis=1, keepdims=True)
  return jnp.where(denom > 0, s_tk / jnp.where(denom > 0, denom, 1.0), 0.0)


def select_rank_assign(scores_te: jax.Array, select_te: jax.Array, *, k: int,
                       config: RouterConfig, aux_loss: jax.Array | None = None,
                       valid_t: jax.Array | None = None):
  """Ranks experts by `select_te`, applies the capacity, weighs by `scores_te`.

  Args:
    scores_te: [T, E] unbiased scores (the combine weights come from these).
    select_te: [T, E] selection scores (shifted/biased); no gradient is taken.
    k: experts per token.
    config: RouterConfig (capacity_factor, overflow_choices).
    aux_loss: optional scalar to pass through to the stats.
    valid_t: [T] bool or None: False tokens keep nothing (weight 0) and count
      neither in the capacity (that of the True tokens) nor in the stats.

  Returns:
    indices_tk int32, weights_tk float32, stats dict, routed_tk (the preferred
    top-k before the capacity).
  """
  num_tokens, num_experts = scores_te.shape
  cap = capacity_lib.expert_capacity(capacity_lib.counted_tokens(num_tokens, valid_t),
                                     num_experts, k, config.capacity_factor)
  extra = k if config.overflow_choices is None else config.overflow_choices
  num_cand = k if cap is None else min(num_experts, k + extra)
  _, cand_tm = top_k(jax.lax.stop_gradient(select_te), num_cand)
  indices_tk, kept_tk = capacity_lib.assign_with_capacity(
      cand_tm, k=k, num_experts=num_experts, capacity=cap, valid_t=valid_t)
  weights_tk = combine_weights(scores_te, indices_tk, kept_tk)
  routed_tk = cand_tm[:, :k]
  stats = stats_lib.routing_stats(indices_tk, kept_tk, routed_tk, num_experts, aux_loss,
                                  valid_t=valid_t)
  return indices_tk, weights_tk, stats, routed_tk
