"""Quantile routers: same-batch thresholds, and the lagged quantile bias."""

import jax
import jax.numpy as jnp

from k3jax.routing import capacity as capacity_lib
from k3jax.routing import quantiles
from k3jax.routing import selection
from k3jax.routing import state as state_lib
from k3jax.routing.config import RouterConfig


# Small enough not to reorder distinct shifted scores of sigmoid outputs in
# practice (float32 spacing near 1 is 6e-8), large enough to split exact ties.
_TIE_BREAK = 1e-6


def balanced_count(num_tokens: int | jax.Array, num_experts: int, k: int) -> int | jax.Array:
  """Assignments per expert under perfect balance, ceil(T * k / E), in [1, T]
  (traced for a traced T, the unmasked tokens of a masked batch)."""
  return capacity_lib.expert_capacity(num_tokens, num_experts, k, 1.0)


def route_quantile(scores_te: jax.Array, *, k: int, config: RouterConfig, state=None,
                   valid_t: jax.Array | None = None):
  """Same-batch quantile thresholds (stateless; identical in training and eval).

  Expert e's threshold q_e is the score of its ceil(T k / E)-th highest token in
  this batch, i.e. the 1 - k/E quantile of scores[:, e]. Tokens rank experts
  by scores - q (ties to the higher score), then the capacity keeps each
  expert at most its share. No gradient flows through q.

  Args:
    scores_te: [T, E] sigmoid scores.
    k: experts per token.
    config: RouterConfig (quantile_impl, num_bins, capacity_factor).
    state: ignored (None).
    valid_t: [T] bool or None; False tokens (padding) get no expert and count
      neither in T, the thresholds, the capacity nor the stats.

  Returns:
    (indices_tk int32, weights_tk float32, stats, None); stats["threshold"] is q [E].
  """
  del state
  num_tokens, num_experts = scores_te.shape
  count = balanced_count(capacity_lib.counted_tokens(num_tokens, valid_t), num_experts, k)
  q_e = quantiles.column_threshold(
      jax.lax.stop_gradient(scores_te), count, impl=config.quantile_impl,
      num_bins=config.num_bins, valid_t=valid_t)
  s_te = jax.lax.stop_gradient(scores_te).astype(jnp.float32)
  # Ties in s - q go to the higher raw score. They are common when the batch
  # is small: with T k <= E (one-token decoding) q_e is the token's own score
  # and every shifted score is exactly 0, so routing falls back to top-k of s.
  select_te = (s_te - q_e[None, :]) + _TIE_BREAK * s_te
  indices_tk, weights_tk, stats, _ = selection.select_rank_assign(
      scores_te, select_te, k=k, config=config, valid_t=valid_t)
  stats["threshold"] = q_e
  return indices_tk, weights_tk, stats, None


def lagged_bias_update(scores_te: jax.Array, bias_e: jax.Array, *, k: int,
                       config: RouterConfig, valid_t: jax.Array | None = None) -> jax.Array:
  """The bias this batch implies for the next one.

  With alpha_t the token's (k+1)-th biased score, expert e is in a token's
  top-k exactly when s_te + b_e > alpha_t. The new b_e makes that hold for
  ceil(T k / E) tokens of this batch: -b_e is the matching upper quantile of
  s_te - alpha_t (equivalently b_e is the k/E quantile of alpha_t - s_te).
  The result is mean-centred; no gradient flows.

  Args:
    scores_te: [T, E] sigmoid scores.
    bias_e: [E] current bias.
    k: experts per token.
    config: RouterConfig.
    valid_t: [T] bool or None: the quantile over the True tokens only; a
      batch without any keeps the bias.

  Returns:
    new bias [E] float32.
  """
  num_tokens, num_experts = scores_te.shape
  s_te = jax.lax.stop_gradient(scores_te).astype(jnp.float32)
  bias_e = jax.lax.stop_gradient(bias_e).astype(jnp.float32)
  if k >= num_experts:  # every expert is always chosen; the bias is moot
    return jnp.zeros_like(bias_e)
  top_tk1, _ = selection.top_k(s_te + bias_e[None, :], k + 1)
  alpha_t = top_tk1[:, k]
  count = balanced_count(capacity_lib.counted_tokens(num_tokens, valid_t), num_experts, k)
  neg_b = quantiles.column_threshold(
      s_te - alpha_t[:, None], count, impl=config.quantile_impl,
      num_bins=config.num_bins, valid_t=valid_t)
  new_b = -neg_b
  if valid_t is not None:
    return jnp.where(jnp.any(valid_t), new_b - jnp.mean(new_b), bias_e)
  return new_b - jnp.mean(new_b)


def route_quantile_lagged(scores_te: jax.Array, *, k: int, config: RouterConfig,
                          state: dict, valid_t: jax.Array | None = None):
  """Top-k of scores + bias, the bias coming from the previous batch.

  Causal within a batch when dropless (capacity_factor=None): a token's choice
  depends on its own scores and the carried bias only.

  Args:
    scores_te: [T, E] sigmoid scores.
    k: experts per token.
    config: RouterConfig.
    state: {"bias": [E] float32}, from init_router_state or the previous call.
    valid_t: [T] bool or None; False tokens (padding) get no expert and count
      neither in the capacity, the next bias nor the stats.

  Returns:
    (indices_tk int32, weights_tk float32, stats, {"bias": new [E]}).
  """
  bias_e = state_lib.read_bias(state, scores_te.shape[1], "quantile_lagged")
  select_te = jax.lax.stop_gradient(scores_te) + bias_e[None, :]
  indices_tk, weights_tk, stats, _ = selection.select_rank_assign(
      scores_te, select_te, k=k, config=config, valid_t=valid_t)
  new_bias = lagged_bias_update(scores_te, bias_e, k=k, config=config, valid_t=valid_t)
  stats["bias"] = bias_e
  return indices_tk, weights_tk, stats, {"bias": new_bias}

