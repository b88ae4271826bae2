"""Plain top-k and the Switch/GShard auxiliary-loss router."""
import jax
import jax.numpy as jnp

from k3jax.routing import capacity as capacity_lib
from k3jax.routing import selection
from k3jax.routing import stats as stats_lib
from k3jax.routing.config import RouterConfig


def route_topk(scores_te: jax.Array, *, k: int, config: RouterConfig, state=None,
               valid_t: jax.Array | None = None):
  """Top-k of the raw scores, no balancing. Stateless.

  Args:
    scores_te: [T, E] sigmoid scores.
    k: experts per token.
    config: RouterConfig.
    state: ignored (None).
    valid_t: [T] bool or None; False tokens (padding) get no expert and count
      neither in the capacity nor in the stats.

  Returns:
    (indices_tk int32, weights_tk float32, stats, None).
  """
  del state
  indices_tk, weights_tk, stats, _ = selection.select_rank_assign(
      scores_te, scores_te, k=k, config=config, valid_t=valid_t)
  return indices_tk, weights_tk, stats, None


def route_aux_loss(scores_te: jax.Array, *, k: int, config: RouterConfig, state=None,
                   valid_t: jax.Array | None = None):
  """Top-k plus the balance loss alpha * E * sum_e f_e P_e. Stateless.

  f_e is the fraction of the T*k preferred assignments that pick expert e (no
  gradient); P_e is the mean over tokens of the token's scores normalised over
  experts (the gradient path). A uniform router gives alpha. With `valid_t`
  both run over the unmasked tokens only.

  Args/returns as route_topk; stats["aux_loss"] holds the scalar loss.
  """
  del state
  num_tokens, num_experts = scores_te.shape
  indices_tk, weights_tk, stats, routed_tk = selection.select_rank_assign(
      scores_te, scores_te, k=k, config=config, valid_t=valid_t)
  counts_e = stats_lib.routed_load(routed_tk, num_experts, valid_t)
  assignments = capacity_lib.counted_tokens(num_tokens, valid_t) * k
  if valid_t is not None:  # an all-padding batch divides by 1, not 0
    assignments = jnp.maximum(assignments, 1)
  f_e = jax.lax.stop_gradient(counts_e / assignments)
  s_te = scores_te.astype(jnp.float32)
  p_e = stats_lib.token_mean(s_te / jnp.maximum(jnp.sum(s_te, axis=1, keepdims=True), 1e-30),
                             valid_t)
  loss = config.aux_loss_coef * num_experts * jnp.sum(f_e * p_e)
  stats["aux_loss"] = loss
  return indices_tk, weights_tk, stats, None
