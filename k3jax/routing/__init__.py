"""Routers as pure functions of (scores [T, E], k, config[, state]) + balance metrics.

    indices_tk, weights_tk, stats, new_state = route(scores_te, k=8, config=cfg, state=s)

A token mask (`token_mask_t`, False for padding) makes every router route
the unmasked tokens as if the masked ones were absent.
"""
import jax

from k3jax.routing.bias_sign import route_bias_sign
from k3jax.routing.config import QUANTILE_IMPLS, ROUTER_NAMES, RouterConfig
from k3jax.routing.expert_choice import route_expert_choice
from k3jax.routing.quantile import route_quantile, route_quantile_lagged
from k3jax.routing.state import init_router_state
from k3jax.routing.topk import route_aux_loss, route_topk

_ROUTERS = {
    "quantile": route_quantile,
    "quantile_lagged": route_quantile_lagged,
    "bias_sign": route_bias_sign,
    "aux_loss": route_aux_loss,
    "expert_choice": route_expert_choice,
    "topk": route_topk,
}


def route(scores_te: jax.Array, *, k: int, config: RouterConfig, state=None,
          token_mask_t: jax.Array | None = None):
  """Routes T tokens to k of E experts with the router named by config.name.

  Args:
    scores_te: [T, E] floating router scores, sigmoid(x W_r).
    k: experts per token, 1 <= k <= E (static).
    config: RouterConfig.
    state: the router's carried state ({"bias": [E]}) for quantile_lagged and
      bias_sign, from init_router_state or the previous call; None otherwise.
    token_mask_t: [T] bool or None. A False token (padding) gets no expert
      (weights 0, so no slot downstream) and counts nowhere: T in the
      capacity and the balanced count is the number of True tokens, and
      thresholds, biases, the aux loss and the stats see only those, so they
      route exactly as the batch without the masked tokens would (up to the
      order of float sums in the stats). None: every token counts.

  Returns:
    indices_tk: [T, k] int32 expert ids.
    weights_tk: [T, k] float32 combine weights: the unbiased scores of the kept
      experts renormalised per token; 0 for dropped assignments.
    stats: dict of float32 arrays: load [E], max_vio, max_vio_routed, load_cv,
      drop_fraction, reassigned_fraction, aux_loss (0 unless aux_loss), plus router extras.
    new_state: the state for the next batch (None for stateless routers).
  """
  if not isinstance(config, RouterConfig):
    raise ValueError(f"config must be a RouterConfig, got {type(config).__name__}")
  if getattr(scores_te, "ndim", None) != 2:
    raise ValueError(
        f"scores must have shape [T, E], got {getattr(scores_te, 'shape', None)}")
  if not jax.numpy.issubdtype(scores_te.dtype, jax.numpy.floating):
    raise ValueError(f"scores must be floating, got dtype {scores_te.dtype}")
  num_experts = scores_te.shape[1]
  if not (isinstance(k, int) and 1 <= k <= num_experts):
    raise ValueError(f"k={k!r}; must be an int in [1, E={num_experts}]")
  if scores_te.shape[0] < 1:
    raise ValueError("scores must hold at least one token")
  if token_mask_t is not None and (token_mask_t.shape != scores_te.shape[:1]
                                   or token_mask_t.dtype != jax.numpy.bool_):
    raise ValueError(f"token_mask_t must be bool [T={scores_te.shape[0]}], got "
                     f"{token_mask_t.dtype}{token_mask_t.shape}")
  fn = _ROUTERS[config.name]
  if config.stateful:
    return fn(scores_te, k=k, config=config, state=state, valid_t=token_mask_t)
  return fn(scores_te, k=k, config=config, valid_t=token_mask_t)


__all__ = [
    "QUANTILE_IMPLS",
    "ROUTER_NAMES",
    "RouterConfig",
    "init_router_state",
    "route",
]
