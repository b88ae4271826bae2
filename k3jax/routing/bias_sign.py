"""Loss-free balancing by a sign-updated bias (DeepSeek-V3)."""
import jax
import jax.numpy as jnp

from k3jax.routing import selection
from k3jax.routing import state as state_lib
from k3jax.routing.config import RouterConfig


def route_bias_sign(scores_te: jax.Array, *, k: int, config: RouterConfig, state: dict):
  """Top-k of scores + bias; b_e += u * sign(mean_load - load_e) afterwards.

  The load in the update is the preferred (pre-capacity) top-k load of this
  batch; u is config.bias_update_rate. No gradient flows through the bias.

  Args:
    scores_te: [T, E] sigmoid scores.
    k: experts per token.
    config: RouterConfig.
    state: {"bias": [E] float32}.

  Returns:
    (indices_tk int32, weights_tk float32, stats, {"bias": new [E]}).
  """
  num_experts = scores_te.shape[1]
  bias_e = state_lib.read_bias(state, num_experts, "bias_sign")
  select_te = jax.lax.stop_gradient(scores_te) + bias_e[None, :]
  indices_tk, weights_tk, stats, routed_tk = selection.select_rank_assign(
      scores_te, select_te, k=k, config=config)
  load_e = jnp.bincount(routed_tk.reshape(-1), length=num_experts).astype(jnp.float32)
  new_bias = bias_e + config.bias_update_rate * jnp.sign(jnp.mean(load_e) - load_e)
  stats["bias"] = bias_e
  return indices_tk, weights_tk, stats, {"bias": new_bias}
