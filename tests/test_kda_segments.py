"""Long sequences on the Pallas path: checkpointed segments (`KernelConfig.segment_chunks`).

A fixed-length call whose residuals exceed `kernel_config.RESIDUAL_BUDGET_BYTES`
runs as a scan over segments under `jax.checkpoint`. These check that the
segmented op equals the naive recurrence (forward, final state, all six
gradients), that segments bound the backward's temporary memory, and that the
default policy segments the 1M-token shape but not the training shapes,
from the shapes alone.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kda import api
from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import pallas_op
from pallas_kernels.kda import reference
from tests.kda_inputs import make_inputs, rel_err

LOWER_BOUND = -5.0
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _fwd_vjp(fn, xs, do, dht):
  def run(xs, do, dht):
    out, vjp = jax.vjp(lambda *a: fn(*a[:5], initial_state=a[5], output_final_state=True), *xs)
    return out, vjp((do, dht))
  return jax.jit(run)(xs, do, dht)


def _pallas(segment_chunks, **kw):
  overrides = None if segment_chunks is None else {"segment_chunks": segment_chunks}
  return functools.partial(api.chunk_kda, implementation="pallas", lower_bound=LOWER_BOUND,
                           config_overrides=overrides, **kw)


@pytest.mark.parametrize("segment_chunks", [1, 3])
def test_segments_match_naive(segment_chunks):
  """T = 150 on C = 16 (10 chunks): 10 segments of one chunk, or 4 of three
  (the last two end in padding); gates mixed at and near the bound."""
  x = make_inputs(31, batch=2, seq_len=150, heads=2, dk=16, dv=16, gate="mixed")
  k1, k2 = jax.random.split(jax.random.key(32))
  do = jax.random.normal(k1, x.v.shape)
  dht = jax.random.normal(k2, x.h0.shape)
  xs = (*x.args(), x.h0)
  (o, ht), grads = _fwd_vjp(_pallas(segment_chunks, interpret=True, chunk_size=16), xs, do, dht)
  (o_r, ht_r), grads_r = _fwd_vjp(reference.naive_recurrent_kda, xs, do, dht)
  assert rel_err(o, o_r, jnp.float32) < 2e-5
  assert rel_err(ht, ht_r, jnp.float32) < 2e-5
  for name, a, r in zip(GRAD_NAMES, grads, grads_r):
    err = rel_err(a, r, jnp.float32)
    assert err < 2e-5, f"{name}: {err:.2e}"


def test_segments_with_the_fused_gate():
  """The gate's pre-activation and bias through three segments: outputs and
  the gradients of the pre-activation and the bias equal one whole call's."""
  x = make_inputs(38, batch=1, seq_len=100, heads=2, dk=16, dv=16)
  pre = jax.random.normal(jax.random.key(39), x.g.shape)
  bias = 0.5 * jax.random.normal(jax.random.key(40), (2, 16))
  do = jax.random.normal(jax.random.key(41), x.v.shape)

  def run(segment_chunks):
    fn = _pallas(segment_chunks, interpret=True, chunk_size=16,
                 gate_activation="bounded_sigmoid")
    o, vjp = jax.vjp(lambda q, g, b: fn(q, x.k, x.v, g, x.beta, gate_bias=b)[0], x.q, pre, bias)
    return o, vjp(do)

  whole, seg = jax.jit(lambda: run(None))(), jax.jit(lambda: run(3))()
  for name, a, r in zip(("o", "dq", "dg", "dbias"), jax.tree.leaves(seg), jax.tree.leaves(whole)):
    assert rel_err(a, r, jnp.float32) < 1e-5, name


def test_segments_bound_the_backward_temporaries():
  """The compiled gradient program's temporaries shrink with the segment:
  with 32-chunk segments of 256 they are under a fifth of the whole call's
  (3.2 against 17.8 MB when written)."""
  x = make_inputs(33, batch=1, seq_len=4096, heads=2, dk=16, dv=16)

  def temp_bytes(segment_chunks):
    fn = _pallas(segment_chunks, interpret=True, chunk_size=16)
    loss = lambda *a: jnp.sum(fn(*a)[0] ** 2)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*x.args()).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  whole, segmented = temp_bytes(None), temp_bytes(32)
  assert segmented < 0.2 * whole, (segmented, whole)


def _default(b, t, h, d, dtype=jnp.bfloat16, backend="triton"):
  tp = -(-t // 64) * 64
  shape = kernel_config.KernelShape(d, d, 64, 16, b * h, b * tp * h)
  return shape, kernel_config.heuristic_config(shape, dtype, backend)


def test_policy_segments_the_million_token_shape():
  """B1 T = 2^20 H16 K = V = 128 bf16 keeps 28 GiB of residuals (1792 bytes a
  token-head): four segments of 2^18 tokens, 7 GiB each; training and
  benchmark shapes stay whole."""
  shape, cfg = _default(1, 2 ** 20, 16, 128)
  assert kernel_config.residual_bytes(shape, cfg) == 2 ** 20 * 16 * 1792
  assert cfg.segment_chunks == kernel_config.RESIDUAL_BUDGET_BYTES // (16 * 64 * 1792)
  segments, chunks = pallas_op.segment_layout(2 ** 20 // 64, cfg.segment_chunks)
  assert (segments, chunks * 64) == (4, 2 ** 18)
  assert 16 * chunks * 64 * 1792 <= kernel_config.RESIDUAL_BUDGET_BYTES
  for b, t in ((16, 2048), (4, 8192), (1, 32768), (16, 8192), (1, 2 ** 18)):
    assert _default(b, t, 16, 128)[1].segment_chunks is None, (b, t)
  # An explicit choice wins over the policy.
  cfg = kernel_config.make_config(backend="triton", dtype=jnp.bfloat16, head_k=128, head_v=128,
                                  chunk_size=64, sub_chunk=16, state_programs=16,
                                  token_heads=2 ** 20 * 16, overrides={"segment_chunks": None})
  assert cfg.segment_chunks is None


def test_segment_layout_and_bad_values():
  assert pallas_op.segment_layout(10, None) == (1, 10)
  assert pallas_op.segment_layout(10, 10) == (1, 10)
  assert pallas_op.segment_layout(10, 3) == (4, 3)
  assert pallas_op.segment_layout(16, 5) == (4, 4)    # balanced: four of four, not 5 + 5 + 5 + 1
  with pytest.raises(ValueError, match="segment_chunks must be None or a positive int"):
    kernel_config.make_config(backend="interpret", dtype=jnp.float32, head_k=16, head_v=16,
                              chunk_size=16, sub_chunk=16, overrides={"segment_chunks": 0})


@pytest.mark.gpu
def test_gpu_segments_equal_the_whole_call():
  """bf16 on the GPU: 8 segments give the outputs and gradients of one call
  (the same kernels, the state handed over in f32)."""
  x = make_inputs(34, batch=2, seq_len=4096, heads=4, dk=128, dv=128, dtype=jnp.bfloat16)
  do = jax.random.normal(jax.random.key(35), x.v.shape, jnp.bfloat16)
  dht = jax.random.normal(jax.random.key(36), x.h0.shape)
  xs = (*x.args(), x.h0)
  whole = _fwd_vjp(_pallas(None), xs, do, dht)
  seg = _fwd_vjp(_pallas(8), xs, do, dht)
  for name, a, r in zip(("o", "ht") + GRAD_NAMES, jax.tree.leaves(seg), jax.tree.leaves(whole)):
    err = rel_err(a.astype(jnp.float32), r.astype(jnp.float32), jnp.float32)
    assert err < 1e-5, f"{name}: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.whole_gpu
def test_gpu_million_tokens_train_by_default():
  """B1 T = 2^20 H16 K = V = 128 bf16, forward and backward with the default
  config (four segments): it fits and every output is finite. Sized on an
  H200: its program takes about 67 GiB, more than an 80 GB card lends."""
  limit = jax.devices()[0].memory_stats().get("bytes_limit", 0)
  if limit < 90 * 2 ** 30:
    pytest.skip(f"needs about 90 GiB of GPU memory for its 67 GiB program; this device lends "
                f"{limit / 2 ** 30:.0f} GiB")
  b, t, h, d = 1, 2 ** 20, 16, 128
  keys = jax.random.split(jax.random.key(37), 6)

  def unit(key):
    x = jax.random.normal(key, (b, t, h, d))
    return (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(jnp.bfloat16)

  q, k = unit(keys[0]), unit(keys[1])
  v = jax.random.normal(keys[2], (b, t, h, d), jnp.bfloat16)
  g = LOWER_BOUND * jax.nn.sigmoid(jax.random.normal(keys[3], (b, t, h, d)))
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h))).astype(jnp.bfloat16)
  do = jax.random.normal(keys[5], (b, t, h, d), jnp.bfloat16)

  def run(q, k, v, g, beta, do):
    o, vjp = jax.vjp(lambda *a: api.chunk_kda(*a, lower_bound=LOWER_BOUND,
                                               implementation="pallas")[0], q, k, v, g, beta)
    return o, vjp(do)

  out = jax.jit(run)(q, k, v, g, beta, do)
  for x in jax.tree.leaves(out):
    assert bool(jnp.isfinite(x.astype(jnp.float32)).all())
