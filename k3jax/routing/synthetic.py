"""Skewed synthetic router scores: a few hot experts, fresh tokens per batch."""
import jax
import jax.numpy as jnp


def skewed_scores(key: jax.Array, num_tokens: int, num_experts: int, *,
                  num_hot: int = 4, hot_shift: float = 1.5) -> jax.Array:
  """sigmoid(z + shift_e), z ~ N(0, 1) per (token, expert).

  The first `num_hot` experts get +hot_shift on their logits, so plain top-k
  piles tokens onto them.

  Args:
    key: PRNG key; a new key gives a fresh batch from the same distribution.
    num_tokens: T.
    num_experts: E.
    num_hot: number of hot experts, in [0, E].
    hot_shift: logit offset of the hot experts.

  Returns:
    scores_te: [T, E] float32 in (0, 1).
  """
  if not 0 <= num_hot <= num_experts:
    raise ValueError(f"num_hot={num_hot} must lie in [0, E={num_experts}]")
  shift_e = jnp.where(jnp.arange(num_experts) < num_hot, hot_shift, 0.0)
  z_te = jax.random.normal(key, (num_tokens, num_experts), jnp.float32)
  return jax.nn.sigmoid(z_te + shift_e[None, :])
