"""Loss-free balancing by a sign-updated bias (DeepSeek-V3)."""
import jax
import jax.numpy as jnp

from k3jax.routing import selection
from k3jax.routing import state as state_lib
from k3jax.routing import stats as stats_lib
from k3jax.routing.config import RouterConfig


def route_bias_sign(scores_te: jax.Array, *, k: int, config: RouterConfig, state: dict,
                    valid_t: jax.Array | None = None):
  """Top-k of scores + bias; b_e += u * sign(mean_load - load_e) afterwards.

  The load in the update is the preferred (pre-capacity) top-k load of this
  batch; u is config.bias_update_rate. No gradient flows through the bias.

  Args:
    scores_te: [T, E] sigmoid scores.
    k: experts per token.
    config: RouterConfig.
    state: {"bias": [E] float32}.
    valid_t: [T] bool or None; False tokens (padding) get no expert and count
      neither in the capacity, the update's load nor the stats.

  Returns:
    (indices_tk int32, weights_tk float32, stats, {"bias": new [E]}).
  """
  num_experts = scores_te.shape[1]
  bias_e = state_lib.read_bias(state, num_experts, "bias_sign")
  select_te = jax.lax.stop_gradient(scores_te) + bias_e[None, :]
  indices_tk, weights_tk, stats, routed_tk = selection.select_rank_assign(
      scores_te, select_te, k=k, config=config, valid_t=valid_t)
  load_e = stats_lib.routed_load(routed_tk, num_experts, valid_t)
  new_bias = bias_e + config.bias_update_rate * jnp.sign(jnp.mean(load_e) - load_e)
  stats["bias"] = bias_e
  return indices_tk, weights_tk, stats, {"bias": new_bias}
