"""Causal GQA softmax attention layer (k3jax.layers.attention)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.layers.attention import CausalSelfAttention, resolve_implementation

D, H, KVH, HD = 16, 4, 2, 8
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 5e-2}


def _layer(dtype=jnp.float32, seed=0):
  return CausalSelfAttention(D, H, KVH, HD, dtype=dtype, rngs=nnx.Rngs(seed))


def _x(b, t, seed=1):
  return np.random.default_rng(seed).standard_normal((b, t, D)).astype(np.float32)


def _reference(layer, x):
  """float64 numpy causal attention; query head h uses KV head h // (H / KVH)."""
  p = {n: np.asarray(getattr(layer, n)[...], np.float64) for n in ("wq", "wk", "wv", "wo")}
  x = x.astype(np.float64)
  q = np.einsum("btd,dhk->bthk", x, p["wq"])
  k = np.einsum("btd,dhk->bthk", x, p["wk"])
  v = np.einsum("btd,dhk->bthk", x, p["wv"])
  group = layer.num_heads // layer.num_kv_heads
  k = np.repeat(k, group, axis=2)
  v = np.repeat(v, group, axis=2)
  t = x.shape[1]
  s = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(HD)
  s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  o = np.einsum("bhqs,bshk->bqhk", w, v)
  return np.einsum("bqhk,hkd->bqd", o, p["wo"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_float64_reference(dtype):
  layer = _layer(dtype)
  x = _x(2, 11)
  y, stats = nnx.jit(lambda m, x: m(x))(layer, x)
  chex.assert_shape(y, (2, 11, D))
  assert y.dtype == dtype and stats == {}
  ref = _reference(layer, x)
  tol = TOL[dtype]
  np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_decode_with_kv_cache_equals_full_pass():
  layer = _layer()
  x = _x(2, 9, seed=2)
  full, _ = nnx.jit(lambda m, x: m(x))(layer, x)
  y0, _, cache = nnx.jit(lambda m, x: m.prefill(x, 12))(layer, x[:, :4])
  chex.assert_shape(cache["k"], (2, 12, KVH, HD))
  assert int(cache["pos"]) == 4
  step = nnx.jit(lambda m, x, c: m.decode(x, c))
  outs = [y0]
  for t in range(4, 9):
    y, cache = step(layer, x[:, t:t + 1], cache)
    outs.append(y)
  assert int(cache["pos"]) == 9
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-5, atol=1e-5)


def test_is_causal():
  layer = _layer()
  x = _x(1, 8, seed=3)
  x2 = x.copy()
  x2[:, 5:] += 1.0
  f = nnx.jit(lambda m, x: m(x)[0])
  a, b = np.asarray(f(layer, x)), np.asarray(f(layer, x2))
  np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=1e-6, atol=1e-6)
  assert np.abs(a[:, 5:] - b[:, 5:]).max() > 1e-3


def test_bad_config_and_inputs():
  with pytest.raises(ValueError, match="num_kv_heads"):
    CausalSelfAttention(D, 4, 3, HD, rngs=nnx.Rngs(0))
  layer = _layer()
  with pytest.raises(ValueError, match=r"\[B, T, 16\]"):
    layer(np.zeros((2, 3, D + 1), np.float32))
  with pytest.raises(ValueError, match="exceeds cache length"):
    layer.prefill(np.zeros((1, 5, D), np.float32), 4)


def test_implementation_choice():
  assert resolve_implementation("cudnn", jnp.bfloat16, H, KVH, HD) == "cudnn"
  with pytest.raises(ValueError, match="allowed"):
    resolve_implementation("flash", jnp.bfloat16, H, KVH, HD)
  assert resolve_implementation(None, jnp.float32, H, KVH, HD) == "xla"  # f32: never cuDNN
  if jax.default_backend() == "cpu":
    assert resolve_implementation(None, jnp.bfloat16, H, KVH, HD) == "xla"


def test_parameters_carry_logical_axes():
  layer = _layer()
  assert layer.wq.get_metadata()["out_sharding"] == ("embed", "heads", "kv")
  assert layer.wo.get_metadata()["out_sharding"] == ("heads", "kv", "embed")


@pytest.mark.parametrize("context, kv_heads, heads_split", [(2, KVH, True), (4, 1, False)])
def test_sequence_split_attention_sees_whole_sequences(context, kv_heads, heads_split,
                                                       monkeypatch):
  """On a context axis the attention op gets whole sequences, its heads split over the axis.

  cuDNN's attention refuses a split sequence, so this layout is what lets the
  GPU path run under context parallelism. A head count the axis does not
  divide falls back to gathering the sequence; the result equals the float64
  reference either way.
  """
  from k3jax.layers import attention  # pylint: disable=g-import-not-at-top
  from k3jax.sharding.mesh import MeshConfig, make_mesh  # pylint: disable=g-import-not-at-top
  from k3jax.sharding import rules  # pylint: disable=g-import-not-at-top
  seen = []
  real = jax.nn.dot_product_attention

  def spy(q, *args, **kwargs):
    jax.debug.inspect_array_sharding(q, callback=lambda s: seen.append(s.shard_shape(q.shape)))
    return real(q, *args, **kwargs)

  monkeypatch.setattr(attention.jax.nn, "dot_product_attention", spy)
  layer = CausalSelfAttention(D, H, kv_heads, HD, rngs=nnx.Rngs(0))
  x = _x(2, 16)
  mesh = make_mesh(MeshConfig(data=2, context=context), devices=jax.devices()[:2 * context])
  graphdef, state = nnx.split(layer)

  @jax.jit
  def fwd(state, x):
    x = rules.constrain(x, ("batch", "length", "embed"))
    return nnx.merge(graphdef, state)(x)[0]

  with jax.set_mesh(mesh):
    y = fwd(state, x)
  # q [B=2, T=16, H=4, hd]: batch over data (2), whole sequence, heads over context or whole.
  assert seen[-1] == (1, 16, H // context if heads_split else H, HD), seen
  np.testing.assert_allclose(np.asarray(y, np.float64), _reference(layer, x), rtol=2e-5, atol=2e-5)
