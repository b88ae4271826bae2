"""Dense SwiGLU feed-forward block (the optional dense first layer, and the
stand-in FFN when a model has no experts)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.params import fan_in_init, logical_param


class SwiGLU(nnx.Module):
  """y = (silu(x W_gate) * (x W_up)) W_down.

  Args:
    d_model: input/output width.
    hidden: inner width.
    dtype: compute dtype of the matmuls.
    param_dtype: parameter dtype.
  """

  def __init__(self, d_model: int, hidden: int, *, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if d_model <= 0 or hidden <= 0:
      raise ValueError(f"SwiGLU needs positive widths, got d_model={d_model}, hidden={hidden}")
    self.dtype = dtype
    self.w_gate = logical_param(rngs, fan_in_init(d_model), (d_model, hidden), ("embed", "mlp"), param_dtype)
    self.w_up = logical_param(rngs, fan_in_init(d_model), (d_model, hidden), ("embed", "mlp"), param_dtype)
    self.w_down = logical_param(rngs, fan_in_init(hidden), (hidden, d_model), ("mlp", "embed"), param_dtype)

  def __call__(self, x_btd: jax.Array) -> jax.Array:
    """x_btd: [..., D] -> [..., D] in the compute dtype."""
    x = x_btd.astype(self.dtype)
    gate = jnp.einsum("...d,dh->...h", x, self.w_gate[...].astype(self.dtype))
    up = jnp.einsum("...d,dh->...h", x, self.w_up[...].astype(self.dtype))
    h = jax.nn.silu(gate) * up
    return jnp.einsum("...h,hd->...d", h, self.w_down[...].astype(self.dtype))
