"""RMS normalisation: a functional form and a learned-scale NNX module.

Statistics are always computed in float32; the result is cast back to the
input dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.params import logical_param


def rms_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """Parameter-free RMS norm over the last axis. x: [..., D] -> [..., D]."""
  x32 = x.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (x32 * inv).astype(x.dtype)


def l2_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """Unit-L2 normalisation over the last axis, float32 math. x: [..., K]."""
  x32 = x.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.sum(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (x32 * inv).astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMS norm over the last axis with a learned per-channel scale (init 1).

  Args:
    dim: size of the normalised (last) axis.
    axis_name: logical axis name of the scale parameter.
    eps: variance epsilon.
    param_dtype: dtype of the scale.
  """

  def __init__(self, dim: int, *, axis_name: str | None = "embed", eps: float = 1e-6,
               param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    del rngs  # constant initialisation
    self.dim = dim
    self.eps = eps
    self.scale = logical_param(None, jax.nn.initializers.ones, (dim,), (axis_name,), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [..., dim] -> [..., dim] in x's dtype."""
    if x.shape[-1] != self.dim:
      raise ValueError(f"RMSNorm expects last dim {self.dim}, got shape {x.shape}")
    y = rms_norm(x.astype(jnp.float32), self.eps) * self.scale[...].astype(jnp.float32)
    return y.astype(x.dtype)
