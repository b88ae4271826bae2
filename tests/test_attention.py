"""Causal GQA softmax attention layer (k3jax.layers.attention)."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.layers import packed_attention
from k3jax.layers.attention import CausalSelfAttention, resolve_documents, resolve_implementation
from k3jax.layers.segments import Segments

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
  if jax.default_backend() == "cpu":
    assert layer.documents == "mask"  # the default keeps the document mask off cuDNN
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


def test_documents_path_choice():
  """The packed layout only on cuDNN; XLA (the CPU's path) keeps the document mask."""
  assert resolve_documents(None, "xla", jnp.bfloat16, H, KVH, HD) == "mask"
  assert resolve_documents("mask", "cudnn", jnp.bfloat16, H, KVH, HD) == "mask"
  assert resolve_documents("packed", "cudnn", jnp.bfloat16, H, KVH, HD) == "packed"
  with pytest.raises(ValueError, match="implementation='cudnn' or documents='mask'"):
    resolve_documents("packed", "xla", jnp.bfloat16, H, KVH, HD)
  with pytest.raises(ValueError, match="allowed"):
    resolve_documents("ragged", "cudnn", jnp.bfloat16, H, KVH, HD)


# Row 0: documents of 1, 5 and 1 tokens, then padding; row 1: left padding, then a prompt;
# row 2: one document; row 3: id 2 in two runs, then more runs than M = 4 (merged).
DOC_IDS = np.array([[1, 2, 2, 2, 2, 2, 3, 0, 0, 0, 0, 0],
                    [0, 0, 0, 0, 0, 7, 7, 7, 7, 7, 7, 7],
                    [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4],
                    [2, 2, 1, 2, 5, 5, 6, 7, 8, 8, 0, 0]], np.int32)
DOC_RUNS = 4


def _mask_of_runs(offsets, lengths, length):
  """[N, T, T] bool: query i sees key j when both lie in one listed run (start offsets[n, m],
  lengths[n, m] tokens; -1 unlisted) and j <= i. Asserts that the runs tile each row."""
  mask = np.zeros((offsets.shape[0], length, length), bool)
  cover = np.zeros((offsets.shape[0], length), np.int32)
  for n, m in zip(*np.nonzero(lengths >= 0)):
    start, size = offsets[n, m], lengths[n, m]
    mask[n, start:start + size, start:start + size] = np.tril(np.ones((size, size), bool))
    cover[n, start:start + size] += 1
  np.testing.assert_array_equal(cover, 1)
  return mask


def test_cudnn_layout_lists_each_run():
  """The packed layout's runs give the document mask, overflow merge included, and jax's
  flattening of them (cuDNN's cumulative offsets over the batch) tiles the batch."""
  b, t = DOC_IDS.shape

  @jax.jit
  def layouts(ids):
    seg = Segments.from_ids(ids, DOC_RUNS)
    offsets, lengths = packed_attention.cudnn_layout(seg)
    flat_lengths = flat_offsets = jnp.zeros(())
    if packed_attention.available():  # jax's private flattening, where it was checked
      tokens = jnp.zeros((b, t, 1, 1), jnp.bfloat16)  # token strides: one head of width 1
      flat_lengths, _, flat_offsets, _ = packed_attention._cudnn_fa._fix_seqlen_offsets(  # pylint: disable=protected-access
          lengths, lengths, offsets, offsets, tokens, tokens)
    return offsets, lengths, seg.attention_mask_b1tt()[:, 0], flat_offsets, flat_lengths

  offsets, lengths, want, flat_offsets, flat_lengths = map(np.asarray, layouts(DOC_IDS))
  assert offsets.shape == (b, DOC_RUNS + 1) and lengths.shape == (b, DOC_RUNS)
  np.testing.assert_array_equal(offsets[:, -1], -1)
  np.testing.assert_array_equal(offsets[:, :-1] < 0, lengths < 0)
  np.testing.assert_array_equal(lengths[0], [1, 5, 1, 5])
  np.testing.assert_array_equal(lengths[2], [12, -1, -1, -1])
  np.testing.assert_array_equal(offsets[3], [0, 2, 3, 4, -1])  # the 4th run takes the rest
  np.testing.assert_array_equal(_mask_of_runs(offsets, lengths, t), want)
  if not packed_attention.available():
    return
  # jax's flattening over the batch, as cuDNN reads it.
  flat_lengths, flat_offsets = flat_lengths.ravel(), flat_offsets.ravel()
  real = flat_lengths > 0
  np.testing.assert_array_equal(flat_offsets[1:1 + real.sum()] - flat_offsets[:real.sum()],
                                flat_lengths[real])  # cumulative offsets
  whole = _mask_of_runs(flat_offsets[None, :real.sum()], flat_lengths[None, real], b * t)[0]
  blocks = np.zeros((b * t, b * t), bool)
  for r in range(b):
    blocks[r * t:(r + 1) * t, r * t:(r + 1) * t] = want[r]
  np.testing.assert_array_equal(whole, blocks)


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


def _rel_err(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return np.abs(x - ref).max() / np.abs(ref).max()


@pytest.mark.gpu
def test_gpu_packed_layout_equals_document_mask():
  """cuDNN's packed layout against the document mask, values and q, k, v gradients.

  Rows: documents of 1 token (softmax over one key: the output is that token's
  value), padding (id 0) after and before documents, one document, and more
  runs than M (merged). Both bf16 paths are held to a float32 XLA reference of
  the same bf16 inputs: the packed one may err at most 1.5 times as much as
  cuDNN with the mask plus one bf16 step at the largest value (2^-8), since the
  two differ only in tiling and where masked logits are skipped.
  """
  b, t, h, kvh, hd, runs = 4, 256, 4, 2, 64, 6
  ids = np.zeros((b, t), np.int32)
  ids[0, :1], ids[0, 1:101], ids[0, 101:102] = 1, 2, 3            # then padding
  ids[1, 37:] = 7                                                # left padding
  ids[2] = 4
  ids[3] = np.repeat(np.arange(1, 9), t // 8)                    # 8 runs, M = 6
  seg = Segments.from_ids(ids, runs)
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, h, hd), jnp.bfloat16)
  k, v = (jax.random.normal(key, (b, t, kvh, hd), jnp.bfloat16) for key in keys[1:3])
  do = jax.random.normal(keys[3], (b, t, h, hd), jnp.bfloat16)
  mask = seg.attention_mask_b1tt()

  def packed(q, k, v):
    return packed_attention.attend(q, k, v, *packed_attention.cudnn_layout(seg))

  def masked(q, k, v, impl="cudnn"):
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=impl)

  def value_and_grads(fn, *xs):
    out, vjp = jax.vjp(fn, *xs)
    return (out, *vjp(do.astype(out.dtype)))

  got = jax.jit(functools.partial(value_and_grads, packed))(q, k, v)
  base = jax.jit(functools.partial(value_and_grads, masked))(q, k, v)
  ref = jax.jit(functools.partial(value_and_grads, functools.partial(masked, impl="xla")))(
      *(x.astype(jnp.float32) for x in (q, k, v)))
  for name, g, m, r in zip(("o", "dq", "dk", "dv"), got, base, ref):
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    err, err_mask = _rel_err(g, r), _rel_err(m, r)
    assert err <= 1.5 * err_mask + 2.0 ** -8, (name, err, err_mask)
  for pos in (0, 101):  # one-token documents of row 0: the output is the token's value
    np.testing.assert_allclose(np.asarray(got[0][0, pos], np.float32),
                               np.repeat(np.asarray(v[0, pos], np.float32), h // kvh, axis=0),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_gpu_layer_packed_path_matches_mask():
  """The bf16 layer on the packed path (the default where `DEFAULT_ON_GPU` is set): full
  passes with documents and a left-padded prefill of odd length equal the mask path's
  (same parameters)."""
  layers = {d: CausalSelfAttention(64, 4, 2, 64, dtype=jnp.bfloat16, documents=d,
                                   rngs=nnx.Rngs(0)) for d in ("packed", "mask")}
  default = CausalSelfAttention(64, 4, 2, 64, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert layers["packed"].implementation == "cudnn"
  assert default.documents == ("packed" if packed_attention.DEFAULT_ON_GPU else "mask")
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 37, 64)), jnp.bfloat16)
  ids = Segments.from_ids(DOC_IDS.repeat(4, axis=1)[:, :37], DOC_RUNS)
  valid = np.arange(37)[None, :] >= np.array([[0], [5], [36], [17]])
  full = {d: nnx.jit(lambda m, x, s: m(x, s)[0])(layer, x, ids) for d, layer in layers.items()}
  pre = {d: nnx.jit(lambda m, x, v: m.prefill(x, 40, v)[0])(layer, x, valid)
         for d, layer in layers.items()}
  for out in (full, pre):
    ref = np.asarray(out["mask"], np.float32)
    np.testing.assert_allclose(np.asarray(out["packed"], np.float32), ref, rtol=0,
                               atol=2e-2 * np.abs(ref).max())


@pytest.mark.gpu
def test_gpu_packed_layout_with_the_batch_split():
  """On two GPUs with the batch split, each device's cuDNN call takes its own rows' runs:
  the layer's output and input gradient equal the mask path's under the same mesh."""
  from k3jax.sharding import rules  # pylint: disable=g-import-not-at-top
  from k3jax.sharding.mesh import MeshConfig, make_mesh  # pylint: disable=g-import-not-at-top
  if len(jax.devices()) < 2:
    pytest.skip("needs two GPUs")
  mesh = make_mesh(MeshConfig(data=2), devices=jax.devices()[:2])
  x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 48, 64)), jnp.bfloat16)
  seg = Segments.from_ids(DOC_IDS.repeat(4, axis=1), DOC_RUNS)
  out = {}
  for documents in ("packed", "mask"):
    graphdef, state = nnx.split(CausalSelfAttention(64, 4, 2, 64, dtype=jnp.bfloat16,
                                                    documents=documents, rngs=nnx.Rngs(0)))

    @jax.jit
    def value_and_grad(state, x, seg, graphdef=graphdef):
      def f(x):
        x = rules.constrain(x, ("batch", "length", "embed"))
        return nnx.merge(graphdef, state)(x, seg)[0].astype(jnp.float32)
      y, vjp = jax.vjp(f, x)
      return y, vjp(jnp.ones_like(y))[0]

    with jax.set_mesh(mesh):
      out[documents] = [np.asarray(a, np.float32) for a in value_and_grad(state, x, seg)]
  for got, ref in zip(out["packed"], out["mask"]):
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-2 * np.abs(ref).max())
