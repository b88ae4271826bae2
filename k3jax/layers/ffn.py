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
    return swiglu(x_btd, self.w_gate[...], self.w_up[...], self.w_down[...], self.dtype)


def swiglu(x_nd: jax.Array, w_gate_dh: jax.Array, w_up_dh: jax.Array, w_down_hd: jax.Array,
           dtype) -> jax.Array:
  """(silu(x W_gate) * (x W_up)) W_down, [..., d] -> [..., d] in `dtype`.

  The gate and up projections run as one product against [d, 2h] weights (a
  wider matmul uses the tensor cores better, forward and backward).
  Products take and write the compute dtype (tensor cores accumulate in
  float32), so the backward's products stay in it; silu * up is float32.
  """
  hidden = w_gate_dh.shape[1]
  w_in = jnp.concatenate([w_gate_dh, w_up_dh], axis=1).astype(dtype)
  gate_up = jnp.einsum("...d,dh->...h", x_nd.astype(dtype), w_in, preferred_element_type=dtype)
  h = silu_mul(gate_up[..., :hidden], gate_up[..., hidden:], dtype)
  return jnp.einsum("...h,hd->...d", h, w_down_hd.astype(dtype), preferred_element_type=dtype)


def silu_mul(gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
  """silu(gate) * up in float32, rounded to `dtype`."""
  return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)
