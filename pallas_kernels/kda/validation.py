"""Tensor argument checks shared by every KDA implementation.

Errors name the argument, the shape or value received and what is allowed.
The tiling choices are checked once, by `spec.KdaSpec`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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


def validate(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None) -> KdaArgs:
  """Checks shapes and dtypes; returns normalised arguments.

  Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] or [B, T, H];
  beta [B, T, H]; initial_state [N, H, K, V]; cu_seqlens [N + 1] (B == 1).
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
