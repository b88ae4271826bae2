"""Documents packed in a row (`segment_ids`): every layer keeps them apart.

A packed row of documents with segment ids gives each document the logits and
the parameter gradient (of a loss on its own positions) it gets alone. "Alone"
is the document at the start of a row of its own, padding after it, in the
same batch; those rows equal the plain model's (no segment ids), since the
model is causal with the per-token dropless router used here.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import routing
from k3jax.layers.attention import CausalSelfAttention
from k3jax.layers.kda import KDA
from k3jax.layers.segments import Segments
from k3jax.models import lm
from k3jax.models.config import ModelConfig
from k3jax.parallel import context_parallel
from k3jax.parallel import layers as parallel_layers
from k3jax.parallel.pipelined_lm import PipelinedLM
from k3jax.routing import RouterConfig
from k3jax.sharding import rules
from k3jax.sharding.mesh import MeshConfig, make_mesh
from pallas_kernels.kda.spec import KdaSpec
from tests.call_counts import count_calls
from tests.kda_inputs import assert_close

TOL = 1e-5  # float32: the packed and the alone runs differ only in the order of sums
# The CPU backend's code generation unoptimised: the same XLA program, compiled faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
VOCAB, LENGTH = 32, 48
# Row 0: documents of 5, 23 and 17 tokens (on chunks of 16 the second and third cross
# chunk edges), then 3 padding tokens; row 1: 30 and 18 tokens, no padding. Rows 2-6:
# each document alone at the start of a row, padding after it.
ROWS = ((5, 23, 17), (30, 18))
PACKED = len(ROWS)
MAX_SEGMENTS = 4


def _config(impl="xla", **overrides):
  base = dict(vocab_size=VOCAB, d_model=32, num_layers=2, layer_pattern="KA", num_heads=2,
              head_dim=16, num_kv_heads=1, conv_size=4,
              kda=dict(chunk_size=16, sub_chunk=8, implementation=impl), num_experts=4, top_k=2, expert_hidden=16,
              num_shared_experts=1, dense_hidden=32, first_layer_dense=False,
              router=RouterConfig(name="topk", capacity_factor=None), moe_impl="ragged",
              residual="block_attnres", attnres_block_size=2)
  base.update(overrides)
  return ModelConfig.from_dict(base)


def _batch(seed=0):
  """tokens, segment ids [7, LENGTH] int32 (packed rows, then one row per document) and
  the documents [(packed row, start)]."""
  rng = np.random.default_rng(seed)
  docs = [(row, sum(lengths[:i])) for row, lengths in enumerate(ROWS) for i in range(len(lengths))]
  tokens = rng.integers(1, VOCAB, (PACKED + len(docs), LENGTH)).astype(np.int32)
  ids = np.zeros(tokens.shape, np.int32)
  for d, ((row, start), n) in enumerate(zip(docs, _lengths())):
    ids[row, start:start + n] = d + 1
    ids[PACKED + d, :n] = d + 1
    tokens[PACKED + d, :n] = tokens[row, start:start + n]
  return tokens, ids, docs


def _lengths():
  return [n for lengths in ROWS for n in lengths]


def _doc_mask(row, start, n):
  """[B, LENGTH] float32: the positions of a document whose next token it predicts."""
  mask = np.zeros((PACKED + len(_lengths()), LENGTH), np.float32)
  mask[row, start:start + n - 1] = 1.0
  return mask


@functools.cache
def _model(impl, **overrides):
  return lm.HybridLM(_config(impl, **overrides), rngs=nnx.Rngs(0))


@functools.cache
def _program(impl):
  """jit of (params, tokens, segment ids, loss mask [B, LENGTH]) -> (logits, aux, the
  parameter gradient of the masked next-token loss as {path: array})."""
  graphdef, params, rest = nnx.split(_model(impl), nnx.Param, ...)

  def run(params, tokens, ids, mask_bt):
    def loss(params):
      model = nnx.merge(graphdef, params, rest)
      logits, aux = model(tokens, segment_ids=ids, max_segments=MAX_SEGMENTS,
                          deterministic=True)
      logp = jax.nn.log_softmax(logits)
      nll = -jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
      return jnp.sum(mask_bt[:, :-1] * nll), (logits, aux)
    grads, (logits, aux) = jax.grad(loss, has_aux=True)(params)
    return logits, aux, grads

  jitted = jax.jit(run, compiler_options=FAST_COMPILE)
  return lambda *args: (lambda out: (*out[:2], dict(nnx.to_flat_state(out[2]))))(
      jitted(params, *args))


def _forward(model, max_segments=MAX_SEGMENTS):
  """jit (fast compile) of (tokens, segment ids) -> the model's deterministic (logits, aux)."""
  graphdef, state = nnx.split(model)
  run = jax.jit(lambda state, t, s: nnx.merge(graphdef, state)(
      t, segment_ids=s, max_segments=max_segments, deterministic=True),
                compiler_options=FAST_COMPILE)
  return functools.partial(run, state)


def _rel_max(got, ref) -> float:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


@pytest.mark.parametrize("impl", ["naive", "xla", "pallas"])
def test_packed_documents_equal_documents_alone(impl):
  """Logits and the parameter gradient of each document's loss, packed with segment ids
  against alone; the documents alone equal the plain model (no segment ids), whose packed
  rows differ; changing one document's tokens or the padding changes no other document
  (beyond rounding)."""
  tokens, ids, docs = _batch()
  program = _program(impl)
  logits, aux, _ = program(tokens, ids, _doc_mask(0, 0, 1))
  assert float(aux["segments/overflow_rows"]) == 0.0
  for d, ((row, start), n) in enumerate(zip(docs, _lengths())):
    err = _rel_max(logits[row, start:start + n], logits[PACKED + d, :n])
    assert err < TOL, f"document {d}: logits differ by {err:.2e} of their scale"
    _, _, grads = program(tokens, ids, _doc_mask(row, start, n))
    _, _, ref_grads = program(tokens, ids, _doc_mask(PACKED + d, 0, n))
    for path, ref in ref_grads.items():
      err = _rel_max(grads[path], ref)
      assert err < TOL, f"document {d}, d{path}: {err:.2e}"

  # The plain model: documents alone agree; packed without segment ids, the second
  # document of row 0 sees the first.
  plain, _ = _forward(_model(impl))(tokens, None)
  for d, n in enumerate(_lengths()):
    assert _rel_max(logits[PACKED + d, :n], plain[PACKED + d, :n]) < TOL, d
  _, start = docs[1]
  assert _rel_max(plain[0, start:start + 23], logits[0, start:start + 23]) > 1e-3

  # New tokens for document 1 (row 0) and for row 0's padding.
  changed = tokens.copy()
  changed[0, 5:28] = (changed[0, 5:28] + 7) % (VOCAB - 1) + 1
  changed[0, 45:] = (changed[0, 45:] + 3) % VOCAB
  logits2, _, _ = program(changed, ids, _doc_mask(0, 0, 1))
  # Document 2 shares chunk 1 with document 1: its masked chunk products read
  # document 1's cumulative gates, so it is equal to rounding only
  # (`test_kda_segment_ids.test_changing_one_run_changes_no_other`).
  assert _rel_max(logits2[0, 28:45], logits[0, 28:45]) < TOL
  np.testing.assert_array_equal(np.asarray(logits2[0, :5]), np.asarray(logits[0, :5]))
  np.testing.assert_array_equal(np.asarray(logits2[1:]), np.asarray(logits[1:]))
  assert _rel_max(logits2[0, 5:28], logits[0, 5:28]) > 1e-3


def test_without_segment_ids_the_model_traces_the_plain_path():
  """`segment_ids=None` is the program of a call that never names segments."""
  graphdef, state = nnx.split(_model("xla"))
  tokens = jnp.asarray(_batch()[0])
  plain = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t, deterministic=True))
  none = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(
      t, segment_ids=None, max_segments=None, deterministic=True))
  assert str(plain(state, tokens)) == str(none(state, tokens))


def test_layout_of_runs():
  ids = np.array([[3, 3, 1, 1, 1, 3, 0, 0],     # id 3 twice: two runs
                  [5, 5, 5, 5, 5, 5, 5, 5]], np.int32)
  seg = Segments.from_ids(ids)  # concrete ids: M counted (4)
  np.testing.assert_array_equal(seg.offsets_bm, [[0, 2, 5, 6, 8], [0, 8, 8, 8, 8]])
  np.testing.assert_array_equal(seg.run_bt[0], [0, 0, 1, 1, 1, 2, 3, 3])
  np.testing.assert_array_equal(seg.token_mask_bt()[0], ids[0] != 0)
  mask = np.asarray(seg.attention_mask_b1tt())[0, 0]
  assert mask[5, 5] and not mask[5, 0] and not mask[1, 2] and mask[7, 6] and not mask[6, 7]
  assert float(seg.overflow_rows()) == 0.0
  # Two segments a row: row 0's runs past the first merge into the second, and it is counted.
  small = Segments.from_ids(ids, 2)
  np.testing.assert_array_equal(small.offsets_bm, [[0, 2, 8], [0, 8, 8]])
  np.testing.assert_array_equal(small.run_bt[0], [0, 0, 1, 1, 1, 1, 1, 1])
  np.testing.assert_array_equal(small.overflow_b, [True, False])
  assert float(small.overflow_rows()) == 1.0
  # Traced ids need the bound; the error names the fix.
  with pytest.raises(ValueError, match=r"pass max_segments=.*max_documents_per_row \+ 1"):
    jax.jit(Segments.from_ids)(ids)
  with pytest.raises(ValueError, match="pass max_segments="):
    nnx.jit(lambda m, t, s: m(t, segment_ids=s))(_model("xla"), ids, ids)
  with pytest.raises(ValueError, match=r"segment_ids shape \(2, 7\) must equal"):
    _model("xla")(ids, segment_ids=ids[:, :7])


ROUTERS = [("quantile", dict(quantile_impl="radix")), ("quantile", dict(quantile_impl="exact")),
           ("quantile", dict(quantile_impl="histogram", num_bins=64)),
           ("quantile_lagged", {}), ("bias_sign", {}), ("aux_loss", {}),
           ("expert_choice", {}), ("topk", dict(capacity_factor=None))]


@pytest.mark.parametrize("name, extra", ROUTERS)
def test_router_routes_unmasked_tokens_as_if_alone(name, extra):
  """A token mask: the unmasked tokens route, weigh, update the state and measure exactly
  as the batch without the masked ones (capacity 1.0 binds; masked tokens get nothing)."""
  num_tokens, num_experts, k = 96, 8, 2
  rng = np.random.default_rng(1)
  scores = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(num_tokens, num_experts)), jnp.float32)
                          + jnp.linspace(0.0, 1.5, num_experts))
  valid = rng.random(num_tokens) > 0.3
  config = RouterConfig(name=name, **{"capacity_factor": 1.0, **extra})
  state = routing.init_router_state(num_experts, config)
  if state is not None:
    state = {"bias": jnp.asarray(rng.normal(size=num_experts) * 0.1, jnp.float32)}
  idx, w, stats, new = routing.route(scores, k=k, config=config, state=state,
                                     token_mask_t=jnp.asarray(valid))
  idx_a, w_a, stats_a, new_a = routing.route(scores[valid], k=k, config=config, state=state)
  np.testing.assert_array_equal(np.asarray(w)[~valid], 0.0)
  kept = np.asarray(w_a) > 0
  np.testing.assert_array_equal(np.asarray(w)[valid] > 0, kept)
  np.testing.assert_array_equal(np.asarray(idx)[valid][kept], np.asarray(idx_a)[kept])
  np.testing.assert_allclose(np.asarray(w)[valid], w_a, rtol=1e-6, atol=1e-7)
  assert sorted(stats) == sorted(stats_a)
  for key, value in stats.items():
    np.testing.assert_allclose(value, stats_a[key], rtol=1e-5, atol=1e-7, err_msg=key)
  if config.capacity_factor is not None:
    assert float(stats_a["drop_fraction"]) + float(stats_a["reassigned_fraction"]) > 0
  if new is not None:
    np.testing.assert_allclose(new["bias"], new_a["bias"], rtol=1e-6, atol=1e-7)


def test_buffered_moe_padding_takes_no_capacity():
  """Buffered experts under the quantile router at capacity 1.0: extra padding changes no
  real token's logits and no router statistic."""
  cfg = _config(layer_pattern="A", moe_impl="buffered",
                router=RouterConfig(name="quantile", capacity_factor=1.0))
  model = lm.HybridLM(cfg, rngs=nnx.Rngs(1))
  rng = np.random.default_rng(2)
  tokens = rng.integers(1, VOCAB, (2, 24)).astype(np.int32)
  ids = np.repeat([[1] * 10 + [2] * 14], 2, axis=0).astype(np.int32)
  padded_tokens = np.concatenate([tokens, rng.integers(0, VOCAB, (2, 8))], 1).astype(np.int32)
  padded_ids = np.concatenate([ids, np.zeros((2, 8), np.int32)], 1)
  padded_ids[1, 20:24] = 0  # row 1 ends its second document early: more padding
  ids[1, 20:24] = 0
  forward = _forward(model, max_segments=3)
  logits, aux = forward(tokens, ids)
  padded_logits, padded_aux = forward(padded_tokens, padded_ids)
  real = ids != 0
  np.testing.assert_allclose(np.asarray(padded_logits)[:, :24][real], np.asarray(logits)[real],
                             rtol=1e-5, atol=1e-5)
  router = sorted(key for key in aux if key.startswith("router/"))
  assert router and sorted(padded_aux) == sorted(aux)
  for key in router:
    np.testing.assert_allclose(padded_aux[key], aux[key], rtol=1e-5, atol=1e-6, err_msg=key)
  assert float(aux["router/0/drop_fraction"]) + float(aux["router/0/reassigned_fraction"]) > 0


def test_context_axis_refuses_segments():
  model = lm.HybridLM(_config(), rngs=nnx.Rngs(0), kda_class=parallel_layers.ContextParallelKDA)
  tokens, ids, _ = _batch()
  mesh = make_mesh(MeshConfig(data=1, context=2), devices=jax.devices()[:2])
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=r"context parallelism does not carry document "
                       r"segments; use parallel.context=1, or train without segment ids "
                       r"\(data.reset_at_boundaries=False\)"):
      nnx.jit(lambda m, t, s: m(t, segment_ids=s, max_segments=MAX_SEGMENTS))(model, tokens, ids)


def test_attention_with_heads_over_the_context_axis():
  """Attention's head re-layout on a context-2 mesh keeps the documents apart."""
  layer = CausalSelfAttention(32, 2, 2, 16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(4), (2, LENGTH, 32))
  seg = Segments.from_ids(_batch()[1][:PACKED])
  attend = nnx.jit(lambda m, x, s: m(x, s)[0])
  ref = attend(layer, x, seg)
  mesh = make_mesh(MeshConfig(data=2, context=2), devices=jax.devices()[:4])
  with jax.set_mesh(mesh):
    out = attend(layer, jax.device_put(x, rules.batch_sharding(mesh)), seg)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
  assert np.max(np.abs(np.asarray(ref - attend(layer, x, None)))) > 1e-3


def test_batch_split_pallas_kda_carries_segments(monkeypatch):
  """Context 1, batch over 2 devices: the Pallas calls run in shard_map on each device's
  rows with their run indices; the layer (fused gate) equals the one-device layer (XLA)."""
  calls = count_calls(monkeypatch, ((context_parallel, "_batch_sharded", "sharded"),))
  spec = KdaSpec(chunk_size=16, sub_chunk=8, lower_bound=-5.0, implementation="pallas")
  split = parallel_layers.ContextParallelKDA(32, 2, 16, spec=spec, fuse_gate=True,
                                             rngs=nnx.Rngs(0))
  plain = KDA(32, 2, 16, spec=dataclasses.replace(spec, implementation="xla"), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(5), (2, LENGTH, 32))
  seg = Segments.from_ids(_batch()[1][:PACKED], MAX_SEGMENTS)
  run = nnx.jit(lambda m, x, s: m(x, s)[0])
  ref = run(plain, x, seg)
  mesh = make_mesh(MeshConfig(data=2, context=1), devices=jax.devices()[:2])
  with jax.set_mesh(mesh):
    out = run(split, jax.device_put(x, rules.batch_sharding(mesh)), seg)
  assert calls["sharded"] == 1
  assert_close(out, ref, 2e-5, "layer output")  # Pallas against XLA, relative L2


def test_pipelined_model_carries_segments():
  """Two stages, two microbatches of rows with other documents: every stage's layers get
  their microbatch's documents."""
  plain = lm.HybridLM(_config(layer_pattern="A"), rngs=nnx.Rngs(3))
  piped = PipelinedLM(nnx.merge(*nnx.split(plain)), microbatches=2, stages=2)
  tokens, ids, _ = _batch(seed=4)  # 7 rows with other documents than their neighbours'
  tokens, ids = tokens[:6], ids[:6]
  ref_logits, ref_aux = _forward(plain)(tokens, ids)
  mesh = make_mesh(MeshConfig(stage=2, data=1), devices=jax.devices()[:2])
  with jax.set_mesh(mesh):
    logits, aux = _forward(piped)(tokens, ids)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-5)
  assert sorted(aux) == sorted(ref_aux)
  assert float(aux["segments/overflow_rows"]) == 0.0
  for key in ("router/0/drop_fraction", "router/1/reassigned_fraction"):  # means, not spreads
    np.testing.assert_allclose(aux[key], ref_aux[key], rtol=1e-5, atol=1e-7, err_msg=key)


def _assert_bf16_packed_documents_equal_documents_alone(attention: str):
  """bf16 compute, Pallas KDA kernels and `attention` with the documents: each document's
  logits in a packed row equal its logits alone to 5% of their scale (bf16 rounding).

  Every MoE layer routes each token to all of its experts (num_experts == top_k), so
  rounding cannot change which experts a token takes. With a top-2 router a near tie
  flips: document 1's first token (second and third scores 5e-3 apart) took another
  expert packed than alone, and its logits, with those of the next token, moved by that
  expert's contribution (6% of their scale) though every kernel was within rounding.
  The combine weights still follow the scores; sparse routing of documents is the
  subject of the float32 tests above (`test_router_routes_unmasked_tokens_as_if_alone`).

  The packed row and the documents alone run in one call, as in the float32 test: calls
  of batch 1 and batch 4 compile to different programs with their own bf16 roundings,
  which on the CPU raised the largest difference of three token draws from 2.5-4.0% to
  4.2-5.4% of the logits' scale (`test_packed_documents_equal_documents_alone` checks
  in float32 that the rows alone equal the plain model's).
  """
  cfg = ModelConfig.from_dict(dict(
      vocab_size=256, d_model=256, num_layers=4, layer_pattern="KKKA", num_heads=2,
      head_dim=128, num_kv_heads=2, num_experts=4, top_k=4, expert_hidden=256,
      dense_hidden=512, router=RouterConfig(name="topk", capacity_factor=None),
      residual="block_attnres", dtype="bfloat16",
      kda=dict(implementation="pallas", chunk_size=64, sub_chunk=16)))
  model = lm.HybridLM(cfg, rngs=nnx.Rngs(0))
  assert model.layers[3].mixer.implementation == attention
  lengths, length = (100, 333, 257, 210), 1024
  rng = np.random.default_rng(9)
  tokens = rng.integers(1, 256, (1, length)).astype(np.int32)
  # Row 0: the documents packed, then padding; row 1 + d: document d alone, then padding.
  tokens = np.concatenate([tokens, np.zeros((len(lengths), length), np.int32)])
  ids = np.zeros(tokens.shape, np.int32)
  start = 0
  for d, n in enumerate(lengths):
    ids[0, start:start + n] = ids[1 + d, :n] = d + 1
    tokens[1 + d, :n] = tokens[0, start:start + n]
    start += n
  forward = nnx.jit(lambda m, t, s: m(t, segment_ids=s, max_segments=5, deterministic=True)[0])
  logits = np.asarray(forward(model, tokens, ids))
  start = 0
  for d, n in enumerate(lengths):
    a, b = logits[0, start:start + n], logits[1 + d, :n]
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=0, atol=5e-2 * np.abs(b).max(), err_msg=f"doc {d}")
    start += n


@pytest.mark.slow
def test_bf16_packed_documents_equal_documents_alone():
  """The GPU twin's model on the CPU: interpreted Pallas KDA kernels, XLA attention."""
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU twin of test_gpu_packed_documents_equal_documents_alone")
  _assert_bf16_packed_documents_equal_documents_alone("xla")


@pytest.mark.gpu
def test_gpu_packed_documents_equal_documents_alone():
  """bf16 compute, Pallas KDA kernels and cuDNN attention with the document mask."""
  _assert_bf16_packed_documents_equal_documents_alone("cudnn")
