"""Per-expert (per-column) upper quantiles: exact (top_k or a radix select), or a histogram."""
import jax
import jax.numpy as jnp

# The radix select reads a value's float32 bits in this many digits of
# 32 / _RADIX_PASSES bits each: one histogram pass per digit.
_RADIX_PASSES = 4
_RADIX_BITS = 32 // _RADIX_PASSES


def column_threshold_exact(v_te: jax.Array, count: int | jax.Array) -> jax.Array:
  """The `count`-th largest value of each column.

  Args:
    v_te: [T, E] values.
    count: static int in [1, T], or a traced int32 scalar in [1, T] (then
      each column is sorted instead of `top_k`, which needs a static count).

  Returns:
    q_e: [E] float32, so that exactly `count` rows of column e hold v >= q_e
    (absent ties).
  """
  _check(v_te, count)
  if isinstance(count, jax.Array):
    ascending_et = jnp.sort(v_te.T.astype(jnp.float32), axis=1)
    return jnp.take(ascending_et, v_te.shape[0] - count, axis=1)
  top_ec, _ = jax.lax.top_k(v_te.T.astype(jnp.float32), count)
  return top_ec[:, -1]


def ordered_keys(v_te: jax.Array) -> jax.Array:
  """uint32 keys whose unsigned order is float32's total order (-0.0 just below 0.0),
  the order `lax.top_k` and `lax.sort` use."""
  bits = jax.lax.bitcast_convert_type(v_te.astype(jnp.float32), jnp.uint32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _float_of_keys(key: jax.Array) -> jax.Array:
  """Inverse of `ordered_keys`."""
  was_positive = (key >> 31) == 1
  bits = jnp.where(was_positive, key & jnp.uint32((1 << 31) - 1), ~key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def column_threshold_radix(v_te: jax.Array, count: int) -> jax.Array:
  """`column_threshold_exact` by a radix select: the same value, without a sort.

  Each column's `count`-th largest float32 is found digit by digit from the
  top of its order-preserving bit pattern: one pass per 8-bit digit counts
  the column's values that share the digits found so far, by their next
  digit (a [E, 256] histogram), and keeps the digit where the count from
  the top reaches `count`. Four passes over [T, E] values and no [E, T]
  sort, so the cost grows with T E, not with T log T per column.

  Args:
    v_te: [T, E] values (finite, or -inf for rows that must not count).
    count: int in [1, T], static or a traced int32 scalar.

  Returns:
    q_e: [E] float32, equal to `column_threshold_exact(v_te, count)`.
  """
  _check(v_te, count)
  num_tokens, num_experts = v_te.shape
  key_te = ordered_keys(v_te)
  radix = 1 << _RADIX_BITS
  prefix_e = jnp.zeros((num_experts,), jnp.uint32)   # digits found so far, in place
  above_e = jnp.zeros((num_experts,), jnp.int32)     # values of the column above the prefix
  col_te = jnp.broadcast_to(jnp.arange(num_experts, dtype=jnp.int32), (num_tokens, num_experts))
  for p in range(_RADIX_PASSES):
    shift = 32 - _RADIX_BITS * (p + 1)
    if p == 0:
      match_te = jnp.ones(key_te.shape, bool)
    else:  # the higher digits equal the prefix's
      match_te = (key_te >> (shift + _RADIX_BITS)) == (prefix_e >> (shift + _RADIX_BITS))[None]
    digit_te = ((key_te >> shift) & jnp.uint32(radix - 1)).astype(jnp.int32)
    flat = jnp.where(match_te, col_te * radix + digit_te, num_experts * radix).reshape(-1)
    hist_eb = jnp.bincount(flat, length=num_experts * radix + 1)[:-1].reshape(
        num_experts, radix).astype(jnp.int32)
    # at_or_above_eb[e, b]: matching values with digit >= b, plus those above the prefix.
    at_or_above_eb = jnp.cumsum(hist_eb[:, ::-1], axis=1)[:, ::-1] + above_e[:, None]
    digit_e = jnp.sum(at_or_above_eb >= count, axis=1) - 1   # the largest digit reaching count
    above_e = above_e + jnp.sum(jnp.where(
        jnp.arange(radix)[None, :] > digit_e[:, None], hist_eb, 0), axis=1)
    prefix_e = prefix_e | (digit_e.astype(jnp.uint32) << shift)
  return _float_of_keys(prefix_e)


def column_threshold_histogram(v_te: jax.Array, count: int | jax.Array, num_bins: int,
                               valid_t: jax.Array | None = None) -> jax.Array:
  """Approximate `column_threshold_exact` from a histogram of each column.

  Each column gets `num_bins` equal bins over its own [min, max]. The bin that
  holds the `count`-th largest value is found from counts taken from the top,
  and the threshold is interpolated linearly inside that bin, so it lies
  within one bin width, (max_e - min_e) / num_bins, of the exact one.

  Args:
    v_te: [T, E] values.
    count: int in [1, T], static or a traced int32 scalar.
    num_bins: static int >= 2.
    valid_t: [T] bool or None: only the True rows count, in the range and
      the bins alike.

  Returns:
    q_e: [E] float32.
  """
  _check(v_te, count)
  num_tokens, num_experts = v_te.shape
  v_te = v_te.astype(jnp.float32)
  if valid_t is None:
    lo_e = jnp.min(v_te, axis=0)
    hi_e = jnp.max(v_te, axis=0)
  else:
    lo_e = jnp.min(jnp.where(valid_t[:, None], v_te, jnp.inf), axis=0)
    hi_e = jnp.max(jnp.where(valid_t[:, None], v_te, -jnp.inf), axis=0)
  # A constant column gets a tiny positive width so binning stays finite.
  width_e = jnp.maximum((hi_e - lo_e) / num_bins, jnp.finfo(jnp.float32).tiny)
  bin_te = jnp.clip(
      jnp.floor((v_te - lo_e) / width_e).astype(jnp.int32), 0, num_bins - 1)
  flat = jnp.arange(num_experts, dtype=jnp.int32) * num_bins + bin_te
  if valid_t is not None:  # masked rows go to an id past the last bin, which is dropped
    flat = jnp.where(valid_t[:, None], flat, num_experts * num_bins)
  flat = flat.reshape(-1)
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


def column_threshold(v_te: jax.Array, count: int | jax.Array, *, impl: str, num_bins: int,
                     valid_t: jax.Array | None = None) -> jax.Array:
  """Dispatches to the exact or histogram threshold; see those for shapes.

  valid_t: [T] bool or None: the threshold of the True rows only, as if the
  others were absent (count, at most their number, may then be traced).
  """
  if impl == "histogram":
    return column_threshold_histogram(v_te, count, num_bins, valid_t)
  if valid_t is not None:  # masked rows sink below every counted value
    v_te = jnp.where(valid_t[:, None], v_te.astype(jnp.float32), -jnp.inf)
  if impl == "exact":
    return column_threshold_exact(v_te, count)
  if impl == "radix":
    return column_threshold_radix(v_te, count)
  raise ValueError(f"quantile impl={impl!r}; allowed: ('exact', 'radix', 'histogram')")


def _check(v_te, count):
  if v_te.ndim != 2:
    raise ValueError(f"expected values of shape [T, E], got {v_te.shape}")
  if not isinstance(count, jax.Array) and not 1 <= count <= v_te.shape[0]:
    raise ValueError(f"count={count} must lie in [1, T={v_te.shape[0]}]")
