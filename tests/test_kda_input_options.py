"""chunk_kda's fused gate, q/k L2 norm and grouped value heads vs the naive recurrence.

Each option is checked, forward and VJP, against `naive_recurrent_kda` fed the
explicit form (the activated gate, the normalised q/k, the per-value-head
loop) in float32 on fresh inputs. The checks run on the pallas path in
interpret mode (and the TPU lowering's XLA gate), on the `xla` path, and on
the GPU (marker `gpu`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import api
from pallas_kernels.kda import inputs
from pallas_kernels.kda import reference
from pallas_kernels.kda.pallas_op import chunk_kda_pallas
from pallas_kernels.kda.spec import KdaSpec
from tests.kda_inputs import rel_err

LOWER_BOUND = -5.0
TOL = {("interpret", "float32"): 2e-5, ("triton", "float32"): 2e-4,
       ("interpret", "bfloat16"): 1e-2, ("triton", "bfloat16"): 1e-2}


def _unit(x):
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _inputs(seed, b, t, h, dk, dv, *, groups=1, gdn=False, raw_gate=True, dtype=jnp.float32):
  """q, k [B,T,H,K] (unit-norm), v [B,T,HV,V], g [B,T,HV(,K)], beta [B,T,HV], h0, bias.

  raw_gate: g is a pre-activation N(0, 2^2) with 20% of entries at +20
  (gates at the bound after the sigmoid); else a log-decay in (g_min, 0).
  """
  hv = h * groups
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  q = _unit(jax.random.normal(ks[0], (b, t, h, dk))).astype(dtype)
  k = _unit(jax.random.normal(ks[1], (b, t, h, dk))).astype(dtype)
  v = jax.random.normal(ks[2], (b, t, hv, dv)).astype(dtype)
  gshape = (b, t, hv) if gdn else (b, t, hv, dk)
  z = 2.0 * jax.random.normal(ks[3], gshape)
  if raw_gate:
    g = jnp.where(jax.random.bernoulli(ks[7], 0.2, gshape), 20.0, z)
  else:
    g = LOWER_BOUND * jax.nn.sigmoid(z)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, hv))).astype(dtype)
  h0 = jax.random.normal(ks[5], (b, hv, dk, dv))
  bias = jax.random.normal(ks[6], gshape[2:])
  return q, k, v, g, beta, h0, bias


def _naive_gate(g, bias):
  return LOWER_BOUND * jax.nn.sigmoid(g.astype(jnp.float32) + bias)


def _naive_grouped(q, k, v, g, beta, h0, **kw):
  """Per value head j: the naive recurrence on q/k head j // G (an explicit loop)."""
  groups = v.shape[2] // q.shape[2]
  outs, states = [], []
  for j in range(v.shape[2]):
    o, s = reference.naive_recurrent_kda(
        q[:, :, j // groups, None], k[:, :, j // groups, None], v[:, :, j, None],
        g[:, :, j, None], beta[:, :, j, None], initial_state=h0[:, j, None], **kw)
    outs.append(o)
    states.append(s)
  return jnp.concatenate(outs, 2), jnp.concatenate(states, 1)


def _value_and_grads(fn, xs, cts):
  """Jitted ((o, ht), grads of <o, do> + <ht, dht> w.r.t. every x)."""
  def loss(*a):
    o, ht = fn(*a)
    return jnp.sum(o * cts[0]) + jnp.sum(ht * cts[1]), (o, ht)
  run = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(xs))), has_aux=True))
  (_, out), grads = run(*xs)
  return out, grads


def _cotangents(seed, o_shape, s_shape):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return jax.random.normal(k1, o_shape), jax.random.normal(k2, s_shape)


def _assert_match(got, want, names, tol, dtype=jnp.float32):
  (o, ht), grads = got
  (o_r, ht_r), grads_r = want
  assert o.shape == o_r.shape and ht.shape == ht_r.shape
  assert rel_err(o, o_r, dtype) < tol, "o"
  assert rel_err(ht, ht_r, dtype) < tol, "final state"
  for name, a, r in zip(names, grads, grads_r):
    assert a.shape == r.shape, name
    err = rel_err(jnp.asarray(a, jnp.float32), r, dtype)
    assert err < tol, f"d{name}: {err:.2e}"


class OptionChecks:
  """Checks shared by the interpret and GPU twins. Subclasses set the fields."""
  interpret: bool
  backend: str
  shape: tuple  # (B, T, H, K, V); T not a multiple of the chunk
  chunk: int
  sub_chunk: int = 16
  implementation: str = "pallas"

  def _op(self, **kw):
    return functools.partial(api.chunk_kda, implementation=self.implementation,
                             interpret=self.interpret, chunk_size=self.chunk,
                             sub_chunk=self.sub_chunk, lower_bound=LOWER_BOUND,
                             output_final_state=True, **kw)

  @pytest.mark.parametrize("gdn", [False, True])
  def test_fused_gate_matches_naive(self, gdn):
    """gate_activation: o, state and the gradients of q, k, v, raw gate, bias, beta, h0."""
    b, t, h, dk, dv = self.shape
    q, k, v, g, beta, h0, bias = _inputs(1, b, t, h, dk, dv, gdn=gdn)
    cts = _cotangents(2, v.shape, h0.shape)
    op = self._op(gate_activation="bounded_sigmoid")
    fused = lambda q, k, v, g, beta, h0, bias: op(q, k, v, g, beta, initial_state=h0,
                                                   gate_bias=bias)
    naive = lambda q, k, v, g, beta, h0, bias: reference.naive_recurrent_kda(
        q, k, v, _naive_gate(g, bias), beta, initial_state=h0, output_final_state=True)
    xs = (q, k, v, g, beta, h0, bias)
    _assert_match(_value_and_grads(fused, xs, cts), _value_and_grads(naive, xs, cts),
                  ("q", "k", "v", "g", "beta", "h0", "bias"), TOL[(self.backend, "float32")])

  def test_fused_gate_varlen_matches_naive(self):
    """Packed sequences (lengths off the chunk grid): padded slots must be zero gates."""
    _, t, h, dk, dv = self.shape
    cu = jnp.asarray(sorted({0, 5, t // 2 + 3, t}), jnp.int32)
    n = cu.shape[0] - 1
    q, k, v, g, beta, _, bias = _inputs(3, 1, t, h, dk, dv)
    h0 = jax.random.normal(jax.random.PRNGKey(4), (n, h, dk, dv))
    cts = _cotangents(5, v.shape, h0.shape)
    op = self._op(gate_activation="bounded_sigmoid", cu_seqlens=cu)
    fused = lambda q, k, v, g, beta, h0, bias: op(q, k, v, g, beta, initial_state=h0,
                                                   gate_bias=bias)
    naive = lambda q, k, v, g, beta, h0, bias: reference.naive_recurrent_kda(
        q, k, v, _naive_gate(g, bias), beta, initial_state=h0, output_final_state=True,
        cu_seqlens=cu)
    xs = (q, k, v, g, beta, h0, bias)
    _assert_match(_value_and_grads(fused, xs, cts), _value_and_grads(naive, xs, cts),
                  ("q", "k", "v", "g", "beta", "h0", "bias"), TOL[(self.backend, "float32")])

  def test_qk_l2norm_matches_naive(self):
    """qk_l2norm on raw q/k (norms 0.1 to 10) vs the recurrence on normalised ones."""
    b, t, h, dk, dv = self.shape
    q, k, v, g, beta, h0, _ = _inputs(6, b, t, h, dk, dv, raw_gate=False)
    spread = jnp.exp(jax.random.uniform(jax.random.PRNGKey(7), (2, b, t, h, 1), minval=-2.3,
                                        maxval=2.3))
    q, k = q * spread[0], k * spread[1]
    cts = _cotangents(8, v.shape, h0.shape)
    op = self._op(qk_l2norm=True)

    def l2(x):
      return x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + inputs.QK_L2NORM_EPS)

    fused = lambda q, k, v, g, beta, h0: op(q, k, v, g, beta, initial_state=h0)
    naive = lambda q, k, v, g, beta, h0: reference.naive_recurrent_kda(
        l2(q), l2(k), v, g, beta, initial_state=h0, output_final_state=True)
    xs = (q, k, v, g, beta, h0)
    _assert_match(_value_and_grads(fused, xs, cts), _value_and_grads(naive, xs, cts),
                  ("q", "k", "v", "g", "beta", "h0"), TOL[(self.backend, "float32")])

  @pytest.mark.parametrize("gdn", [False, True])
  def test_grouped_value_heads_match_per_head_naive(self, gdn):
    """HV = 2 H: value head j uses q/k head j // 2; dq, dk sum over each group."""
    b, t, h, dk, dv = self.shape
    q, k, v, g, beta, h0, _ = _inputs(9, b, t, h, dk, dv, groups=2, gdn=gdn, raw_gate=False)
    cts = _cotangents(10, v.shape, h0.shape)
    op = self._op()
    grouped = lambda q, k, v, g, beta, h0: op(q, k, v, g, beta, initial_state=h0)
    naive = lambda q, k, v, g, beta, h0: _naive_grouped(q, k, v, g, beta, h0,
                                                        output_final_state=True)
    xs = (q, k, v, g, beta, h0)
    _assert_match(_value_and_grads(grouped, xs, cts), _value_and_grads(naive, xs, cts),
                  ("q", "k", "v", "g", "beta", "h0"), TOL[(self.backend, "float32")])

  def test_all_options_together(self):
    """Fused gate + L2 norm + grouped value heads in one call vs the explicit forms."""
    b, t, h, dk, dv = self.shape
    q, k, v, g, beta, h0, bias = _inputs(11, b, t, h, dk, dv, groups=2)
    q, k = 3.0 * q, 0.5 * k
    cts = _cotangents(12, v.shape, h0.shape)
    op = self._op(gate_activation="bounded_sigmoid", qk_l2norm=True)
    fused = lambda q, k, v, g, beta, h0, bias: op(q, k, v, g, beta, initial_state=h0,
                                                   gate_bias=bias)
    l2 = inputs.l2_normalize
    naive = lambda q, k, v, g, beta, h0, bias: _naive_grouped(
        l2(q), l2(k), v, _naive_gate(g, bias), beta, h0, output_final_state=True)
    xs = (q, k, v, g, beta, h0, bias)
    _assert_match(_value_and_grads(fused, xs, cts), _value_and_grads(naive, xs, cts),
                  ("q", "k", "v", "g", "beta", "h0", "bias"), TOL[(self.backend, "float32")])


class TestOptionsPallasInterpret(OptionChecks):
  interpret = True
  backend = "interpret"
  shape = (1, 40, 2, 16, 16)
  chunk = 32

  def _spec(self):
    """The spec of `_op`'s calls, for direct `chunk_kda_pallas` calls."""
    return KdaSpec(chunk_size=self.chunk, sub_chunk=self.sub_chunk, lower_bound=LOWER_BOUND,
                   implementation="pallas")

  def test_bf16_raw_gate(self):
    """A bf16 pre-activation is read as is; its gradient comes back in bf16."""
    b, t, h, dk, dv = self.shape
    q, k, v, g, beta, h0, bias = _inputs(13, b, t, h, dk, dv, dtype=jnp.bfloat16)
    g = g.astype(jnp.bfloat16)
    cts = _cotangents(14, v.shape, h0.shape)
    op = self._op(gate_activation="bounded_sigmoid")
    fused = lambda g, bias: op(q, k, v, g, beta, initial_state=h0, gate_bias=bias)
    f32 = lambda x: x.astype(jnp.float32)
    naive = lambda g, bias: reference.naive_recurrent_kda(
        f32(q), f32(k), f32(v), _naive_gate(g, bias), f32(beta), initial_state=h0,
        output_final_state=True)
    got = _value_and_grads(fused, (g, bias), cts)
    assert got[1][0].dtype == jnp.bfloat16
    want = _value_and_grads(naive, (g, bias), cts)
    _assert_match(got, want, ("g", "bias"), TOL[(self.backend, "bfloat16")], jnp.bfloat16)

  def test_fused_gate_recomputing_backward(self):
    """save_residuals=False: the backward reruns the forward from the pre-activation."""
    b, t, h, dk, dv = self.shape
    q, k, v, g, beta, h0, bias = _inputs(19, b, t, h, dk, dv)
    cts = _cotangents(20, v.shape, h0.shape)
    op = self._op(gate_activation="bounded_sigmoid",
                  config_overrides={"save_residuals": False})
    fused = lambda g, bias, h0: op(q, k, v, g, beta, initial_state=h0, gate_bias=bias)
    naive = lambda g, bias, h0: reference.naive_recurrent_kda(
        q, k, v, _naive_gate(g, bias), beta, initial_state=h0, output_final_state=True)
    _assert_match(_value_and_grads(fused, (g, bias, h0), cts),
                  _value_and_grads(naive, (g, bias, h0), cts), ("g", "bias", "h0"),
                  TOL[(self.backend, "float32")])

  def test_rejects_bad_options(self):
    q, k, v, g, beta, _, bias = _inputs(15, 1, 16, 2, 16, 16)
    op = self._op()
    with pytest.raises(ValueError, match="HV=3 must be a multiple of q/k's H=2"):
      op(q, k, v[:, :, :1].repeat(3, 2), g, beta)
    with pytest.raises(ValueError, match="pass gate_activation='bounded_sigmoid' with it"):
      op(q, k, v, g, beta, gate_bias=bias)
    with pytest.raises(ValueError, match="gate_activation must be None or one of"):
      op(q, k, v, g, beta, gate_activation="softplus")
    with pytest.raises(ValueError, match=r"gate_bias must have the gate's per-head shape "
                                         r"\(2, 16\)"):
      op(q, k, v, g, beta, gate_activation="bounded_sigmoid", gate_bias=bias[0])
    with pytest.raises(ValueError, match="pass lower_bound"):
      api.chunk_kda(q, k, v, g, beta, implementation="naive", gate_activation="bounded_sigmoid")

  def test_default_has_no_options(self):
    """Without options the call is the plain op (same program, bit-identical output)."""
    q, k, v, g, beta, _, _ = _inputs(16, 1, 40, 2, 16, 16, raw_gate=False)
    plain = jax.jit(lambda *a: chunk_kda_pallas(*a, spec=self._spec(), interpret=True)[0])
    got = jax.jit(lambda *a: self._op()(*a)[0])(q, k, v, g, beta)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain(q, k, v, g, beta)))


class TestOptionsPallasTpuInterpret(TestOptionsPallasInterpret):
  """The TPU lowering: the fused gate runs as XLA around the Mosaic kernels."""
  # Backend-independent parts (jnp transforms, the -inf padding) are covered
  # above; CI time.
  test_fused_gate_varlen_matches_naive = None
  test_qk_l2norm_matches_naive = None
  test_grouped_value_heads_match_per_head_naive = None
  test_all_options_together = None
  test_bf16_raw_gate = None
  test_fused_gate_recomputing_backward = None
  test_rejects_bad_options = None
  test_default_has_no_options = None

  def _op(self, **kw):
    cu = kw.pop("cu_seqlens", None)

    def fn(q, k, v, g, beta, initial_state=None, gate_bias=None):
      return chunk_kda_pallas(q, k, v, g, beta, spec=self._spec(), scale=q.shape[-1] ** -0.5,
                              backend="tpu_interpret", initial_state=initial_state,
                              output_final_state=True, cu_seqlens=cu, gate_bias=gate_bias, **kw)
    return fn


class TestOptionsXla(OptionChecks):
  """The chunked jnp implementation takes the same options with the same meaning."""
  interpret = False
  backend = "interpret"
  implementation = "xla"
  shape = (1, 40, 2, 16, 16)
  chunk = 32
  test_fused_gate_varlen_matches_naive = None  # the jnp gate is layout-independent


@pytest.mark.gpu
class TestOptionsPallasGpu(OptionChecks):
  interpret = False
  backend = "triton"
  shape = (2, 300, 2, 64, 128)
  chunk = 64

  @pytest.mark.parametrize("shape", [(16, 2048, 16, 128), (1, 8192, 16, 128)])
  def test_bf16_fused_gate_benchmark_shapes(self, shape):
    """bf16 inputs, bf16 pre-activation: fused vs unfused op (same kernels after G)."""
    b, t, h, d = shape
    q, k, v, g, beta, _, bias = _inputs(17, b, t, h, d, d, dtype=jnp.bfloat16)
    g = g.astype(jnp.bfloat16)
    cts = _cotangents(18, v.shape, (b, h, d, d))
    op = self._op(gate_activation="bounded_sigmoid")
    plain = self._op()
    fused = lambda q, k, v, g, beta, bias: op(q, k, v, g, beta, gate_bias=bias)
    unfused = lambda q, k, v, g, beta, bias: plain(q, k, v, _naive_gate(g, bias), beta)
    xs = (q, k, v, g, beta, bias)
    _assert_match(_value_and_grads(fused, xs, cts), _value_and_grads(unfused, xs, cts),
                  ("q", "k", "v", "g", "beta", "bias"), TOL[(self.backend, "bfloat16")],
                  jnp.bfloat16)


@pytest.mark.tpu_export
def test_fused_gate_lowers_for_tpu():
  """Forward and backward with the fused gate (XLA gate around Mosaic kernels) export for TPU."""
  b, t, h, d = 1, 256, 1, 128
  q, k, v, g, beta, _, bias = _inputs(21, b, t, h, d, d, dtype=jnp.bfloat16)
  g = g.astype(jnp.bfloat16)
  spec = KdaSpec(chunk_size=64, sub_chunk=16, lower_bound=LOWER_BOUND, implementation="pallas")
  fn = functools.partial(chunk_kda_pallas, spec=spec, scale=d ** -0.5, backend="tpu", block_v=128,
                         output_final_state=True, gate_activation="bounded_sigmoid")

  def fwd_bwd(q, k, v, g, beta, bias):
    (o, ht), vjp = jax.vjp(lambda *xs: fn(*xs[:5], gate_bias=xs[5]), q, k, v, g, beta, bias)
    return o, ht, vjp((o, ht))

  exported = jax.export.export(jax.jit(fwd_bwd), platforms=["tpu"])(q, k, v, g, beta, bias)
  assert "tpu_custom_call" in exported.mlir_module()
