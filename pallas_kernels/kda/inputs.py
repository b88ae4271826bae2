"""Every check and optional transform of `chunk_kda`'s inputs, shared by all implementations.

Errors name the argument, the shape or value received and what is allowed.
The tiling choices are checked once, by `spec.KdaSpec`.

Tensor arguments (`validate`): shapes and dtypes of q, k, v, g, beta, the
initial state and cu_seqlens.

Values (`check_inputs`):

* concrete (not traced) inputs: a NaN gate (or gate pre-activation), a gate
  above 0, a gate below `lower_bound` on the dense diagonal path, a beta
  outside [0, 1] or NaN, or a cu_seqlens that does not rise from 0 to T
  raise ValueError;
* traced inputs with `checked=True`: the same conditions become
  `jax.experimental.checkify` checks (the caller wraps its function in
  `checkify.checkify` and calls `err.throw()`);
* traced inputs by default: the dense path clamps g into [lower_bound, 0]
  (`kernel_cumsum.clamp_gates`) and cu_seqlens is made valid (`sanitize_cu_seqlens`), so
  every finite input has a defined output (a NaN gate or beta is not
  caught: it reaches every output of its chunk). The checks only say that the clamp is
  needed; the implementation applies it where it is free: in jnp, fused by
  XLA, on the xla path, and inside the gate-cumsum kernels on the pallas
  path (`kernel_cumsum.clamped_cumsum`), which read g anyway.

Optional transforms (`apply_gate`, `l2_normalize`, value groups); every
implementation gives them the same meaning:

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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

# The clamp's float-bound forms, kept here under their names (`KdaSpec.clamp` applies them).
from pallas_kernels.kda.kernel_cumsum import clamp_gates, out_of_range  # noqa: F401
from pallas_kernels.kda.spec import KdaSpec


# -- tensor arguments -------------------------------------------------------------

_FLOAT_INPUTS = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


@dataclasses.dataclass(frozen=True)
class KdaArgs:
  """Validated, normalised arguments.

  Attributes:
    scale: the python float multiplying q.
    g: [B, T, H, K] float32 (or float64) per-channel log-decay; a scalar GDN
      gate [B, T, H] is broadcast over K.
    num_states: N, rows of initial/final state (B, or #sequences with
      cu_seqlens).
  """
  scale: float
  g: jax.Array
  num_states: int


def _check_float(name, x):
  if not any(x.dtype == d for d in _FLOAT_INPUTS):
    raise TypeError(f"{name} must be a floating array (bf16/f16/f32/f64), got {x.dtype}")


def validate(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
             segment_ids=None) -> KdaArgs:
  """Checks shapes and dtypes; returns normalised arguments.

  Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] or [B, T, H];
  beta [B, T, H]; initial_state [N, H, K, V]; cu_seqlens [N + 1] (B == 1);
  segment_ids [B, T] int (not with cu_seqlens).
  """
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    _check_float(name, x)
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, H, K], got shape {q.shape}")
  b, t_len, h, dk = q.shape
  if k.shape != q.shape:
    raise ValueError(f"k must have q's shape {q.shape}, got {k.shape}")
  if v.ndim != 4 or v.shape[:3] != (b, t_len, h):
    raise ValueError(f"v must be [B, T, H, V] = [{b}, {t_len}, {h}, V], got {v.shape}")
  if beta.shape != (b, t_len, h):
    raise ValueError(f"beta must be [B, T, H] = {(b, t_len, h)}, got {beta.shape}")
  if g.shape == (b, t_len, h):
    g = jnp.broadcast_to(g[..., None], q.shape)  # GDN: one decay per head.
  elif g.shape != q.shape:
    raise ValueError(f"g must be [B, T, H, K] = {q.shape} (KDA) or [B, T, H] = "
                     f"{(b, t_len, h)} (GDN), got {g.shape}")
  g = g.astype(jnp.promote_types(g.dtype, jnp.float32))

  if segment_ids is not None:
    check_segment_ids(segment_ids, (b, t_len), cu_seqlens)
  if cu_seqlens is not None:
    if b != 1:
      raise ValueError(f"cu_seqlens needs packed input with B == 1, got B = {b}")
    if jnp.ndim(cu_seqlens) != 1 or jnp.shape(cu_seqlens)[0] < 2:
      raise ValueError(f"cu_seqlens must be [N + 1] with N >= 1, got shape {jnp.shape(cu_seqlens)}")
    if not isinstance(cu_seqlens, jax.core.Tracer):
      cu = jax.device_get(cu_seqlens)
      if cu[0] != 0 or cu[-1] != t_len or (cu[1:] < cu[:-1]).any():
        raise ValueError(f"cu_seqlens must rise from 0 to T = {t_len}, got {list(cu)}")
    num_states = jnp.shape(cu_seqlens)[0] - 1
  else:
    num_states = b
  if initial_state is not None:
    _check_float("initial_state", initial_state)
    want = (num_states, h, dk, v.shape[-1])
    if initial_state.shape != want:
      raise ValueError(f"initial_state must be [N, H, K, V] = {want}, got {initial_state.shape}")

  if scale is None:
    scale = dk ** -0.5
  return KdaArgs(scale=float(scale), g=g, num_states=num_states)


def check_segment_ids(segment_ids, shape, cu_seqlens) -> None:
  """segment_ids must be an int [B, T] array (q's B and T), without cu_seqlens."""
  if cu_seqlens is not None:
    raise ValueError("segment_ids and cu_seqlens both restart the state: pass one of them "
                     "(segment_ids [B, T] for documents in rows, cu_seqlens for one packed row)")
  if (jnp.shape(segment_ids) != tuple(shape)
      or not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer)):
    raise ValueError(f"segment_ids must be an int array [B, T] = {tuple(shape)}, got "
                     f"{jnp.result_type(segment_ids)}{tuple(jnp.shape(segment_ids))}")


# -- values: gates and cu_seqlens --------------------------------------------------

def _is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def check_gates(g: jax.Array, *, spec: KdaSpec, dense: bool, checked: bool = False) -> bool:
  """Checks the log-decays g and says whether the chunked forms must clamp them.

  Args:
    g: [B, T, H, K] or [B, T, H] log-decays; valid entries lie in
      [lower_bound, 0] (dense path) or (-inf, 0] (pairwise path, naive form).
    spec: the call's KdaSpec; its lower bound (if any) is the dense path's.
    dense: whether the call takes the dense diagonal path (where a gate below
      the bound overflows exp).
    checked: emit checkify checks for traced g.

  Returns:
    Whether g must be clamped into [lower_bound, 0] (`KdaSpec.clamp`): a
    traced g on the dense path, whose values no check has seen. A concrete
    g that passed the checks is in range already.
  """
  bounded = dense and spec.bounded
  check_not_nan("g", g, checked=checked)
  if not _is_traced(g):
    with jax.ensure_compile_time_eval():   # g may be a constant captured by a jit
      lowest, highest = (float(x) for x in jax.device_get((jnp.min(g), jnp.max(g))))
    if highest > 0:
      raise ValueError(f"g must be a log-decay <= 0 (the state would grow without bound); got "
                       f"max(g) = {highest:.4g}. Pass g = lower_bound * sigmoid(.) or "
                       "-softplus(.)")
    if bounded:
      spec.check_gate_min(lowest)
  elif checked:
    checkify.check(jnp.all(~(g > 0)), "g must be a log-decay <= 0; got max(g) = {}",
                   jnp.max(g))
    if bounded:
      spec.checkify_gate_min(g)
  return bounded and _is_traced(g)


def check_not_nan(name: str, x: jax.Array, *, checked: bool = False) -> None:
  """Raises on NaN entries of a concrete `x`; with `checked`, a checkify check for a traced one.

  The clamp of the dense path cannot stand in for this check: a NaN survives a clip.
  """
  if not _is_traced(x):
    with jax.ensure_compile_time_eval():
      count = int(jax.device_get(jnp.sum(jnp.isnan(x))))
    if count:
      raise ValueError(f"{name} has {count} NaN entries of {np.prod(np.shape(x))}: every "
                       "output of their chunks would be NaN. Find where they come from "
                       "upstream (jax.debug_nans, or checked=True under jit).")
  elif checked:
    checkify.check(~jnp.any(jnp.isnan(x)), f"{name} has {{}} NaN entries",
                   jnp.sum(jnp.isnan(x)))


def check_beta(beta: jax.Array, *, checked: bool = False) -> None:
  """Checks the write strengths: every entry in [0, 1] (so the delta rule's I - beta k k^T
  contracts a unit-norm k), none NaN. Concrete beta raises ValueError; a traced one is
  checked only with `checked` (checkify)."""
  if not _is_traced(beta):
    with jax.ensure_compile_time_eval():
      lowest, highest, nans = (float(x) for x in jax.device_get(
          (jnp.min(beta), jnp.max(beta), jnp.sum(jnp.isnan(beta)))))
    if nans or lowest < 0 or highest > 1:
      raise ValueError(f"beta must lie in [0, 1] (e.g. sigmoid(.)); got min {lowest:.4g}, "
                       f"max {highest:.4g}, {int(nans)} NaN")
  elif checked:
    beta32 = beta.astype(jnp.float32)
    checkify.check(jnp.all((beta32 >= 0) & (beta32 <= 1)),
                   "beta must lie in [0, 1]; got min {}, max {}", jnp.min(beta32),
                   jnp.max(beta32))


def check_cu_seqlens(cu_seqlens, total_len: int, *, checked: bool = False):
  """Checks packed-sequence boundaries and returns the ones to use.

  Args:
    cu_seqlens: [N + 1] int cumulative lengths (or None).
    total_len: T, the packed length.
    checked: emit checkify checks for a traced cu_seqlens.

  Returns:
    None, a concrete valid cu_seqlens unchanged, or a traced one made valid
    with `sanitize_cu_seqlens`.
  """
  if cu_seqlens is None:
    return None
  if not _is_traced(cu_seqlens):
    cu = np.asarray(jax.device_get(cu_seqlens))
    if cu.ndim == 1 and cu.size >= 2 and (cu[0] != 0 or cu[-1] != total_len
                                          or (cu[1:] < cu[:-1]).any()):
      raise ValueError(f"cu_seqlens must rise from 0 to T = {total_len} without falling, got "
                       f"{cu.tolist()}")
    return cu_seqlens
  if checked:
    cu = jnp.asarray(cu_seqlens)
    checkify.check(cu[0] == 0, "cu_seqlens must start at 0; got cu_seqlens[0] = {}", cu[0])
    checkify.check(cu[-1] == total_len,
                   f"cu_seqlens must end at T = {total_len}; got cu_seqlens[-1] = {{}}", cu[-1])
    checkify.check(jnp.all(cu[1:] >= cu[:-1]), "cu_seqlens must be non-decreasing; got {}", cu)
  return sanitize_cu_seqlens(cu_seqlens, total_len)


def sanitize_cu_seqlens(cu_seqlens: jax.Array, total_len: int) -> jax.Array:
  """A valid cu_seqlens [N + 1] int32 close to the given one.

  Entries are clipped into [0, T], replaced by their running maximum (so they
  never fall) and the ends pinned to 0 and T. A valid cu_seqlens is returned
  unchanged in value.
  """
  cu = jnp.clip(jnp.asarray(cu_seqlens, jnp.int32), 0, total_len)
  cu = jax.lax.cummax(cu.at[0].set(0))
  return cu.at[-1].set(total_len)


def check_inputs(g, cu_seqlens, *, spec, total_len: int, checked: bool = False):
  """`check_gates` and `check_cu_seqlens` for one `chunk_kda` call of `spec`.

  Returns:
    (clamp, cu_seqlens): whether the chunked form must clamp g into the
    spec's range (`check_gates`), and the cu_seqlens to pass on (a
    traced one made valid).
  """
  dense = spec.diagonal == "dense" and spec.implementation != "naive"
  clamp = check_gates(g, spec=spec, dense=dense, checked=checked)
  return clamp, check_cu_seqlens(cu_seqlens, total_len, checked=checked)


# -- optional transforms -----------------------------------------------------------

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


def gate_bias_or_zeros(gate_activation, g, gate_bias, bounded: bool):
  """Checks the fused-gate arguments; returns gate_bias as float32 of g.shape[2:].

  Args:
    gate_activation: one of GATE_ACTIVATIONS.
    g: [B, T, HV, K] or [B, T, HV] gate pre-activations.
    gate_bias: [HV, K] (resp. [HV]) or None (zeros).
    bounded: whether the call has a lower bound (`KdaSpec.bounded`); the fused gate needs one.
  """
  if gate_activation not in GATE_ACTIVATIONS:
    raise ValueError(f"gate_activation must be None or one of {GATE_ACTIVATIONS}, got "
                     f"{gate_activation!r}")
  if not bounded:
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


def apply_gate(gate_activation, g, gate_bias, spec):
  """The log-decay [B, T, HV(, K)] float32 of pre-activation g under `spec`'s bound (the jnp form)."""
  bias = gate_bias_or_zeros(gate_activation, g, gate_bias, spec.bounded)
  return spec.fused_gate(g, bias)


def check_without_gate(gate_activation, gate_bias) -> None:
  """gate_bias is only meaningful with a gate_activation."""
  if gate_activation is None and gate_bias is not None:
    raise ValueError("gate_bias is added to the pre-activation of a fused gate; pass "
                     "gate_activation='bounded_sigmoid' with it (or fold it into g)")
