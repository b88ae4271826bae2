"""Shared tail of the top-k-style routers: rank, apply capacity, weigh, measure."""
import jax
import jax.numpy as jnp

from k3jax.routing import capacity as capacity_lib
from k3jax.routing import stats as stats_lib
from k3jax.routing.config import RouterConfig


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
                       config: RouterConfig, aux_loss: jax.Array | None = None):
  """Ranks experts by `select_te`, applies the capacity, weighs by `scores_te`.

  Args:
    scores_te: [T, E] unbiased scores (the combine weights come from these).
    select_te: [T, E] selection scores (shifted/biased); no gradient is taken.
    k: experts per token.
    config: RouterConfig (capacity_factor, overflow_choices).
    aux_loss: optional scalar to pass through to the stats.

  Returns:
    indices_tk int32, weights_tk float32, stats dict, routed_tk (the preferred
    top-k before the capacity).
  """
  num_tokens, num_experts = scores_te.shape
  cap = capacity_lib.expert_capacity(num_tokens, num_experts, k, config.capacity_factor)
  extra = k if config.overflow_choices is None else config.overflow_choices
  num_cand = k if cap is None else min(num_experts, k + extra)
  _, cand_tm = jax.lax.top_k(jax.lax.stop_gradient(select_te), num_cand)
  indices_tk, kept_tk = capacity_lib.assign_with_capacity(
      cand_tm, k=k, num_experts=num_experts, capacity=cap)
  weights_tk = combine_weights(scores_te, indices_tk, kept_tk)
  routed_tk = cand_tm[:, :k]
  stats = stats_lib.routing_stats(indices_tk, kept_tk, routed_tk, num_experts, aux_loss)
  return indices_tk, weights_tk, stats, routed_tk
