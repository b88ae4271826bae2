"""Carried router state: a per-expert bias for the stateful routers."""
import jax
import jax.numpy as jnp

from k3jax.routing.config import RouterConfig


def init_router_state(num_experts: int, config: RouterConfig) -> dict | None:
  """{"bias": zeros [E] float32} for stateful routers, None for stateless ones."""
  if not (isinstance(num_experts, int) and num_experts >= 1):
    raise ValueError(f"num_experts={num_experts!r}; must be an int >= 1")
  if not config.stateful:
    return None
  return {"bias": jnp.zeros((num_experts,), jnp.float32)}


def read_bias(state, num_experts: int, name: str) -> jax.Array:
  """The bias [E] float32 of `state`, without gradient; clear error if missing."""
  if state is None or "bias" not in state:
    raise ValueError(
        f"router {name!r} needs state={{'bias': [E]}} (see init_router_state), "
        f"got {state!r}")
  bias_e = jax.lax.stop_gradient(jnp.asarray(state["bias"], jnp.float32))
  if bias_e.shape != (num_experts,):
    raise ValueError(
        f"router {name!r}: bias shape {bias_e.shape}, expected ({num_experts},)")
  return bias_e
