"""KDA Pallas backward: the body choice and the saved forward residuals.

The whole VJP (both residual modes) is checked against the float32 naive
recurrence with four row tiles per chunk (C = 32, L = 8: the one-program
"tiles" body, as on the GPU at L < 16), and the dtypes the residuals travel
in are read off the traced program. Interpret mode fills kernel outputs with
NaN first, so an unwritten block fails.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import kernel_common
from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import reference
from pallas_kernels.kda.pallas_op import chunk_kda_pallas
from tests.kda_inputs import (GRAD_NAMES, assert_each_within, pallas_spec, state_loss_grads,
                              vjp_inputs)

# max|x - ref| / max|ref|, float32 operands, exact (HIGHEST) matmuls on the CPU.
F32_TOL = 2e-5


def test_intra_bwd_body_choice():
  """The heuristic picks "split" on the GPU (and interpret mode) at L >= 16,
  else "tiles"; explicit choices are checked against the backend."""
  cfg = lambda backend, sub_chunk=16, **kw: kernel_config.make_config(
      backend=backend, dtype=jnp.bfloat16, head_k=128, head_v=128, chunk_size=64,
      sub_chunk=sub_chunk, overrides=kw or None)
  assert cfg("triton").intra_bwd == "split"
  assert cfg("interpret").intra_bwd == "split"
  assert cfg("triton", 8).intra_bwd == "tiles"      # split needs L >= 16 on Triton
  assert cfg("interpret", 8).intra_bwd == "tiles"
  assert cfg("tpu").intra_bwd == "tiles"
  assert cfg("tpu_interpret").intra_bwd == "tiles"
  assert cfg("triton", intra_bwd="tiles").intra_bwd == "tiles"
  assert cfg("interpret", 8, intra_bwd="split").intra_bwd == "split"
  with pytest.raises(ValueError, match="sub_chunk >= 16"):
    cfg("triton", 8, intra_bwd="split")
  for backend in ("tpu", "tpu_interpret"):
    with pytest.raises(ValueError, match="not lowered for TPU"):
      cfg(backend, intra_bwd="split")
  with pytest.raises(ValueError, match="intra_bwd must be one of"):
    cfg("interpret", intra_bwd="rows")


def test_vjp_saved_and_recomputed_residuals_match_naive():
  """All six gradients vs the naive recurrence, with and without saved residuals.

  Per-channel gates spread over (g_min, 0), T = 40 (not a multiple of C = 32),
  four row tiles of L = 8 (the one-program "tiles" body, the GPU's at
  L < 16), an initial state and a final-state cotangent. (Gates at the bound
  put e^35 factors on the diagonal tiles; there dg is 2.2e-5 from the f32
  recurrence with both kept bodies, just over this bound, a matter of f32
  summation order: `test_kda_bwd_split.test_split_vjp_matches_naive` checks
  the bound at other shapes.) Both residual modes run the same kernels on the
  same operands, so their gradients must agree bit for bit.
  """
  dk = 16
  xs, do, dht = vjp_inputs(1, b=1, t=40, h=1, dk=dk, dv=16, gates="spread")
  grads = lambda fn: state_loss_grads(fn, xs, do, dht)
  want = grads(functools.partial(reference.naive_recurrent_kda, scale=dk ** -0.5))
  got = {}
  for save in (True, False):
    got[save] = grads(functools.partial(
        chunk_kda_pallas, spec=pallas_spec(chunk_size=32, sub_chunk=8), scale=dk ** -0.5,
        interpret=True, config_overrides=dict(save_residuals=save)))
    assert_each_within(got[save], want, GRAD_NAMES, F32_TOL, label=f"save_residuals={save}")
  for a, r in zip(got[True], got[False]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(r))



def _pallas_call_inputs(jaxpr, name, side="invars"):
  """Input (or, side="outvars", output) dtypes of the pallas_call `name`
  anywhere in `jaxpr` (nested jaxprs too)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call" and eqn.params["name"] == name:
      return [str(v.aval.dtype) for v in getattr(eqn, side)]
    for p in eqn.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          found = _pallas_call_inputs(sub, name, side)
          if found:
            return found
  return None


@pytest.mark.parametrize("operand_dtype,want", [(jnp.float32, "float32"),
                                                (jnp.bfloat16, "bfloat16")])
def test_saved_state_dtype_reaches_intra_bwd(operand_dtype, want):
  """The saved M, entry states and V', and dS, reach intra_bwd in
  cfg.saved_state_dtype (the intra backward's operand dtype).

  Checked on the traced program: on the CPU, XLA's excess-precision rewrite
  may drop an f32 -> bf16 -> f32 round trip inside one interpreted program,
  so the rounding itself is only observable on the GPU, where the residuals
  are stored to memory between kernels.
  """
  x = jnp.ones((1, 40, 1, 16), jnp.bfloat16)
  fn = functools.partial(chunk_kda_pallas, spec=pallas_spec(chunk_size=16, sub_chunk=16),
                         scale=0.25, interpret=True,
                         config_overrides=dict(intra_bwd="tiles", intra_bwd_mm_dtype=operand_dtype))

  def run(*xs):
    _, vjp = jax.vjp(lambda *a: fn(*a)[0], *xs)
    return vjp(xs[2])

  jaxpr = jax.make_jaxpr(run)(x, x, x, -jnp.ones((1, 40, 1, 16)), jnp.ones((1, 40, 1)))
  dtypes = _pallas_call_inputs(jaxpr.jaxpr, "kda_intra_bwd")
  # (q, k, v, g_cum, beta, do, hs, dhs, v_new, dv_new, m)
  # M, the entry states, V' and the per-chunk exit-state gradients dS.
  assert dtypes is not None and [dtypes[i] for i in (6, 7, 8, 10)] == [want] * 4, dtypes
  assert dtypes[9] == want  # dV' in the intra backward's matmul dtype
  # (dv_new, dhs, dh0): dS leaves the reverse state kernel in it; dh0 stays f32.
  assert _pallas_call_inputs(jaxpr.jaxpr, "kda_state_bwd", "outvars")[1:] == [want, "float32"]
  # M and the entry states leave their forward kernels in it (no cast pass):
  # (w, u, a_qk, m, kg) and (hs, v_new, ht).
  assert _pallas_call_inputs(jaxpr.jaxpr, "kda_intra_fwd", "outvars")[3] == want
  assert _pallas_call_inputs(jaxpr.jaxpr, "kda_state_rec", "outvars")[0] == want


def test_state_decay_grad_is_f32_arithmetic_on_bf16_operands():
  """dG's last-row term sum_v dS * S is formed in f32 from bf16-stored dS and S
  (a bf16 product and sum is off by 2.3e-3 of the largest value here)."""
  rng = np.random.default_rng(0)
  ds = jnp.asarray(rng.normal(size=(32, 128)), jnp.bfloat16)
  s = jnp.asarray(rng.normal(size=(32, 128)), jnp.bfloat16)
  g_last = jnp.asarray(-rng.uniform(0.0, 5.0, size=(1, 32)), jnp.float32)
  got = kernel_common.state_decay_grad(ds, s, g_last)
  assert got.dtype == jnp.float32 and got.shape == (1, 32)
  ds64, s64 = np.asarray(ds, np.float64), np.asarray(s, np.float64)
  want = (ds64 * s64).sum(axis=1)[None, :] * np.exp(np.asarray(g_last, np.float64))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_saved_state_dtype_defaults_to_the_intra_backward_operands():
  """bf16 where the intra backward's products take bf16 operands (the GPU, and
  interpret mode, at K*V >= 128*128 with bf16 inputs), else f32."""
  make = lambda backend, dtype, d: kernel_config.make_config(
      backend=backend, dtype=dtype, head_k=d, head_v=d, chunk_size=64, sub_chunk=16)
  assert make("triton", jnp.bfloat16, 128).saved_state_dtype == jnp.bfloat16
  assert make("interpret", jnp.bfloat16, 128).saved_state_dtype == jnp.bfloat16
  assert make("triton", jnp.bfloat16, 64).saved_state_dtype == jnp.float32
  assert make("triton", jnp.float32, 128).saved_state_dtype == jnp.float32
  assert make("tpu", jnp.bfloat16, 128).saved_state_dtype == jnp.float32


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_input_gradients_leave_the_kernel_in_the_input_dtype(dtype):
  """dq, dk, dv are stored once, in the inputs' dtype (no f32 copy and cast
  pass); dG and dbeta stay f32 for the reverse cumsum and the sum over slices."""
  x = jnp.ones((1, 40, 1, 16), dtype)
  spec = pallas_spec(chunk_size=16, sub_chunk=16)
  fn = functools.partial(chunk_kda_pallas, spec=spec, scale=0.25, interpret=True,
                         config_overrides={"intra_bwd": "tiles"})

  def run(*xs):
    _, vjp = jax.vjp(lambda *a: fn(*a)[0], *xs)
    return vjp(xs[2])

  jaxpr = jax.make_jaxpr(run)(x, x, x, -jnp.ones((1, 40, 1, 16)), jnp.ones((1, 40, 1)))
  # (dq, dk, dv, dG, dbeta)
  assert _pallas_call_inputs(jaxpr.jaxpr, "kda_intra_bwd", "outvars") == [dtype] * 3 + [
      "float32"] * 2
  split = functools.partial(chunk_kda_pallas, spec=spec, scale=0.25,
                            interpret=True)  # the default body at L = 16
  jaxpr = jax.make_jaxpr(lambda *xs: jax.vjp(lambda *a: split(*a)[0], *xs)[1](xs[2]))(
      x, x, x, -jnp.ones((1, 40, 1, 16)), jnp.ones((1, 40, 1)))
  assert _pallas_call_inputs(jaxpr.jaxpr, "kda_intra_bwd_cc", "outvars")[0] == dtype  # dv
  # (dq, dk, dG, dbeta parts)
  assert _pallas_call_inputs(jaxpr.jaxpr, "kda_intra_bwd_k", "outvars") == [dtype] * 2 + [
      "float32"] * 2
