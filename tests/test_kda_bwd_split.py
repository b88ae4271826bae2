"""KDA Pallas backward: the split intra kernels (`intra_bwd_impl="split"`).

Checked in interpret mode against the one-program "tiles" kernel on random
chunk operands with four K slices, and end to end (the whole VJP) against the
float32 naive recurrence with four K slices, for dense gates at the bound and
GDN-style gates with the pairwise diagonal. Interpret mode fills kernel
outputs with NaN first, so an unwritten slice or row block fails. The GPU
twin class reruns the GPU checks of tests/test_kda_pallas.py with "split".
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
# The module, not the class: a class name imported here would be collected twice.
from tests import test_kda_pallas as base

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


def _unit(x):
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def test_split_kernels_match_full_tile_kernel(diagonal="dense"):
  """intra_bwd "split" == "tiles" on random chunk operands (all five outputs).

  K = 64 in block_k = 16 slices (four programs per chunk), C = 32, L = 8
  (four row tiles), two chunks and two heads, so the slice, head and chunk
  index maps of both kernels are exercised. The pairwise diagonal is checked
  end to end below (here it matched "tiles" to 1.8e-7, but costs 10 s of CI).
  """
  b, h, nc, c, ell, dk, dv = 1, 2, 2, 32, 8, 64, 16
  tp = nc * c
  ks = jax.random.split(jax.random.PRNGKey(0), 12)
  q = _unit(jax.random.normal(ks[0], (b, tp, h, dk))).reshape(b, tp, h * dk)
  k = _unit(jax.random.normal(ks[1], (b, tp, h, dk))).reshape(b, tp, h * dk)
  v = jax.random.normal(ks[2], (b, tp, h * dv))
  # Off the bound: two f32 summation orders of the e^{|g_min| (L-1)} dense
  # diagonal factors differ by ~2e-5 of dG's max at the bound (see
  # test_kda_bwd_rows.py); the bound is covered end to end below.
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
  for impl in ("split", "tiles"):
    cfg = kernel_config.make_config(backend="interpret", dtype=jnp.float32, head_k=dk,
                                    head_v=dv, chunk_size=c, sub_chunk=ell,
                                    overrides=dict(intra_bwd_impl=impl, block_k=16))
    fn = jax.jit(functools.partial(kernel_bwd.intra_bwd, heads=h, chunk_size=c, sub_chunk=ell,
                                   diagonal=diagonal, scale=dk ** -0.5, cfg=cfg))
    outs[impl] = fn(q, k, v, g_cum, beta, do, hs, dhs, v_new, dv_new, m)
  for name, a, r in zip(("dq", "dk", "dv", "dG", "dbeta"), outs["split"], outs["tiles"]):
    assert a.shape == r.shape and a.dtype == r.dtype, name
    err = _rel_max(a, r)
    assert err < F32_TOL, f"{diagonal} {name}: {err:.2e}"


@pytest.mark.parametrize("diagonal,gdn", [("dense", False), ("pairwise", True)])
def test_split_vjp_matches_naive(diagonal, gdn):
  """All six gradients vs the naive recurrence with intra_bwd_impl="split".

  K = 32 in block_k = 8 slices, T = 40 (not a multiple of C = 32), four row
  tiles of L = 8, an initial state and a final-state cotangent. Dense: KDA
  gates at the bound. Pairwise: GDN-style gates (one per head, broadcast over K).
  """
  b, t, h, dk, dv = 1, 40, 2, 32, 16
  ks = jax.random.split(jax.random.PRNGKey(1), 8)
  q = _unit(jax.random.normal(ks[0], (b, t, h, dk)))
  k = _unit(jax.random.normal(ks[1], (b, t, h, dk)))
  v = jax.random.normal(ks[2], (b, t, h, dv))
  if gdn:
    g = jnp.broadcast_to(_gates(ks[3], (b, t, h, 1), at_bound=False), (b, t, h, dk))
  else:
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
  got = grads(functools.partial(
      chunk_kda_pallas, scale=dk ** -0.5, chunk_size=32, sub_chunk=8, diagonal=diagonal,
      interpret=True, config_overrides=dict(intra_bwd_impl="split", block_k=8)))
  for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
    assert a.shape == r.shape, name
    err = _rel_max(a, r)
    assert err < F32_TOL, f"{diagonal} {name}: {err:.2e}"


def test_split_choice_and_tpu_rejection():
  """"split" is opt-in, rejected for TPU backends, and needs L >= 16 on Triton."""
  cfg = lambda backend, **kw: kernel_config.make_config(
      backend=backend, dtype=jnp.bfloat16, head_k=128, head_v=128, chunk_size=64,
      sub_chunk=16, overrides=kw or None)
  assert kernel_bwd.use_row_blocks(cfg("interpret"), 16)        # "auto": rows, never split
  assert not kernel_bwd.use_row_blocks(cfg("triton", intra_bwd_impl="split"), 16)
  with pytest.raises(ValueError, match="sub_chunk >= 16"):
    kernel_bwd.use_row_blocks(cfg("triton", intra_bwd_impl="split"), 8)
  for backend in ("tpu", "tpu_interpret"):
    with pytest.raises(ValueError, match="not lowered for TPU"):
      kernel_bwd.use_row_blocks(cfg(backend, intra_bwd_impl="split"), 16)
  # Through the public entry: the VJP (not the forward) reaches intra_bwd.
  x = jnp.ones((1, 16, 1, 128), jnp.float32)
  fn = functools.partial(chunk_kda_pallas, scale=0.1, chunk_size=16, sub_chunk=16,
                         backend="tpu_interpret",
                         config_overrides=dict(intra_bwd_impl="split"))
  with pytest.raises(ValueError, match="not lowered for TPU"):
    jax.eval_shape(jax.grad(lambda q: jnp.sum(fn(q, x, x, -x, jnp.ones((1, 16, 1)))[0])), x)


@pytest.mark.gpu
class TestKdaPallasGpuSplitBackward(base.TestKdaPallasGpu):
  """The GPU checks of tests/test_kda_pallas.py, gradients included, with the
  split intra backward forced (it is opt-in until these pass on the GPU)."""

  def _pallas(self, diagonal, **kw):
    return super()._pallas(diagonal, config_overrides={"intra_bwd_impl": "split"}, **kw)
