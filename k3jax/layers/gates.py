"""Log-decay gates for KDA / Gated DeltaNet layers.

* bounded (default): g = lower_bound * sigmoid(z), so g in (lower_bound, 0)
  (`KdaSpec.lower_bound`, the model's g_min). The bound
  keeps intra-tile decay ratios inside the float range, which lets every
  causal tile run as a dense matmul (docs/design.md, "Why the bound matters").
* softplus (baseline): g = -exp(A_log) * softplus(z + dt_bias), unbounded
  below; needs the pairwise diagonal path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

GATES = ("bounded", "softplus")


def bounded_gate(z: jax.Array, lower_bound: float) -> jax.Array:
  """g = lower_bound * sigmoid(z) in float32.

  Args:
    z: [..., K] (or [...] for a scalar gate) pre-activations, any float dtype.
    lower_bound: negative lower bound.

  Returns:
    float32 log-decay of z's shape, in (lower_bound, 0).
  """
  if not lower_bound < 0:
    raise ValueError(f"lower_bound must be negative, got {lower_bound}")
  return lower_bound * jax.nn.sigmoid(z.astype(jnp.float32))


def softplus_gate(z: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
  """g = -exp(A_log) * softplus(z + dt_bias) in float32 (unbounded below).

  Args:
    z: [..., D] pre-activations.
    a_log: [D] (or broadcastable) log decay rate.
    dt_bias: [D] (or broadcastable) bias inside the softplus.
  """
  z32 = z.astype(jnp.float32)
  return -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(z32 + dt_bias.astype(jnp.float32))
