"""Plain top-k and the Switch/GShard auxiliary-loss router."""
import jax
import jax.numpy as jnp

from k3jax.routing import selection
from k3jax.routing.config import RouterConfig


def route_topk(scores_te: jax.Array, *, k: int, config: RouterConfig, state=None):
  """Top-k of the raw scores, no balancing. Stateless.

  Args:
    scores_te: [T, E] sigmoid scores.
    k: experts per token.
    config: RouterConfig.
    state: ignored (None).

  Returns:
    (indices_tk int32, weights_tk float32, stats, None).
  """
  del state
  indices_tk, weights_tk, stats, _ = selection.select_rank_assign(
      scores_te, scores_te, k=k, config=config)
  return indices_tk, weights_tk, stats, None


def route_aux_loss(scores_te: jax.Array, *, k: int, config: RouterConfig, state=None):
  """Top-k plus the balance loss alpha * E * sum_e f_e P_e. Stateless.

  f_e is the fraction of the T*k preferred assignments that pick expert e (no
  gradient); P_e is the mean over tokens of the token's scores normalised over
  experts (the gradient path). A uniform router gives alpha.

  Args/returns as route_topk; stats["aux_loss"] holds the scalar loss.
  """
  del state
  num_tokens, num_experts = scores_te.shape
  indices_tk, weights_tk, stats, routed_tk = selection.select_rank_assign(
      scores_te, scores_te, k=k, config=config)
  counts_e = jnp.bincount(routed_tk.reshape(-1), length=num_experts)
  f_e = jax.lax.stop_gradient(counts_e.astype(jnp.float32) / (num_tokens * k))
  s_te = scores_te.astype(jnp.float32)
  p_e = jnp.mean(s_te / jnp.maximum(jnp.sum(s_te, axis=1, keepdims=True), 1e-30), axis=0)
  loss = config.aux_loss_coef * num_experts * jnp.sum(f_e * p_e)
  stats["aux_loss"] = loss
  return indices_tk, weights_tk, stats, None
