"""Log-decay gates for KDA / Gated DeltaNet layers.

* bounded (default): g = lower_bound * sigmoid(z), so g in (lower_bound, 0)
  (`KdaSpec.lower_bound`, the model's `kda.lower_bound`). The bound
  keeps intra-tile decay ratios inside the float range, which lets every
  causal tile run as a dense matmul (docs/design.md, "Why the bound matters").
* softplus (baseline): g = -exp(A_log) * softplus(z + dt_bias), unbounded
  below; needs the pairwise diagonal path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda.spec import KdaSpec

GATES = ("bounded", "softplus")


def bounded_gate(z: jax.Array, spec: KdaSpec) -> jax.Array:
  """g = lower_bound * sigmoid(z) in float32, with the bound of `spec` (a bounded spec).

  Args:
    z: [..., K] (or [...] for a scalar gate) pre-activations, any float dtype.
    spec: a KdaSpec with a lower bound (KdaSpec checked that it is negative).

  Returns:
    float32 log-decay of z's shape, in (lower_bound, 0).
  """
  if not spec.bounded:
    raise ValueError(f"the bounded gate needs a spec with a lower_bound, got {spec}")
  return spec.gate(z)


def bounded_gate_preactivation(g: np.ndarray, spec: KdaSpec) -> np.ndarray:
  """z with bounded_gate(z, spec) = g (numpy), g clipped to 1e-6 of either end of the range."""
  return spec.gate_preactivation(g)


def softplus_gate(z: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
  """g = -exp(A_log) * softplus(z + dt_bias) in float32 (unbounded below).

  Args:
    z: [..., D] pre-activations.
    a_log: [D] (or broadcastable) log decay rate.
    dt_bias: [D] (or broadcastable) bias inside the softplus.
  """
  z32 = z.astype(jnp.float32)
  return -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(z32 + dt_bias.astype(jnp.float32))
