"""Per-expert (per-column) upper quantiles: exact via top_k, or a fixed-bin histogram."""
import jax
import jax.numpy as jnp


def column_threshold_exact(v_te: jax.Array, count: int) -> jax.Array:
  """The `count`-th largest value of each column.

  Args:
    v_te: [T, E] values.
    count: static int in [1, T].

  Returns:
    q_e: [E] float32, so that exactly `count` rows of column e hold v >= q_e
    (absent ties).
  """
  _check(v_te, count)
  top_ec, _ = jax.lax.top_k(v_te.T.astype(jnp.float32), count)
  return top_ec[:, -1]


def column_threshold_histogram(v_te: jax.Array, count: int, num_bins: int) -> jax.Array:
  """Approximate `column_threshold_exact` from a histogram of each column.

  Each column gets `num_bins` equal bins over its own [min, max]. The bin that
  holds the `count`-th largest value is found from counts taken from the top,
  and the threshold is interpolated linearly inside that bin, so it lies
  within one bin width, (max_e - min_e) / num_bins, of the exact one.

  Args:
    v_te: [T, E] values.
    count: static int in [1, T].
    num_bins: static int >= 2.

  Returns:
    q_e: [E] float32.
  """
  _check(v_te, count)
  num_tokens, num_experts = v_te.shape
  v_te = v_te.astype(jnp.float32)
  lo_e = jnp.min(v_te, axis=0)
  hi_e = jnp.max(v_te, axis=0)
  # A constant column gets a tiny positive width so binning stays finite.
  width_e = jnp.maximum((hi_e - lo_e) / num_bins, jnp.finfo(jnp.float32).tiny)
  bin_te = jnp.clip(
      jnp.floor((v_te - lo_e) / width_e).astype(jnp.int32), 0, num_bins - 1)
  flat = (jnp.arange(num_experts, dtype=jnp.int32) * num_bins + bin_te).reshape(-1)
  hist_eb = jax.ops.segment_sum(
      jnp.ones_like(flat), flat, num_segments=num_experts * num_bins,
      indices_are_sorted=False).reshape(num_experts, num_bins)
  # at_or_above_eb[e, b]: rows of column e in bin b or higher (non-increasing in b).
  at_or_above_eb = jnp.cumsum(hist_eb[:, ::-1], axis=1)[:, ::-1]
  bin_e = jnp.sum(at_or_above_eb >= count, axis=1) - 1
  n_in_bin = jnp.take_along_axis(hist_eb, bin_e[:, None], axis=1)[:, 0]
  above = jnp.take_along_axis(at_or_above_eb, bin_e[:, None], axis=1)[:, 0] - n_in_bin
  need = count - above  # in [1, n_in_bin]
  upper_e = lo_e + (bin_e + 1).astype(jnp.float32) * width_e
  frac = need.astype(jnp.float32) / jnp.maximum(n_in_bin, 1).astype(jnp.float32)
  return jnp.minimum(upper_e - frac * width_e, hi_e)


def column_threshold(v_te: jax.Array, count: int, *, impl: str, num_bins: int) -> jax.Array:
  """Dispatches to the exact or histogram threshold; see those for shapes."""
  if impl == "exact":
    return column_threshold_exact(v_te, count)
  if impl == "histogram":
    return column_threshold_histogram(v_te, count, num_bins)
  raise ValueError(f"quantile impl={impl!r}; allowed: ('exact', 'histogram')")


def _check(v_te, count):
  if v_te.ndim != 2:
    raise ValueError(f"expected values of shape [T, E], got {v_te.shape}")
  if not 1 <= count <= v_te.shape[0]:
    raise ValueError(f"count={count} must lie in [1, T={v_te.shape[0]}]")
