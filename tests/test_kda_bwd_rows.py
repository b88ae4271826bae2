"""KDA Pallas backward: row-block intra kernel and saved forward residuals.

The row-block `intra_bwd` kernel ("rows", the GPU default) is checked against
the masked full-tile kernel ("tiles", the TPU path) on the same random
operands, and the whole VJP (both residual modes) against the float32 naive
recurrence. Both use four row tiles per chunk (C = 64, L = 16 and C = 32,
L = 8), so every (row tile, column tile) pair of the column-side products is
exercised. Interpret mode fills kernel outputs with NaN first, so an
unwritten row block fails.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import kernel_bwd
from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import reference
from pallas_kernels.kda.pallas_op import chunk_kda_pallas

LOWER_BOUND = -5.0
# max|x - ref| / max|ref|, float32 operands, exact (HIGHEST) matmuls on the CPU.
F32_TOL = 2e-5


def _rel_max(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  assert np.all(np.isfinite(x)), "non-finite values (unwritten output?)"
  return np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30)


def _gates(key, shape, at_bound):
  z = jax.random.normal(key, shape)
  return LOWER_BOUND * jax.nn.sigmoid(6.0 + z if at_bound else 2.0 * z)


def test_row_block_kernel_matches_full_tile_kernel(diagonal="dense"):
  """intra_bwd "rows" == "tiles" on random chunk operands (all five outputs).

  The pairwise row-block path is checked end to end by the pairwise VJP test
  of tests/test_kda_pallas.py (the interpret backend runs "rows").
  """
  b, h, nc, c, ell, dk, dv = 1, 1, 1, 64, 16, 16, 32
  tp = nc * c
  ks = jax.random.split(jax.random.PRNGKey(0), 12)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, tp, h, dk))).reshape(b, tp, h * dk)
  k = unit(jax.random.normal(ks[1], (b, tp, h, dk))).reshape(b, tp, h * dk)
  v = jax.random.normal(ks[2], (b, tp, h * dv))
  # Gates off the bound: two f32 algorithms are compared here, and at the bound
  # with L = 16 the dense diagonal factors (up to e^75) make dG's rounding
  # differ by ~2e-5 of its max between any two summation orders (both kernels
  # are ~2e-5 from the float64 recurrence there). The bound is covered below.
  g = _gates(ks[3], (b, nc, c, h * dk), at_bound=False)
  g_cum = jnp.cumsum(g, axis=2).reshape(b, tp, h * dk)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, h, tp, 1)))
  do = jax.random.normal(ks[5], (b, tp, h * dv))
  hs = jax.random.normal(ks[6], (b, h, nc * dk, dv))
  dhs = jax.random.normal(ks[7], (b, h, nc * dk, dv))
  v_new = jax.random.normal(ks[8], (b, tp, h * dv))
  dv_new = jax.random.normal(ks[9], (b, tp, h * dv))
  # M is unit lower triangular in the forward; any such matrix exercises the algebra.
  low = jnp.tril(0.3 * jax.random.normal(ks[10], (b, h, nc, c, c)), -1)
  m = (low + jnp.eye(c)).reshape(b, h, tp, c)
  outs = {}
  for impl in ("rows", "tiles"):
    cfg = kernel_config.make_config(backend="interpret", dtype=jnp.float32, head_k=dk,
                                    head_v=dv, chunk_size=c, sub_chunk=ell,
                                    overrides=dict(intra_bwd_impl=impl))
    fn = jax.jit(functools.partial(kernel_bwd.intra_bwd, heads=h, chunk_size=c, sub_chunk=ell,
                                   diagonal=diagonal, scale=dk ** -0.5, cfg=cfg))
    outs[impl] = fn(q, k, v, g_cum, beta, do, hs, dhs, v_new, dv_new, m)
  for name, a, r in zip(("dq", "dk", "dv", "dG", "dbeta"), outs["rows"], outs["tiles"]):
    assert a.shape == r.shape, name
    err = _rel_max(a, r)
    assert err < F32_TOL, f"{name}: {err:.2e}"


def test_use_row_blocks_choice():
  cfg = lambda backend, **kw: kernel_config.make_config(
      backend=backend, dtype=jnp.bfloat16, head_k=128, head_v=128, chunk_size=64,
      sub_chunk=16, overrides=kw or None)
  # Triton keeps the full-tile kernel until the GPU gradient checks cover rows.
  assert not kernel_bwd.use_row_blocks(cfg("triton"), 16)
  assert kernel_bwd.use_row_blocks(cfg("triton", intra_bwd_impl="rows"), 16)
  with pytest.raises(ValueError, match="sub_chunk >= 16"):
    kernel_bwd.use_row_blocks(cfg("triton", intra_bwd_impl="rows"), 8)
  assert not kernel_bwd.use_row_blocks(cfg("tpu"), 16)
  assert kernel_bwd.use_row_blocks(cfg("interpret"), 8)
  assert not kernel_bwd.use_row_blocks(cfg("interpret", intra_bwd_impl="tiles"), 16)
  with pytest.raises(ValueError, match="intra_bwd_impl"):
    kernel_bwd.use_row_blocks(cfg("interpret", intra_bwd_impl="fast"), 16)


def test_vjp_saved_and_recomputed_residuals_match_naive():
  """All six gradients vs the naive recurrence, with and without saved residuals.

  Gates at the bound, T = 40 (not a multiple of C = 32), four row tiles of
  L = 8, an initial state and a final-state cotangent. (With C = 64, L = 16
  at the bound, dg is ~2.2e-5 from the float64 recurrence, for the full-tile
  kernel 2.4e-5: a property of the e^75 diagonal factors, not of this kernel.) Both residual modes run the same kernels on
  the same operands, so their gradients must agree bit for bit.
  """
  b, t, h, dk, dv = 1, 40, 1, 16, 16
  ks = jax.random.split(jax.random.PRNGKey(1), 8)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, t, h, dk)))
  k = unit(jax.random.normal(ks[1], (b, t, h, dk)))
  v = jax.random.normal(ks[2], (b, t, h, dv))
  g = _gates(ks[3], (b, t, h, dk), at_bound=True)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
  h0 = jax.random.normal(ks[5], (b, h, dk, dv))
  do = jax.random.normal(ks[6], (b, t, h, dv))
  dht = jax.random.normal(ks[7], (b, h, dk, dv))
  xs = (q, k, v, g, beta, h0)

  def grads(fn):
    def loss(*xs):
      o, ht = fn(*xs[:5], initial_state=xs[5], output_final_state=True)
      return jnp.sum(o * do) + jnp.sum(ht * dht)
    return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*xs)

  want = grads(functools.partial(reference.naive_recurrent_kda, scale=dk ** -0.5))
  got = {}
  for save in (True, False):
    got[save] = grads(functools.partial(
        chunk_kda_pallas, scale=dk ** -0.5, chunk_size=32, sub_chunk=8, diagonal="dense",
        interpret=True, config_overrides=dict(save_residuals=save, intra_bwd_impl="rows")))
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got[save], want):
      assert a.shape == r.shape, name
      err = _rel_max(a, r)
      assert err < F32_TOL, f"save_residuals={save} {name}: {err:.2e}"
  for a, r in zip(got[True], got[False]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(r))



def _pallas_call_inputs(jaxpr, name):
  """Input dtypes of the pallas_call `name` anywhere in `jaxpr` (nested jaxprs too)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call" and eqn.params["name"] == name:
      return [str(v.aval.dtype) for v in eqn.invars]
    for p in eqn.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          found = _pallas_call_inputs(sub, name)
          if found:
            return found
  return None


@pytest.mark.parametrize("residual_dtype,want", [(None, "float32"), (jnp.bfloat16, "bfloat16")])
def test_residual_dtype_reaches_intra_bwd(residual_dtype, want):
  """The saved M, entry states and V' reach intra_bwd in cfg.residual_dtype.

  Checked on the traced program: on the CPU, XLA's excess-precision rewrite
  may drop an f32 -> bf16 -> f32 round trip inside one interpreted program,
  so the rounding itself is only observable on the GPU, where the residuals
  are stored to memory between kernels.
  """
  x = jnp.ones((1, 40, 1, 16), jnp.bfloat16)
  fn = functools.partial(chunk_kda_pallas, scale=0.25, chunk_size=16, sub_chunk=16,
                         interpret=True, config_overrides=dict(residual_dtype=residual_dtype))

  def run(*xs):
    _, vjp = jax.vjp(lambda *a: fn(*a)[0], *xs)
    return vjp(xs[2])

  jaxpr = jax.make_jaxpr(run)(x, x, x, -jnp.ones((1, 40, 1, 16)), jnp.ones((1, 40, 1)))
  dtypes = _pallas_call_inputs(jaxpr.jaxpr, "kda_intra_bwd")
  # (q, k, v, g_cum, beta, do, hs, dhs, v_new, dv_new, m)
  assert dtypes is not None and [dtypes[i] for i in (6, 8, 10)] == [want] * 3, dtypes
  assert dtypes[7] == dtypes[9] == "float32"  # gradients stay f32
