"""Head widths K, V that are not powers of two on the Pallas path (zero-padded inside the op).

Forward, final state and every gradient against the float32 naive
recurrence; the interpret twin runs on the CPU, the `gpu` twin on the GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import api
from pallas_kernels.kda import head_pad
from pallas_kernels.kda import reference
from tests.kda_inputs import make_inputs, rel_err

LOWER_BOUND = -5.0
TOL = {"interpret": 2e-5, "triton": 2e-4}


def _fwd_vjp(fn, xs, do, dht):
  """Jitted ((o, ht), grads of q, k, v, g, beta, h0) of fn with cotangents (do, dht)."""
  def run(xs, do, dht):
    out, vjp = jax.vjp(lambda *a: fn(*a[:5], initial_state=a[5], output_final_state=True), *xs)
    return out, vjp((do, dht))
  return jax.jit(run)(xs, do, dht)


class HeadWidthChecks:
  interpret: bool
  backend: str
  seq_len: int
  chunk: int

  @pytest.mark.parametrize("dk,dv,gdn", [(12, 20, False), (48, 24, True), (16, 40, False)])
  def test_matches_naive(self, dk, dv, gdn):
    """o, final state and all six gradients at widths the kernels do not take."""
    x = make_inputs(11, batch=1, seq_len=self.seq_len, heads=2, dk=dk, dv=dv, gate="mixed",
                    scalar_gate=gdn)
    k1, k2 = jax.random.split(jax.random.key(12))
    do = jax.random.normal(k1, x.v.shape)
    dht = jax.random.normal(k2, x.h0.shape)
    pallas = functools.partial(api.chunk_kda, implementation="pallas", interpret=self.interpret,
                               chunk_size=self.chunk, lower_bound=LOWER_BOUND)
    xs = (*x.args(), x.h0)
    (o, ht), grads = _fwd_vjp(pallas, xs, do, dht)
    (o_r, ht_r), grads_r = _fwd_vjp(reference.naive_recurrent_kda, xs, do, dht)
    assert o.shape == o_r.shape and ht.shape == ht_r.shape
    tol = TOL[self.backend]
    assert rel_err(o, o_r, jnp.float32) < tol
    assert rel_err(ht, ht_r, jnp.float32) < tol
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, grads_r):
      assert a.shape == r.shape, name
      err = rel_err(a, r, jnp.float32)
      assert err < tol, f"{name}: {err:.2e}"

  def test_varlen_matches_naive(self):
    """Packed sequences (one shorter than a chunk) at K = 24, V = 40."""
    t = self.seq_len
    cu = jnp.asarray([0, 5, t // 2 + 3, t], jnp.int32)
    x = make_inputs(13, batch=1, seq_len=t, heads=1, dk=24, dv=40, num_states=3)
    k1, k2 = jax.random.split(jax.random.key(14))
    do = jax.random.normal(k1, x.v.shape)
    dht = jax.random.normal(k2, x.h0.shape)
    pallas = functools.partial(api.chunk_kda, implementation="pallas", interpret=self.interpret,
                               chunk_size=self.chunk, lower_bound=LOWER_BOUND, cu_seqlens=cu)
    naive = functools.partial(reference.naive_recurrent_kda, cu_seqlens=cu)
    xs = (*x.args(), x.h0)
    (o, ht), grads = _fwd_vjp(pallas, xs, do, dht)
    (o_r, ht_r), grads_r = _fwd_vjp(naive, xs, do, dht)
    tol = TOL[self.backend]
    assert rel_err(o, o_r, jnp.float32) < tol
    assert rel_err(ht, ht_r, jnp.float32) < tol
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, grads_r):
      err = rel_err(a, r, jnp.float32)
      assert err < tol, f"{name}: {err:.2e}"


class TestHeadWidthsInterpret(HeadWidthChecks):
  interpret = True
  backend = "interpret"
  seq_len = 40   # not a multiple of the chunk
  chunk = 16


@pytest.mark.gpu
class TestHeadWidthsGpu(HeadWidthChecks):
  interpret = False
  backend = "triton"
  seq_len = 300
  chunk = 64

  @pytest.mark.parametrize("dv", [48, 96, 192])
  def test_bf16_issue_widths(self, dv):
    """bf16 at V = 48, 96, 192 (K = 128) against the f32 recurrence, forward and VJP."""
    x = make_inputs(15, batch=1, seq_len=512, heads=2, dk=128, dv=dv, dtype=jnp.bfloat16)
    do = jax.random.normal(jax.random.key(16), x.v.shape, jnp.bfloat16)

    def run(fn, xs, do):
      o, vjp = jax.vjp(lambda *a: fn(*a)[0], *xs)
      return o, vjp(do)
    pallas = functools.partial(api.chunk_kda, implementation="pallas", lower_bound=LOWER_BOUND)
    o, grads = jax.jit(functools.partial(run, pallas))(x.args(), do)
    f32 = tuple(a.astype(jnp.float32) for a in x.args())
    o_r, grads_r = jax.jit(functools.partial(run, reference.naive_recurrent_kda))(
        f32, do.astype(jnp.float32))
    assert rel_err(o, o_r, jnp.bfloat16) < 5e-3
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, grads_r):
      err = rel_err(a.astype(jnp.float32), r, jnp.bfloat16)
      assert err < 1e-2, f"{name}: {err:.2e}"


def test_padded_widths():
  """Powers of two stay as they are; others round up; K >= 16 on the GPU."""
  assert head_pad.padded_widths(128, 128, "triton") == (128, 128)
  assert head_pad.padded_widths(64, 8, "interpret") == (64, 8)
  assert head_pad.padded_widths(48, 96, "triton") == (64, 128)
  assert head_pad.padded_widths(192, 200, "tpu") == (256, 256)
  assert head_pad.padded_widths(8, 3, "triton") == (16, 8)
  assert head_pad.padded_widths(8, 3, "interpret") == (8, 8)
  assert head_pad.padded_widths(512, 1024, "triton") == (512, 1024)


def test_pad_heads_is_identity_at_kernel_widths():
  """No pad or slice op is added at kernel widths (the same program as before)."""
  x = make_inputs(17, batch=1, seq_len=8, heads=1, dk=16, dv=16)
  out = head_pad.pad_heads(x.q, x.k, x.v, x.g, x.h0, 16, 16)
  assert all(a is b for a, b in zip(out, (x.q, x.k, x.v, x.g, x.h0)))
  o, ht = head_pad.unpad_outputs(x.v, x.h0, 16, 16)
  assert o is x.v and ht is x.h0


def test_rejects_wide_non_power_of_two():
  x = make_inputs(18, batch=1, seq_len=16, heads=1, dk=16, dv=300)
  with pytest.raises(ValueError, match="V = 300 is not a power of two.*up to 256"):
    api.chunk_kda(*x.args(), implementation="pallas", interpret=True, chunk_size=16,
                  lower_bound=LOWER_BOUND)
  np.testing.assert_equal(head_pad.MAX_PADDED_WIDTH, 256)
