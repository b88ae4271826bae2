"""Value checks of gates and cu_seqlens, the checkify mode, and the safe defaults under jit.

The shape of the issue report: B1 T40 H2 K16, lower_bound -5.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from pallas_kernels.kda import api
from pallas_kernels.kda import inputs
from pallas_kernels.kda import reference
from tests.kda_inputs import make_inputs, rel_err

LOWER_BOUND = -5.0
TOL = 2e-5
GPU_TOL = 2e-4   # f32 through 3xTF32 matmuls (tests/test_kda_pallas.py)
CHUNKED = {"xla": dict(implementation="xla"),
           "pallas": dict(implementation="pallas", interpret=True),
           "pallas_gpu": dict(implementation="pallas")}
# The GPU twin of the interpret-mode checks of the Pallas path.
IMPLS = ["xla", "pallas", pytest.param("pallas_gpu", marks=pytest.mark.gpu)]


def _inputs(seed=31):
  return make_inputs(seed, batch=1, seq_len=40, heads=2, dk=16, dv=16, gate="mixed")


def _bad_gates(g, kind):
  """g with a few entries out of range: below the bound or positive."""
  value = {"low": 4 * LOWER_BOUND, "positive": 0.5}[kind]
  return g.at[0, 3, 0, :5].set(value).at[0, 37, 1, 2].set(value)


def _fn(impl, **kw):
  return functools.partial(api.chunk_kda, chunk_size=16, lower_bound=LOWER_BOUND,
                           **CHUNKED.get(impl, dict(implementation=impl)), **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["low", "positive"])
def test_concrete_bad_gates_raise(impl, kind):
  x = _inputs()
  with pytest.raises(ValueError, match="lower_bound = -5.0" if kind == "low" else "<= 0"):
    _fn(impl)(x.q, x.k, x.v, _bad_gates(x.g, kind), x.beta)


def test_naive_rejects_positive_gates_only():
  x = _inputs()
  with pytest.raises(ValueError, match="log-decay <= 0"):
    _fn("naive")(x.q, x.k, x.v, _bad_gates(x.g, "positive"), x.beta)
  o, _ = _fn("naive")(x.q, x.k, x.v, _bad_gates(x.g, "low"), x.beta)  # no dense tile: finite
  assert np.all(np.isfinite(np.asarray(o)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["low", "positive"])
def test_traced_bad_gates_are_clamped(impl, kind):
  """Under jit the dense path equals the naive form on clamped gates, VJP included."""
  x = _inputs(32)
  g_bad = _bad_gates(x.g, kind)
  do = jax.random.normal(jax.random.key(33), x.v.shape)

  def run(fn, xs):
    o, vjp = jax.vjp(lambda *a: fn(*a)[0], *xs)
    return o, vjp(do)
  naive_clamped = lambda q, k, v, g, beta: reference.naive_recurrent_kda(
      q, k, v, inputs.clamp_gates(g, LOWER_BOUND), beta)
  xs = (x.q, x.k, x.v, g_bad, x.beta)
  o, grads = jax.jit(functools.partial(run, _fn(impl)))(xs)
  o_r, grads_r = jax.jit(functools.partial(run, naive_clamped))(xs)
  assert np.all(np.isfinite(np.asarray(o)))
  tol = GPU_TOL if impl == "pallas_gpu" else TOL
  assert rel_err(o, o_r, jnp.float32) < tol
  for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, grads_r):
    assert rel_err(a, r, jnp.float32) < tol, name
  # Out-of-range entries get no gradient; in-range ones keep theirs.
  dg = np.asarray(grads[3])
  assert np.all(dg[0, 3, 0, :5] == 0) and np.any(dg[0, 4] != 0)


def test_clamp_keeps_gradient_at_the_bound():
  g = jnp.asarray([LOWER_BOUND - 1.0, LOWER_BOUND, -1.0, 0.0, 0.5])
  np.testing.assert_array_equal(np.asarray(inputs.clamp_gates(g, LOWER_BOUND)),
                                [LOWER_BOUND, LOWER_BOUND, -1.0, 0.0, 0.0])
  grad = jax.grad(lambda g: jnp.sum(inputs.clamp_gates(g, LOWER_BOUND)))(g)
  np.testing.assert_array_equal(np.asarray(grad), [0.0, 1.0, 1.0, 1.0, 0.0])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["low", "positive"])
def test_checked_mode_raises_under_jit(impl, kind):
  x = _inputs(34)
  fn = checkify.checkify(jax.jit(lambda g: _fn(impl, checked=True)(x.q, x.k, x.v, g, x.beta)[0]))
  err, _ = fn(_bad_gates(x.g, kind))
  with pytest.raises(checkify.JaxRuntimeError, match="lower_bound" if kind == "low" else "<= 0"):
    err.throw()
  err, o = fn(x.g)
  err.throw()   # valid gates pass
  assert np.all(np.isfinite(np.asarray(o)))


def test_checked_mode_needs_checkify():
  x = _inputs(35)
  with pytest.raises(ValueError, match="checkify"):
    jax.jit(lambda g: _fn("xla", checked=True)(x.q, x.k, x.v, g, x.beta)[0])(x.g)


BAD_CU = {"falls": [0, 30, 10, 40], "short": [0, 10, 30], "late_start": [3, 10, 40]}


@pytest.mark.parametrize("impl", [*IMPLS, "naive"])
@pytest.mark.parametrize("name", sorted(BAD_CU))
def test_bad_cu_seqlens(impl, name):
  """Concrete: ValueError; checked under jit: checkify error; default under jit: the sanitized one."""
  x = _inputs(36)
  cu = jnp.asarray(BAD_CU[name], jnp.int32)
  with pytest.raises(ValueError, match="cu_seqlens must rise"):
    _fn(impl, cu_seqlens=cu)(*x.args())
  checked = checkify.checkify(jax.jit(lambda c: _fn(impl, cu_seqlens=c, checked=True)(
      *x.args())[0]))
  err, _ = checked(cu)
  with pytest.raises(checkify.JaxRuntimeError, match="cu_seqlens must"):
    err.throw()
  o = jax.jit(lambda c: _fn(impl, cu_seqlens=c)(*x.args())[0])(cu)
  fixed = np.asarray(inputs.sanitize_cu_seqlens(cu, 40))
  assert fixed[0] == 0 and fixed[-1] == 40 and np.all(np.diff(fixed) >= 0)
  o_r, _ = reference.naive_recurrent_kda(*x.args(), cu_seqlens=jnp.asarray(fixed))
  assert rel_err(o, o_r, jnp.float32) < (GPU_TOL if impl == "pallas_gpu" else TOL)


def test_sanitize_keeps_valid_cu_seqlens():
  cu = jnp.asarray([0, 0, 7, 40], jnp.int32)
  np.testing.assert_array_equal(np.asarray(inputs.sanitize_cu_seqlens(cu, 40)),
                                np.asarray(cu))


def _nan_gates(g):
  return g.at[0, 5, 1, 3].set(jnp.nan)


BAD_BETA = {"above_one": 5.0, "negative": -0.5, "nan": jnp.nan}


@pytest.mark.parametrize("impl", ["xla", "pallas", "naive"])
def test_concrete_nan_gates_raise(impl):
  x = _inputs(37)
  with pytest.raises(ValueError, match="g has 1 NaN entries"):
    _fn(impl)(x.q, x.k, x.v, _nan_gates(x.g), x.beta)


def test_concrete_nan_gate_preactivation_raises():
  x = _inputs(38)
  with pytest.raises(ValueError, match="pre-activation\\) has 1 NaN"):
    _fn("xla", gate_activation="bounded_sigmoid")(x.q, x.k, x.v, _nan_gates(x.g), x.beta)


@pytest.mark.parametrize("impl", ["xla", "naive"])
@pytest.mark.parametrize("name", sorted(BAD_BETA))
def test_concrete_bad_beta_raises(impl, name):
  x = _inputs(39)
  beta = x.beta.at[0, 7, 0].set(BAD_BETA[name])
  with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\]"):
    _fn(impl)(x.q, x.k, x.v, x.g, beta)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_checked_mode_catches_nan_gates_and_bad_beta(impl):
  """Under jit with checked=True both raise through checkify; unchecked, the NaN spreads."""
  x = _inputs(40)
  run = lambda g, beta: _fn(impl, checked=True)(x.q, x.k, x.v, g, beta)[0]
  fn = checkify.checkify(jax.jit(run))
  err, _ = fn(_nan_gates(x.g), x.beta)
  with pytest.raises(checkify.JaxRuntimeError, match="NaN entries"):
    err.throw()
  err, _ = fn(x.g, x.beta.at[0, 7, 0].set(5.0))
  with pytest.raises(checkify.JaxRuntimeError, match=r"beta must lie in \[0, 1\]"):
    err.throw()
  err, o = fn(x.g, x.beta)
  err.throw()
  assert np.all(np.isfinite(np.asarray(o)))
  o_unchecked = jax.jit(lambda g: _fn(impl)(x.q, x.k, x.v, g, x.beta)[0])(_nan_gates(x.g))
  assert np.isnan(np.asarray(o_unchecked)).any()  # what the docstring says of unchecked calls
