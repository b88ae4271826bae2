"""The chunked jnp KDA form against the naive recurrence (CPU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers import gates
from pallas_kernels.kda import api, reference, spec as spec_lib
from tests.kda_inputs import assert_close, jitted, make_inputs, rel_l2, rtol_for

chunk_kda = jitted(api.chunk_kda)
chunk_kda_xla = jitted(reference.chunk_kda_xla)
naive_recurrent_kda = jitted(reference.naive_recurrent_kda)

LENGTHS = (1, 63, 64, 65, 200)


def _both(inp, **kw):
  ref = naive_recurrent_kda(*inp.args(), initial_state=inp.h0, output_final_state=True)
  out = chunk_kda_xla(*inp.args(), initial_state=inp.h0, output_final_state=True,
                      lower_bound=kw.pop("lower_bound", -5.0), **kw)
  return ref, out


class TestChunkedMatchesNaive:

  @pytest.mark.parametrize("seq_len", LENGTHS)
  @pytest.mark.parametrize("gate", ["near", "at", "mixed"])
  def test_float32(self, seq_len, gate):
    inp = make_inputs(seq_len, seq_len=seq_len, gate=gate)
    (o_ref, s_ref), (o, s) = _both(inp)
    tol = rtol_for(jnp.float32, seq_len)
    assert_close(o, o_ref, tol, "o")
    assert_close(s, s_ref, tol, "final state")

  @pytest.mark.parametrize("seq_len", (63, 65, 200))
  @pytest.mark.parametrize("diagonal", ["dense", "pairwise"])
  def test_float64(self, seq_len, diagonal):
    with jax.enable_x64(True):
      inp = make_inputs(seq_len + 1, seq_len=seq_len, dtype=jnp.float64, gate="mixed")
      (o_ref, s_ref), (o, s) = _both(inp, diagonal=diagonal)
      assert o.dtype == jnp.float64
      tol = rtol_for(jnp.float64, seq_len)
      assert_close(o, o_ref, tol, "o")
      assert_close(s, s_ref, tol, "final state")

  @pytest.mark.parametrize("seq_len", (64, 65, 200))
  def test_scalar_gate_gdn(self, seq_len):
    inp = make_inputs(3, seq_len=seq_len, scalar_gate=True, gate="mixed")
    assert inp.g.ndim == 3
    (o_ref, s_ref), (o, s) = _both(inp)
    assert_close(o, o_ref, rtol_for(jnp.float32, seq_len), "o")
    assert_close(s, s_ref, rtol_for(jnp.float32, seq_len), "state")
    # A scalar gate equals the same value broadcast over K.
    wide = inp.g[..., None] * jnp.ones(inp.q.shape[-1])
    o_wide, _ = chunk_kda_xla(inp.q, inp.k, inp.v, wide, inp.beta, initial_state=inp.h0,
                              lower_bound=-5.0)
    np.testing.assert_array_equal(o_wide, o)

  @pytest.mark.parametrize("chunk_size,sub_chunk", [(32, 16), (64, 8), (16, 16)])
  def test_chunk_and_tile_sizes(self, chunk_size, sub_chunk):
    inp = make_inputs(5, seq_len=100)
    (o_ref, _), (o, _) = _both(inp, chunk_size=chunk_size, sub_chunk=sub_chunk)
    assert_close(o, o_ref, rtol_for(jnp.float32, 100, chunk_size), "o")

  def test_no_initial_state_and_no_final_state(self):
    inp = make_inputs(6, seq_len=70)
    o_ref, none_ref = naive_recurrent_kda(*inp.args())
    o, none = chunk_kda_xla(*inp.args(), lower_bound=-5.0)
    assert none is None and none_ref is None
    assert_close(o, o_ref, rtol_for(jnp.float32, 70), "o")

  def test_bf16_inputs_compute_in_float32(self):
    inp = make_inputs(7, seq_len=65, dtype=jnp.bfloat16)
    (o_ref, _), (o, _) = _both(inp)
    assert o.dtype == jnp.bfloat16
    assert_close(o, o_ref, rtol_for(jnp.bfloat16, 65), "o")


class TestPadding:

  def test_tail_padding_matches_longer_run(self):
    """T = 65 run equals the first 65 outputs of the same tokens at T = 128."""
    inp = make_inputs(8, seq_len=128)
    o_full, _ = chunk_kda_xla(*inp.args(), lower_bound=-5.0)
    cut = [x[:, :65] for x in inp.args()]
    o_cut, _ = chunk_kda_xla(*cut, lower_bound=-5.0)
    np.testing.assert_array_equal(o_cut, o_full[:, :65])


class TestVarlen:

  @pytest.mark.parametrize("impl", ["naive", "xla"])
  def test_cu_seqlens_equals_separate_runs(self, impl):
    cu = np.array([0, 10, 10, 80, 150, 151])
    inp = make_inputs(9, batch=1, seq_len=150 + 1, num_states=5)
    o, s = chunk_kda(*inp.args(), initial_state=inp.h0, output_final_state=True,
                     cu_seqlens=jnp.asarray(cu), lower_bound=-5.0, implementation=impl)
    for i in range(len(cu) - 1):
      a, b = cu[i], cu[i + 1]
      if a == b:  # an empty sequence passes its initial state through
        np.testing.assert_array_equal(s[i], inp.h0[i])
        continue
      piece = [x[:, a:b] for x in inp.args()]
      o_i, s_i = naive_recurrent_kda(*piece, initial_state=inp.h0[i:i + 1],
                                     output_final_state=True)
      tol = rtol_for(jnp.float32, int(b - a))
      assert_close(o[:, a:b], o_i, tol, f"o of sequence {i}")
      assert_close(s[i], s_i[0], tol, f"state of sequence {i}")

  def test_cu_seqlens_traced_under_jit(self):
    inp = make_inputs(10, batch=1, seq_len=90, num_states=2)
    fn = jax.jit(lambda cu: chunk_kda_xla(*inp.args(), initial_state=inp.h0,
                                          output_final_state=True, cu_seqlens=cu,
                                          lower_bound=-5.0))
    o, s = fn(jnp.array([0, 37, 90]))
    o_ref, s_ref = naive_recurrent_kda(*inp.args(), initial_state=inp.h0,
                                       output_final_state=True,
                                       cu_seqlens=jnp.array([0, 37, 90]))
    assert_close(o, o_ref, rtol_for(jnp.float32, 90), "o")
    assert_close(s, s_ref, rtol_for(jnp.float32, 90), "state")


class TestDiagonalStrategies:

  @pytest.mark.parametrize("g_min,sub_chunk", [(-5.0, 16), (-2.5, 32), (-1.3, 64)])
  def test_dense_equals_pairwise_where_legal(self, g_min, sub_chunk):
    inp = make_inputs(11, seq_len=130, g_min=g_min, gate="mixed")
    kw = dict(initial_state=inp.h0, output_final_state=True, lower_bound=g_min,
              sub_chunk=sub_chunk)
    o_d, s_d = chunk_kda_xla(*inp.args(), diagonal="dense", **kw)
    o_p, s_p = chunk_kda_xla(*inp.args(), diagonal="pairwise", **kw)
    tol = rtol_for(jnp.float32, 130)
    assert_close(o_d, o_p, tol, "o")
    assert_close(s_d, s_p, tol, "state")

  @pytest.mark.parametrize("g_min,sub_chunk", [(-5.0, 32), (-2.5, 64), (-6.0, 16)])
  def test_illegal_dense_combination_raises(self, g_min, sub_chunk):
    inp = make_inputs(12, seq_len=64)
    with pytest.raises(ValueError, match=r"unsafe for a dense diagonal tile"):
      chunk_kda_xla(*inp.args(), diagonal="dense", lower_bound=g_min, sub_chunk=sub_chunk)

  def test_dense_needs_a_bound(self):
    inp = make_inputs(13, seq_len=8)
    with pytest.raises(ValueError, match="needs lower_bound"):
      chunk_kda_xla(*inp.args(), diagonal="dense")
    chunk_kda_xla(*inp.args(), diagonal="pairwise")  # any gate, no bound needed

  def test_unbounded_gate_overflows_dense_where_bound_rescues(self):
    """The softplus gate reaches g << g_min; the dense factorisation then
    forms exp(|g| (L - 1)) > float32 max, while the bounded gate at the same
    tile length stays finite and the pairwise path stays exact."""
    inp = make_inputs(14, seq_len=64)
    z = jax.random.normal(jax.random.key(0), inp.q.shape) + 3.0
    g_soft = gates.softplus_gate(z, jnp.log(jnp.full((16,), 8.0)), jnp.zeros((16,)))
    assert float(g_soft.min()) < -20.0  # unbounded: far below any useful g_min
    args = (inp.q, inp.k, inp.v, g_soft, inp.beta)
    # Bypass validation on purpose: claim a bound the gate does not respect.
    o_dense, _ = chunk_kda_xla(*args, diagonal="dense", lower_bound=-5.0, sub_chunk=16)
    assert not np.all(np.isfinite(np.asarray(o_dense))), "dense path should overflow"
    o_pair, _ = chunk_kda_xla(*args, diagonal="pairwise", sub_chunk=16)
    o_ref, _ = naive_recurrent_kda(*args)
    assert_close(o_pair, o_ref, rtol_for(jnp.float32, 64), "pairwise")
    # The bounded gate with the same pre-activations at the same tile length.
    g_bound = gates.bounded_gate(z, spec_lib.KdaSpec(lower_bound=-5.0))
    o_b, _ = chunk_kda_xla(inp.q, inp.k, inp.v, g_bound, inp.beta, diagonal="dense",
                           lower_bound=-5.0, sub_chunk=16)
    o_b_ref, _ = naive_recurrent_kda(inp.q, inp.k, inp.v, g_bound, inp.beta)
    assert_close(o_b, o_b_ref, rtol_for(jnp.float32, 64), "bounded dense")


def _outputs_and_grads(fn, inp, key, **kw):
  """(o, the gradients w.r.t. q, k, v, g, beta and h0) of `fn` on `inp` with
  its initial state, against random cotangents of o and of the final state
  drawn from `key`; jitted."""
  ct_key_o, ct_key_s = jax.random.split(key)

  @jax.jit
  def run(primals):
    def f(q, k, v, g, beta, h0):
      return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    out, vjp = jax.vjp(f, *primals)
    ct = (jax.random.normal(ct_key_o, out[0].shape),
          jax.random.normal(ct_key_s, out[1].shape))
    return out[0], vjp(ct)

  return run((*inp.args(), inp.h0))


class TestGradients:

  @pytest.mark.parametrize("diagonal", ["dense", "pairwise"])
  @pytest.mark.parametrize("scalar_gate", [False, True])
  def test_vjp_matches_naive(self, diagonal, scalar_gate):
    inp = make_inputs(15, seq_len=45, scalar_gate=scalar_gate, gate="mixed")
    _, grads_ref = _outputs_and_grads(reference.naive_recurrent_kda, inp, jax.random.key(1))
    _, grads = _outputs_and_grads(reference.chunk_kda_xla, inp, jax.random.key(1),
                                  chunk_size=16, sub_chunk=8, diagonal=diagonal,
                                  lower_bound=-5.0)
    for name, gr, gx in zip(("q", "k", "v", "g", "beta", "h0"), grads_ref, grads):
      assert_close(gx, gr, 5 * rtol_for(jnp.float32, 45, 16), f"d{name}")

  @pytest.mark.parametrize("sub_chunk", [16, 64])
  def test_vjp_at_the_limit_of_the_bound(self, sub_chunk):
    """Every gate at g_min = -85 / (L - 1), the most negative bound the dense
    diagonal takes: its row factors reach e^-85 and its column factors e^85.
    Unshifted, x e^(G - a) underflowed float32 (o 2% off at L = 64), and so
    did autodiff's cotangent of a column factor (dG 15% off at L = 64, 0.6%
    at 16; `_anchored_scores`). o and all six gradients against the naive
    recurrence, f32."""
    g_min = -spec_lib.MAX_EXP_ARG / (sub_chunk - 1)
    inp = make_inputs(17, batch=1, seq_len=150, dk=32, g_min=g_min, gate="at")
    o_ref, grads_ref = _outputs_and_grads(reference.naive_recurrent_kda, inp, jax.random.key(2))
    o, grads = _outputs_and_grads(reference.chunk_kda_xla, inp, jax.random.key(2),
                                  chunk_size=64, sub_chunk=sub_chunk, diagonal="dense",
                                  lower_bound=g_min)
    tol = rtol_for(jnp.float32, 150)
    assert_close(o, o_ref, tol, "o")
    for name, gr, gx in zip(("q", "k", "v", "g", "beta", "h0"), grads_ref, grads):
      assert_close(gx, gr, 5 * tol, f"d{name}")

  def test_gradients_finite_at_the_bound(self):
    inp = make_inputs(16, seq_len=64, gate="at")
    loss = lambda g: jnp.sum(chunk_kda_xla(inp.q, inp.k, inp.v, g, inp.beta,
                                           lower_bound=-5.0)[0] ** 2)
    assert np.all(np.isfinite(np.asarray(jax.grad(loss)(inp.g))))


class TestCausality:

  @pytest.mark.parametrize("impl,diagonal", [("xla", "dense"), ("xla", "pairwise"),
                                             ("naive", "dense")])
  @pytest.mark.parametrize("cut", [0, 17, 63, 64, 70])
  def test_future_tokens_do_not_change_the_past(self, impl, diagonal, cut):
    a = make_inputs(17, seq_len=100, gate="mixed")
    b = make_inputs(18, seq_len=100, gate="mixed")
    after = jnp.arange(100)[None, :, None] > cut
    mix = lambda x, y: jnp.where(after.reshape(after.shape + (1,) * (x.ndim - 3)), y, x)
    args_b = [mix(x, y) for x, y in zip(a.args(), b.args())]
    kw = dict(initial_state=a.h0, lower_bound=-5.0, diagonal=diagonal, implementation=impl)
    o_a, _ = chunk_kda(*a.args(), **kw)
    o_b, _ = chunk_kda(*args_b, **kw)
    np.testing.assert_array_equal(o_a[:, :cut + 1], o_b[:, :cut + 1])
    assert rel_l2(o_b[:, cut + 1:], o_a[:, cut + 1:]) > 1e-2  # the future did change


class TestValidation:

  def test_bad_shapes_and_dtypes(self):
    chunk_kda = api.chunk_kda  # eager, so the concrete cu_seqlens check runs
    inp = make_inputs(19, seq_len=8)
    q, k, v, g, beta = inp.args()
    with pytest.raises(ValueError, match="k must have q's shape"):
      chunk_kda(q, k[:, :4], v, g, beta, lower_bound=-5.0)
    with pytest.raises(ValueError, match="beta must be"):
      chunk_kda(q, k, v, g, beta[..., None], lower_bound=-5.0)
    with pytest.raises(ValueError, match="g must be"):
      chunk_kda(q, k, v, g[..., :3], beta, lower_bound=-5.0)
    with pytest.raises(TypeError, match="q must be a floating array"):
      chunk_kda(q.astype(jnp.int32), k, v, g, beta, lower_bound=-5.0)
    with pytest.raises(ValueError, match="initial_state must be"):
      chunk_kda(q, k, v, g, beta, initial_state=inp.h0[:1], lower_bound=-5.0)
    with pytest.raises(ValueError, match="implementation must be"):
      chunk_kda(q, k, v, g, beta, implementation="cuda")
    with pytest.raises(ValueError, match="sub_chunk must divide"):
      chunk_kda(q, k, v, g, beta, lower_bound=-5.0, sub_chunk=24)
    with pytest.raises(ValueError, match="cu_seqlens needs packed input"):
      chunk_kda(q, k, v, g, beta, lower_bound=-5.0, cu_seqlens=jnp.array([0, 8]))
    one = make_inputs(20, batch=1, seq_len=8)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0"):
      chunk_kda(*one.args(), lower_bound=-5.0, cu_seqlens=jnp.array([0, 5, 7]))

  def test_safe_tile_len_is_the_boundary(self):
    for g_min in (-1.3, -2.5, -5.0, -7.0):
      limit = spec_lib.safe_tile_len(g_min)
      spec_lib.check_lower_bound(g_min, limit)
      with pytest.raises(ValueError):
        spec_lib.check_lower_bound(g_min, limit + 1)
