"""Optional input transforms of `chunk_kda`: fused gate, q/k L2 norm, grouped value heads.

Every implementation gives them the same meaning:

* gate_activation="bounded_sigmoid": g is the gate's pre-activation and the
  log-decay is g_min * sigmoid(g + gate_bias) (g_min = the spec's
  lower_bound), formed in float32. The Pallas path forms it inside the gate
  cumsum kernel and its derivative inside the reverse one
  (`kernel_gate_cumsum`); `xla`, `naive` and the TPU lowering apply it in jnp.
* qk_l2norm=True: q and k are normalised over K, x * rsqrt(sum x^2 + eps)
  with eps = QK_L2NORM_EPS, in float32 math, then cast back to the input
  dtype. This runs as an XLA fusion ahead of every implementation (the
  normalised q/k are materialised in the input dtype, never in float32 unless
  the inputs are); its backward is the autodiff of that fusion.
* Grouped value heads: v [B, T, HV, V] with HV = G * H; g [B, T, HV, K] (or
  [B, T, HV]), beta [B, T, HV], states [N, HV, K, V]. Value head j reads q/k
  head j // G (consecutive value heads share a q/k head). The heads are
  expanded by repeating q and k G times before the kernels, and autodiff adds
  the G copies' gradients: q/k traffic and the q/k-dependent intra-chunk
  work grow G-fold, as with HV independent heads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda import kernel_gate_cumsum

GATE_ACTIVATIONS = ("bounded_sigmoid",)
# Added to sum(x^2) before the rsqrt; keeps an all-zero row finite (it stays zero).
QK_L2NORM_EPS = 1e-6


def l2_normalize(x_bthk: jax.Array, eps: float = QK_L2NORM_EPS) -> jax.Array:
  """x / sqrt(sum_k x^2 + eps) over the last axis in float32, returned in x's dtype."""
  x32 = x_bthk.astype(jnp.promote_types(x_bthk.dtype, jnp.float32))
  inv = jax.lax.rsqrt(jnp.sum(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (x32 * inv).astype(x_bthk.dtype)


def value_groups(q, v) -> int:
  """G = HV / H for q [B, T, H, K] and v [B, T, HV, V]; raises unless H divides HV."""
  if q.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q and v must be rank 4 ([B, T, H, K], [B, T, HV, V]), got shapes "
                     f"{q.shape} and {v.shape}")
  h, hv = q.shape[2], v.shape[2]
  if hv < h or hv % h:
    raise ValueError(f"v's head count HV={hv} must be a multiple of q/k's H={h} (grouped value "
                     f"heads: HV = G * H); got v shape {v.shape}, q shape {q.shape}")
  return hv // h


def expand_value_groups(x_bthk: jax.Array, groups: int) -> jax.Array:
  """[B, T, H, K] -> [B, T, G*H, K]: head j of the result is head j // G of x."""
  return x_bthk if groups == 1 else jnp.repeat(x_bthk, groups, axis=2)


def gate_bias_or_zeros(gate_activation, g, gate_bias, lower_bound):
  """Checks the fused-gate arguments; returns gate_bias as float32 of g.shape[2:].

  Args:
    gate_activation: one of GATE_ACTIVATIONS.
    g: [B, T, HV, K] or [B, T, HV] gate pre-activations.
    gate_bias: [HV, K] (resp. [HV]) or None (zeros).
    lower_bound: the spec's lower_bound, the gate's g_min.
  """
  if gate_activation not in GATE_ACTIVATIONS:
    raise ValueError(f"gate_activation must be None or one of {GATE_ACTIVATIONS}, got "
                     f"{gate_activation!r}")
  if lower_bound is None:
    raise ValueError("gate_activation='bounded_sigmoid' computes g = lower_bound * "
                     "sigmoid(g + gate_bias); pass lower_bound (the gate's g_min < 0) "
                     "or a spec with one")
  want = tuple(g.shape[2:])
  if gate_bias is None:
    return jnp.zeros(want, jnp.float32)
  if tuple(gate_bias.shape) != want:
    raise ValueError(f"gate_bias must have the gate's per-head shape {want} (g is {g.shape}), "
                     f"got {gate_bias.shape}")
  return gate_bias.astype(jnp.float32)


def apply_gate(gate_activation, g, gate_bias, lower_bound):
  """The log-decay [B, T, HV(, K)] float32 of pre-activation g (the jnp form)."""
  bias = gate_bias_or_zeros(gate_activation, g, gate_bias, lower_bound)
  return kernel_gate_cumsum.bounded_sigmoid(g, bias, float(lower_bound))


def check_without_gate(gate_activation, gate_bias) -> None:
  """gate_bias is only meaningful with a gate_activation."""
  if gate_activation is None and gate_bias is not None:
    raise ValueError("gate_bias is added to the pre-activation of a fused gate; pass "
                     "gate_activation='bounded_sigmoid' with it (or fold it into g)")
