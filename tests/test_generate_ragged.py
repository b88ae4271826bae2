"""Generation from prompts of several lengths (k3jax.models.generate): each row as if alone, per-row stops."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.models import generate as gen
from k3jax.models import lm
from k3jax.models.config import ModelConfig
from k3jax.routing import RouterConfig
from pallas_kernels.kda.spec import KdaSpec

VOCAB = 32
NEW = 5
# Off the KDA chunk grid (16), on both sides of one chunk, and a single token (the
# pallas kernels take chunks of 16 or more).
PROMPTS = [[int(t) for t in np.random.default_rng(n).integers(0, VOCAB, n)] for n in (19, 1, 6)]


def _model(implementation: str) -> lm.HybridLM:
  # K, A, K layers, MoE with a per-token (dropless top-k) router: each token's
  # result depends on its own sequence only.
  cfg = ModelConfig(vocab_size=VOCAB, d_model=16, num_layers=3, layer_pattern="KA", num_heads=2,
                    head_dim=8, num_kv_heads=1, conv_size=3,
                    kda=KdaSpec(chunk_size=16, sub_chunk=8, lower_bound=-5.0,
                                implementation=implementation),
                    num_experts=4, top_k=2, expert_hidden=16, num_shared_experts=1,
                    dense_hidden=32, router=RouterConfig(name="topk", capacity_factor=None))
  return lm.HybridLM(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def model():
  return _model("xla")


@pytest.fixture(scope="module")
def greedy(model):
  """Greedy continuations of PROMPTS as one ragged batch, with no eos or stop."""
  return [c.tokens for c in gen.generate(model, PROMPTS, max_new_tokens=NEW, temperature=0.0)]


def test_ragged_batch_equals_each_prompt_alone(model, greedy):
  for prompt, row in zip(PROMPTS, greedy):
    alone = gen.generate(model, [prompt], max_new_tokens=NEW, temperature=0.0)[0]
    assert alone.finish_reason == "length"
    assert row == alone.tokens, f"prompt of length {len(prompt)}"


def test_ragged_batch_under_the_pallas_kernels_equals_each_prompt_alone(greedy):
  """The chunked KDA kernels, interpreted on the CPU, on the padded batch and on the single-token
  prompt alone (shorter than the kernels' chunk of 16): each row is the XLA batch's, which the test
  above shows is the prompt alone. An interpreted prefill takes ~15 s to compile on a 2-core CPU,
  so the other two prompts are run alone under XLA only."""
  m = _model("pallas")
  batch = gen.generate(m, PROMPTS, max_new_tokens=NEW, temperature=0.0)
  assert [c.tokens for c in batch] == greedy
  single = PROMPTS.index(min(PROMPTS, key=len))
  alone = gen.generate(m, [PROMPTS[single]], max_new_tokens=NEW, temperature=0.0)[0]
  assert (alone.tokens, alone.finish_reason) == (greedy[single], "length")


def test_ragged_prefill_gives_each_row_its_own_logits_and_cache(model):
  tokens, lengths = gen.prompt_batch(PROMPTS, VOCAB)
  prefill = nnx.jit(lambda m, t, n: m.prefill(t, t.shape[1] + 2, lengths_b=n))
  logits, cache = prefill(model, tokens, lengths)
  for b, prompt in enumerate(PROMPTS):
    alone_logits, alone_cache = prefill(model, np.asarray([prompt], np.int32),
                                        np.asarray([len(prompt)], np.int32))
    np.testing.assert_allclose(logits[b, -1], alone_logits[0, -1], rtol=1e-5, atol=1e-5)
    for kda, alone in ((cache[0], alone_cache[0]), (cache[2], alone_cache[2])):
      np.testing.assert_allclose(kda["state"][b], alone["state"][0], rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(kda["conv_k"][b], alone["conv_k"][0], rtol=1e-5, atol=1e-6)
      if len(prompt) == 1:  # the window's older slot is the zero before the sequence, not padding
        assert not np.any(kda["conv_k"][b, 0])
    start = int(cache[1]["start"][b])
    assert start == tokens.shape[1] - len(prompt)
    np.testing.assert_allclose(cache[1]["k"][b, start:start + len(prompt)],
                               alone_cache[1]["k"][0, :len(prompt)], rtol=1e-5, atol=1e-6)


def _cut_at(tokens, seq):
  """tokens up to the first occurrence of seq, and whether it occurred."""
  for i in range(len(tokens) - len(seq) + 1):
    if tokens[i:i + len(seq)] == list(seq):
      return tokens[:i], True
  return tokens, False


def test_eos_stops_a_row_while_the_others_continue(model, greedy):
  eos = greedy[0][1]
  out = gen.generate(model, PROMPTS, max_new_tokens=NEW, temperature=0.0, eos_id=eos)
  reasons = []
  for row, c in zip(greedy, out):
    want, hit = _cut_at(row, [eos])
    assert c.tokens == want
    reasons.append(c.finish_reason)
    assert c.finish_reason == ("eos" if hit else "length")
  assert reasons[0] == "eos" and "length" in reasons, reasons


def test_a_stop_sequence_ends_its_row_and_is_dropped(model, greedy):
  stop = greedy[2][1:3]
  out = gen.generate(model, PROMPTS, max_new_tokens=NEW, temperature=0.0,
                     stop_sequences=[stop, [VOCAB - 1] * 4])
  for row, c in zip(greedy, out):
    want, hit = _cut_at(row, stop)
    assert (c.tokens, c.finish_reason) == (want, "stop" if hit else "length")
  assert out[2].finish_reason == "stop"


def test_streaming_in_steps_shows_the_same_tokens(model, greedy):
  stop = greedy[2][1:3]
  g = gen.Generation(model, PROMPTS, max_new_tokens=NEW, temperature=0.0, stop_sequences=[stop])
  shown = [[] for _ in PROMPTS]
  while not g.done:
    for row, new in enumerate(g.advance(2)):
      shown[row] += new
    g.stop(1)  # the host ends row 1 after its first tokens
  results = g.results()
  assert [c.tokens for c in results] == shown
  assert shown[0] == greedy[0] and shown[2] == _cut_at(greedy[2], stop)[0]
  assert results[1].finish_reason == "stop" and shown[1] == greedy[1][:2]


def test_tiny_top_p_is_greedy(model, greedy):
  out = gen.generate(model, PROMPTS, max_new_tokens=NEW, temperature=1.0, top_p=1e-6,
                     key=jax.random.key(3))
  assert [c.tokens for c in out] == greedy


def test_top_p_draws_only_from_the_nucleus():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 256, jnp.float32))
  draws = np.asarray(gen.sample_logits(logits, jax.random.key(0), top_p=0.75))
  assert set(draws.tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.75
  draws = np.asarray(gen.sample_logits(logits, jax.random.key(0), top_p=1.0))
  assert set(draws.tolist()) == {0, 1, 2, 3}
