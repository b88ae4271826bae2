"""Balance of a router over a stream of fresh skewed batches (for tables and notebooks)."""
import jax
import numpy as np

from k3jax import routing
from k3jax.routing import synthetic


def balance_over_batches(config, *, num_tokens: int, num_experts: int, k: int,
                         steps: int, num_hot: int = 4, hot_shift: float = 1.5,
                         seed: int = 0) -> dict:
  """Routes `steps` fresh skewed batches, carrying the router state across them.

  Args:
    config: RouterConfig.
    num_tokens, num_experts, k: batch shape [T, E] and experts per token.
    steps: number of batches (>= 1).
    num_hot, hot_shift: the skew (see synthetic.skewed_scores).
    seed: batch i uses PRNG key seed + i.

  Returns:
    dict of numpy [steps] arrays: max_vio, max_vio_routed, drop_fraction,
    reassigned_fraction, load_cv.
  """
  if steps < 1:
    raise ValueError(f"steps={steps} must be >= 1")
  fn = jax.jit(lambda s, st: routing.route(s, k=k, config=config, state=st))
  gen = jax.jit(lambda key: synthetic.skewed_scores(
      key, num_tokens, num_experts, num_hot=num_hot, hot_shift=hot_shift))
  state = routing.init_router_state(num_experts, config)
  keys = ("max_vio", "max_vio_routed", "drop_fraction", "reassigned_fraction", "load_cv")
  out = {key: [] for key in keys}
  for i in range(steps):
    _, _, stats, state = fn(gen(jax.random.key(seed + i)), state)
    for key in keys:
      out[key].append(float(stats[key]))
  return {key: np.asarray(v) for key, v in out.items()}
