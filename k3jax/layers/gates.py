"""Log-decay gates for KDA / Gated DeltaNet layers.

* bounded (default): g = g_min * sigmoid(z), so g in (g_min, 0). The bound
  keeps intra-tile decay ratios inside the float range, which lets every
  causal tile run as a dense matmul (DESIGN.md, "Why the bound matters").
* softplus (baseline): g = -exp(A_log) * softplus(z + dt_bias), unbounded
  below; needs the pairwise diagonal path.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

GATES = ("bounded", "softplus")


def bounded_gate(z: jax.Array, g_min: float) -> jax.Array:
  """g = g_min * sigmoid(z) in float32.

  Args:
    z: [..., K] (or [...] for a scalar gate) pre-activations, any float dtype.
    g_min: negative lower bound.

  Returns:
    float32 log-decay of z's shape, in (g_min, 0).
  """
  if not g_min < 0:
    raise ValueError(f"g_min must be negative, got {g_min}")
  return g_min * jax.nn.sigmoid(z.astype(jnp.float32))


def softplus_gate(z: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
  """g = -exp(A_log) * softplus(z + dt_bias) in float32 (unbounded below).

  Args:
    z: [..., D] pre-activations.
    a_log: [D] (or broadcastable) log decay rate.
    dt_bias: [D] (or broadcastable) bias inside the softplus.
  """
  z32 = z.astype(jnp.float32)
  return -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(z32 + dt_bias.astype(jnp.float32))


class DecayGate(nnx.Module):
  """Maps pre-activations [..., D] to float32 log-decays [..., D].

  D is heads * K for a per-channel (KDA) gate or heads for a scalar (GDN)
  gate. `kind="bounded"` has no parameters; `kind="softplus"` learns A_log and
  dt_bias per channel (Mamba-style initialisation: decay rates spread over
  [1, 16], time steps over [1e-3, 1e-1]).
  """

  def __init__(self, features: int, *, kind: str = "bounded", g_min: float = -5.0,
               rngs: nnx.Rngs):
    if kind not in GATES:
      raise ValueError(f"gate kind must be one of {GATES}, got {kind!r}")
    self.kind = kind
    self.g_min = float(g_min)
    if kind == "bounded":
      bounded_gate(jnp.zeros(()), self.g_min)  # validates g_min early
      return
    key_a, key_dt = jax.random.split(rngs.params())
    a = jax.random.uniform(key_a, (features,), minval=1.0, maxval=16.0)
    dt = jnp.exp(jax.random.uniform(key_dt, (features,), minval=math.log(1e-3),
                                    maxval=math.log(1e-1)))
    self.a_log = nnx.Param(jnp.log(a))
    # Inverse softplus, so that softplus(dt_bias) = dt at z = 0.
    self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))

  def __call__(self, z: jax.Array) -> jax.Array:
    if self.kind == "bounded":
      return bounded_gate(z, self.g_min)
    return softplus_gate(z, self.a_log[...], self.dt_bias[...])

  @property
  def lower_bound(self) -> float | None:
    """g_min for the bounded gate (what chunk_kda's dense path needs), else None."""
    return self.g_min if self.kind == "bounded" else None
