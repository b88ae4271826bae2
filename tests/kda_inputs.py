"""Fresh random KDA inputs and dtype-keyed tolerances shared by the KDA tests."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# Relative tolerance per compute dtype for ||a - b|| / ||b|| (relative L2) of
# two exact-arithmetic-equivalent forms. Reductions grow with T; the factor
# below scales by sqrt of the number of chunks crossed.
RTOL = {jnp.dtype(jnp.float64): 1e-11, jnp.dtype(jnp.float32): 2e-5,
        jnp.dtype(jnp.bfloat16): 1e-2}


def rtol_for(dtype, seq_len: int, chunk: int = 64) -> float:
  return RTOL[jnp.dtype(dtype)] * max(1.0, (seq_len / chunk) ** 0.5)


_STATIC = ("scale", "output_final_state", "chunk_size", "lower_bound", "diagonal",
           "sub_chunk", "implementation", "interpret")


def jitted(fn):
  """`fn` under jit with the KDA configuration arguments static.

  Tests call the references through this: one compilation per shape instead
  of op-by-op dispatch, which keeps the CPU suite fast.
  """
  return functools.wraps(fn)(jax.jit(fn, static_argnames=[
      n for n in _STATIC if n in fn.__code__.co_varnames[:fn.__code__.co_argcount
                                                         + fn.__code__.co_kwonlyargcount]]))


@dataclasses.dataclass
class KdaInputs:
  q: jax.Array
  k: jax.Array
  v: jax.Array
  g: jax.Array
  beta: jax.Array
  h0: jax.Array

  def args(self):
    return self.q, self.k, self.v, self.g, self.beta


def make_inputs(seed: int, *, batch=2, seq_len=65, heads=2, dk=16, dv=8, g_min=-5.0,
                scalar_gate=False, gate="near", dtype=jnp.float32, num_states=None) -> KdaInputs:
  """Unit-norm q/k, gates g = g_min * sigmoid(N(0,1)) ("near"), g == g_min
  ("at"), or a mix of both ("mixed"); beta in (0, 1); a random initial state."""
  keys = jax.random.split(jax.random.key(seed), 7)
  shape = (batch, seq_len, heads, dk)

  def unit(key):
    x = jax.random.normal(key, shape, jnp.float32)
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

  gshape = (batch, seq_len, heads) if scalar_gate else shape
  near = g_min * jax.nn.sigmoid(jax.random.normal(keys[3], gshape))
  if gate == "near":
    g = near
  elif gate == "at":
    g = jnp.full(gshape, g_min)
  else:
    g = jnp.where(jax.random.bernoulli(keys[6], 0.5, gshape), g_min, near)
  n = batch if num_states is None else num_states
  cast = lambda x: x.astype(dtype)
  return KdaInputs(
      q=cast(unit(keys[0])), k=cast(unit(keys[1])),
      v=cast(jax.random.normal(keys[2], (batch, seq_len, heads, dv))),
      g=g.astype(jnp.promote_types(dtype, jnp.float32)),
      beta=cast(jax.nn.sigmoid(jax.random.normal(keys[4], (batch, seq_len, heads)))),
      h0=jax.random.normal(keys[5], (n, heads, dk, dv)).astype(jnp.promote_types(dtype, jnp.float32)))


def rel_l2(actual, expected) -> float:
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def assert_close(actual, expected, tol, what=""):
  err = rel_l2(actual, expected)
  assert np.all(np.isfinite(np.asarray(actual, np.float64))), f"{what}: non-finite values"
  assert err <= tol, f"{what}: relative L2 error {err:.3e} > {tol:.1e}"
  return err
