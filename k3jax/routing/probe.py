"""Causality probe: does changing a sequence's future change the routing of its past?"""
import jax
import jax.numpy as jnp

from k3jax import routing


def routing_causality_probe(scores_bse: jax.Array, new_future_se: jax.Array, *,
                            t: int, k: int, config, state=None, sequence: int = 0) -> dict:
  """Routes a batch twice, the second time with positions > t of one sequence replaced.

  Tokens are flattened sequence-major ([B * S, E]) as a layer sees them.

  Args:
    scores_bse: [B, S, E] scores of the batch.
    new_future_se: [S - t - 1, E] replacement scores for positions t+1..S-1
      of sequence `sequence`.
    t: last position whose routing must not depend on the change.
    k: experts per token.
    config: RouterConfig.
    state: router state (same for both calls).
    sequence: which sequence's future to change.

  Returns:
    dict: changed_fraction (tokens at positions <= t, of every sequence, whose
    indices or weights changed), max_weight_change over those tokens, and
    causal (bool: nothing at positions <= t changed).
  """
  b, s, e = scores_bse.shape
  if not 0 <= t < s - 1:
    raise ValueError(f"t={t} must lie in [0, S-2={s - 2}]")
  if new_future_se.shape != (s - t - 1, e):
    raise ValueError(f"new_future_se shape {new_future_se.shape}, expected {(s - t - 1, e)}")
  changed_bse = scores_bse.at[sequence, t + 1:].set(new_future_se)

  @jax.jit
  def run(x_bse):
    idx, w, _, _ = routing.route(x_bse.reshape(b * s, e), k=k, config=config, state=state)
    return idx.reshape(b, s, k), w.reshape(b, s, k)

  idx0, w0 = run(scores_bse)
  idx1, w1 = run(changed_bse)
  # Compare routing as dense [E] weight vectors so slot order does not matter.
  dense0 = _dense(idx0, w0, e)[:, : t + 1]
  dense1 = _dense(idx1, w1, e)[:, : t + 1]
  diff_bs = jnp.max(jnp.abs(dense0 - dense1), axis=-1)
  changed = diff_bs > 0
  return {
      "changed_fraction": float(jnp.mean(changed.astype(jnp.float32))),
      "max_weight_change": float(jnp.max(diff_bs)),
      "causal": not bool(jnp.any(changed)),
  }


def _dense(idx_bsk, w_bsk, num_experts):
  onehot = jax.nn.one_hot(idx_bsk, num_experts, dtype=jnp.float32)
  return jnp.einsum("bske,bsk->bse", onehot, w_bsk)
