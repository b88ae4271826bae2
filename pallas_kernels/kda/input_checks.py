"""Value checks of the gates and of cu_seqlens, and the safe defaults under jit.

Shapes and dtypes are checked by `validation`; this module looks at values:

* concrete (not traced) inputs: a gate above 0, a gate below `lower_bound`
  on the dense diagonal path, or a cu_seqlens that does not rise from 0 to T
  raise ValueError;
* traced inputs with `checked=True`: the same conditions become
  `jax.experimental.checkify` checks (the caller wraps its function in
  `checkify.checkify` and calls `err.throw()`);
* traced inputs by default: the dense path clamps g into [lower_bound, 0]
  (`clamp_gates`) and cu_seqlens is made valid (`sanitize_cu_seqlens`), so
  every input has a defined output. The checks only say that the clamp is
  needed; the implementation applies it where it is free: in jnp, fused by
  XLA, on the xla path, and inside the gate-cumsum kernels on the pallas
  path (`kernel_cumsum.clamped_cumsum`), which read g anyway.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


def _is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def clamp_gates(g: jax.Array, lower_bound: float) -> jax.Array:
  """g clamped into [lower_bound, 0]; any shape.

  Unlike `jnp.clip`, the gradient is 1 on the closed interval (a gate exactly
  at the bound keeps its full gradient) and 0 outside it.
  """
  g = jnp.where(g < lower_bound, jnp.asarray(lower_bound, g.dtype), g)
  return jnp.where(g > 0, jnp.zeros((), g.dtype), g)


def out_of_range(g: jax.Array, lower_bound: float) -> jax.Array:
  """Where `clamp_gates` changes g and passes no gradient: g < lower_bound or g > 0."""
  return (g < lower_bound) | (g > 0)


def check_gates(g: jax.Array, *, lower_bound: float | None, dense: bool,
                checked: bool = False) -> bool:
  """Checks the log-decays g and says whether the chunked forms must clamp them.

  Args:
    g: [B, T, H, K] or [B, T, H] log-decays; valid entries lie in
      [lower_bound, 0] (dense path) or (-inf, 0] (pairwise path, naive form).
    lower_bound: the dense path's g_min, or None.
    dense: whether the call takes the dense diagonal path (where a gate below
      the bound overflows exp).
    checked: emit checkify checks for traced g.

  Returns:
    Whether g must be clamped into [lower_bound, 0] (`clamp_gates`): a
    traced g on the dense path, whose values no check has seen. A concrete
    g that passed the checks is in range already.
  """
  bounded = dense and lower_bound is not None
  if not _is_traced(g):
    with jax.ensure_compile_time_eval():   # g may be a constant captured by a jit
      g_min, g_max = (float(x) for x in jax.device_get((jnp.min(g), jnp.max(g))))
    if g_max > 0:
      raise ValueError(f"g must be a log-decay <= 0 (the state would grow without bound); got "
                       f"max(g) = {g_max:.4g}. Pass g = lower_bound * sigmoid(.) or "
                       "-softplus(.)")
    if bounded and g_min < lower_bound:
      raise ValueError(f"g must be >= lower_bound = {lower_bound} on diagonal='dense' (exp "
                       f"overflows below it); got min(g) = {g_min:.4g}. Pass g = lower_bound * "
                       "sigmoid(.), a lower_bound <= min(g), or diagonal='pairwise'")
  elif checked:
    checkify.check(jnp.all(~(g > 0)), "g must be a log-decay <= 0; got max(g) = {}",
                   jnp.max(g))
    if bounded:
      checkify.check(jnp.all(~(g < lower_bound)),
                     f"g must be >= lower_bound = {lower_bound} on diagonal='dense'; "
                     "got min(g) = {}", jnp.min(g))
  return bounded and _is_traced(g)


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
    (clamp, cu_seqlens): whether the chunked form must clamp g into
    [spec.lower_bound, 0] (`check_gates`), and the cu_seqlens to pass on (a
    traced one made valid).
  """
  dense = spec.diagonal == "dense" and spec.implementation != "naive"
  clamp = check_gates(g, lower_bound=spec.lower_bound, dense=dense, checked=checked)
  return clamp, check_cu_seqlens(cu_seqlens, total_len, checked=checked)
