"""Expert-choice routing (each expert picks its top tokens), as a reference point."""
import jax
import jax.numpy as jnp

from k3jax.routing import capacity as capacity_lib
from k3jax.routing import selection
from k3jax.routing import stats as stats_lib
from k3jax.routing.config import RouterConfig


def route_expert_choice(scores_te: jax.Array, *, k: int, config: RouterConfig, state=None,
                        valid_t: jax.Array | None = None):
  """Each expert takes its ceil(cf * T * k / E) highest-scoring tokens.

  To fit the [T, k] layout a token keeps at most k of the experts that chose
  it (its highest scores); the rest, and empty slots of tokens chosen by
  fewer than k experts, count as dropped with weight 0.

  Args:
    scores_te: [T, E] sigmoid scores.
    k: slots per token.
    config: RouterConfig with a capacity_factor.
    state: ignored (None).
    valid_t: [T] bool or None; False tokens (padding) are never chosen, T in
      the capacity counts the True ones, and the stats cover only them.

  Returns:
    (indices_tk int32, weights_tk float32, stats, None). max_vio_routed is the
    balance before the k-per-token truncation (always 0: every expert is full).
  """
  del state
  num_tokens, num_experts = scores_te.shape
  cap = capacity_lib.expert_capacity(num_tokens, num_experts, k, config.capacity_factor)
  s_te = jax.lax.stop_gradient(scores_te).astype(jnp.float32)
  take_c = True
  if valid_t is not None:
    # Masked tokens sink below every score; an expert takes the first `counted`
    # of its static `cap` picks, all unmasked (counted <= the unmasked tokens).
    s_te = jnp.where(valid_t[:, None], s_te, -jnp.inf)
    counted = capacity_lib.expert_capacity(capacity_lib.counted_tokens(num_tokens, valid_t),
                                           num_experts, k, config.capacity_factor)
    take_c = jnp.arange(cap) < counted
  _, tok_ec = jax.lax.top_k(s_te.T, cap)
  chosen_te = jnp.zeros((num_tokens, num_experts), bool).at[
      tok_ec, jnp.arange(num_experts)[:, None]].set(take_c)
  masked_te = jnp.where(chosen_te, s_te, -jnp.inf)
  vals_tk, indices_tk = jax.lax.top_k(masked_te, k)
  kept_tk = jnp.isfinite(vals_tk)
  indices_tk = indices_tk.astype(jnp.int32)
  weights_tk = selection.combine_weights(scores_te, indices_tk, kept_tk)
  stats = stats_lib.routing_stats(indices_tk, kept_tk, indices_tk, num_experts, valid_t=valid_t)
  stats["max_vio_routed"] = jnp.zeros((), jnp.float32)
  return indices_tk, weights_tk, stats, None
