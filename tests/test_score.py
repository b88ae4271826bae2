"""Scores of packed requests (`k3jax.models.score`) against each request's own forward pass.

The model is a tiny random HybridLM on the chunked xla KDA path with a per-token dropless
router, so packed rows may share batches. A reference score is the log-softmax of one
unbatched pass [1, n] of the request alone, without segment ids. Float32 tolerance: the two
differ only in the order of sums (chunk edges fall elsewhere in a packed row), about 1e-7 of
a total here; the bound, 2e-5 relative plus 1e-5, leaves room for other backends' orders.
"""
import functools
import math

import jax
import numpy as np
from flax import nnx

from k3jax.data.tokenizer import ByteTokenizer
from k3jax.models import lm
from k3jax.models import score
from k3jax.models.config import ModelConfig
from k3jax.routing import RouterConfig

VOCAB, SEQ_LEN = 256, 32
RTOL, ATOL = 2e-5, 1e-5


def _config(**overrides):
  base = dict(vocab_size=VOCAB, d_model=32, num_layers=2, layer_pattern="KA", num_heads=2,
              head_dim=16, num_kv_heads=1, conv_size=4,
              kda=dict(chunk_size=16, sub_chunk=8, implementation="xla"), num_experts=4, top_k=2, expert_hidden=16,
              num_shared_experts=1, dense_hidden=32, first_layer_dense=False,
              router=RouterConfig(name="topk", capacity_factor=None))
  base.update(overrides)
  return ModelConfig.from_dict(base)


@functools.cache
def _model():
  return lm.HybridLM(_config(), rngs=nnx.Rngs(0))


@functools.cache
def _alone_logp():
  """ids [1, n] -> float64 log-softmax [1, n, V] of the plain forward pass (no segment ids)."""
  graphdef, state = nnx.split(_model())
  run = jax.jit(lambda s, t: jax.nn.log_softmax(nnx.merge(graphdef, s)(t, deterministic=True)[0]))
  return lambda ids: np.asarray(run(state, ids), np.float64)


def _reference(context, continuation):
  """(summed log p, is greedy) of the continuation from one pass over the request alone."""
  ids = np.concatenate([context, continuation])[-(SEQ_LEN + 1):]
  logp_tv = _alone_logp()(ids[None, :-1].astype(np.int32))[0]
  rows = np.arange(len(ids) - 1)[-len(continuation):]
  targets = ids[1:][-len(continuation):]
  return logp_tv[rows, targets].sum(), bool(np.all(logp_tv[rows].argmax(-1) == targets))


def _requests(rng):
  """(context, continuation) pairs of 1 to 40 context tokens (some past a row) and 1 to 6
  continuation tokens; the last continuation is the model's greedy one."""
  out = [(rng.integers(1, VOCAB, rng.integers(1, 41)), rng.integers(1, VOCAB, rng.integers(1, 7)))
         for _ in range(9)]
  context = rng.integers(1, VOCAB, 12)
  greedy = []
  for _ in range(3):
    greedy.append(int(_alone_logp()(np.concatenate([context, greedy])[None].astype(np.int32))[0, -1]
                      .argmax()))
  return out + [(context, np.asarray(greedy))]


def test_packed_scores_equal_each_request_alone():
  requests = _requests(np.random.default_rng(0))
  got = score.continuation_logprobs(_model(), requests, seq_len=SEQ_LEN, batch_rows=2,
                                    max_documents_per_row=3)
  assert len(score.first_fit([min(len(c) + len(x) - 1, SEQ_LEN) for c, x in requests],
                             SEQ_LEN, 3)) < len(requests)  # rows were shared
  for i, (request, (logp, greedy)) in enumerate(zip(requests, got)):
    ref_logp, ref_greedy = _reference(*request)
    np.testing.assert_allclose(logp, ref_logp, rtol=RTOL, atol=ATOL, err_msg=f"request {i}")
    assert greedy == ref_greedy, i
  assert got[-1][1] and not got[0][1]


def test_two_requests_in_one_row_score_as_alone():
  rng = np.random.default_rng(1)
  a = (rng.integers(1, VOCAB, 9), rng.integers(1, VOCAB, 4))
  b = (rng.integers(1, VOCAB, 14), rng.integers(1, VOCAB, 3))
  assert score.first_fit([12, 16], SEQ_LEN, 2) == [[1, 0]]
  together = score.continuation_logprobs(_model(), [a, b], seq_len=SEQ_LEN, batch_rows=1,
                                         max_documents_per_row=2)
  alone = [score.continuation_logprobs(_model(), [r], seq_len=SEQ_LEN, batch_rows=1,
                                       max_documents_per_row=2)[0] for r in (a, b)]
  np.testing.assert_allclose([s for s, _ in together], [s for s, _ in alone], rtol=RTOL, atol=ATOL)


def test_batch_dependent_routers_score_each_request_alone():
  assert score.routes_per_token(_config())
  assert not score.routes_per_token(_config(router=RouterConfig(name="quantile")))
  assert not score.routes_per_token(_config(router=RouterConfig(name="topk", capacity_factor=1.25)))
  assert score.routes_per_token(_config(num_experts=0, router=RouterConfig(name="quantile")))


def test_windows_score_every_token_once_with_context():
  ids = list(range(1, 101))
  for first, overlap in ((1, 0), (1, 10), (1, 31), (60, 10), (90, 16)):
    pieces = score.windows(ids, first, SEQ_LEN, overlap)
    np.testing.assert_array_equal(np.concatenate([cont for _, cont in pieces]), ids[first:])
    for i, (context, cont) in enumerate(pieces):
      assert len(context) + len(cont) - 1 <= SEQ_LEN
      assert len(context) >= min(first, overlap + 1)
  # A continuation that fits: one piece, the context cut from the left.
  (context, cont), = score.windows(ids, 90, SEQ_LEN)
  np.testing.assert_array_equal(context, ids[100 - SEQ_LEN - 1:90])  # 33 tokens: 32 inputs
  assert score.windows([5], 1, SEQ_LEN) == []


def test_bits_per_byte_of_the_byte_tokenizer_is_mean_nll_over_bytes():
  tok = ByteTokenizer()
  text = "def f(x):\n  return x + 1\n"  # 26 bytes: one window
  logp_tv = _alone_logp()(np.asarray([[10] + list(text.encode())[:-1]], np.int32))[0]
  nll = -logp_tv[np.arange(len(text)), list(text.encode())]
  got = score.bits_per_byte(_model(), [text], tok, seq_len=SEQ_LEN, prefix_id=10)
  np.testing.assert_allclose(got["bits_per_byte"], nll.mean() / math.log(2.0), rtol=RTOL)
  assert got["bytes"] == len(text) == got["tokens"]

  # Without a prefix the first byte is context; long texts go by windows.
  texts = [text * 3, "x = 1\n"]
  got = score.bits_per_byte(_model(), texts, tok, seq_len=SEQ_LEN, overlap=8)
  total = score.rolling_logprobs(_model(), [tok.encode(t) for t in texts], seq_len=SEQ_LEN,
                                 overlap=8)
  assert got["bytes"] == sum(len(t) - 1 for t in texts)
  np.testing.assert_allclose(got["bits_per_byte"], -sum(total) / math.log(2.0) / got["bytes"],
                             rtol=1e-12)
