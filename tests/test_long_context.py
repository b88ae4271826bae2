"""Long-context evaluation (k3jax.ablations.long_context): buckets, non-finite counts, far-gap MQAR,
decode after a long prefill against the full forward, and the driver."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax.ablations import evaluate
from k3jax.ablations import long_context as lc
from k3jax.ablations import summary as summary_lib
from k3jax.models import lm
from k3jax.models.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 32


def _model(seed=0, **overrides):
  # K then A: a KDA state and an attention KV cache; chunk 16, so lengths below are not multiples.
  cfg = dict(vocab_size=VOCAB, d_model=16, num_layers=2, layer_pattern="KA", num_heads=2, head_dim=8,
             num_kv_heads=1, conv_size=3, kda=dict(chunk_size=16, sub_chunk=16, implementation="xla"),
             num_experts=0, dense_hidden=32, dtype="float32")
  return lm.HybridLM(ModelConfig.from_dict({**cfg, **overrides}), rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def model():
  return _model()


def _tokens(b, t, seed=0, vocab=VOCAB):
  return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


# -- bucketing -----------------------------------------------------------------------


def test_buckets_double_past_the_training_length_and_cover_every_position():
  assert lc.position_buckets(64, 64 * 64) == [(0, 64), (64, 128), (128, 256), (256, 512), (512, 1024),
                                               (1024, 2048), (2048, 4096)]
  assert lc.position_buckets(64, 200) == [(0, 64), (64, 128), (128, 200)]
  assert lc.position_buckets(64, 30) == [(0, 30)]
  assert lc.position_buckets(1, 5) == [(0, 1), (1, 2), (2, 4), (4, 5)]
  with pytest.raises(ValueError, match="train_len must be >= 1, got 0"):
    lc.position_buckets(0, 10)
  with pytest.raises(ValueError, match="seq_len must be >= 1, got 0"):
    lc.position_buckets(8, 0)


def test_bucket_stats_average_only_the_masked_positions_of_each_bucket():
  t = 40
  nll = np.tile(np.arange(t, dtype=np.float64), (2, 1))      # loss = position
  correct = (np.arange(t) % 2 == 0).astype(np.float64)[None].repeat(2, 0)
  mask = np.ones((2, t))
  mask[1, 10:20] = 0.0                                      # sequence 1 skips [10, 20)
  mask[:, 20:40] = 0.0                                      # nothing scored in the last bucket
  mask[:, 30] = 0.0
  got = lc.bucket_stats(nll, correct, mask, lc.position_buckets(10, t), 10)
  assert [(b["lo"], b["hi"], b["lo_x"], b["hi_x"]) for b in got] == [(0, 10, 0, 1), (10, 20, 1, 2),
                                                                      (20, 40, 2, 4)]
  assert got[0]["count"] == 20 and got[0]["loss"] == pytest.approx(4.5) and got[0]["accuracy"] == 0.5
  assert got[1]["count"] == 10 and got[1]["loss"] == pytest.approx(14.5)
  assert got[2]["count"] == 0 and np.isnan(got[2]["loss"])
  # A non-finite loss on a scored position makes its bucket's loss non-finite, not silently dropped.
  nll[0, 3] = np.nan
  assert np.isnan(lc.bucket_stats(nll, correct, mask, [(0, 10)], 10)[0]["loss"])
  with pytest.raises(ValueError, match="outside the 40 positions"):
    lc.bucket_stats(nll, correct, mask, [(0, 41)], 10)


# -- per-position statistics ------------------------------------------------------------


def test_logit_stats_count_each_poisoned_logit_and_skip_it_in_the_max():
  logits = np.random.default_rng(0).standard_normal((2, 10, 7)).astype(np.float32)
  targets = _tokens(2, 10, 1, vocab=7)
  clean_max = np.abs(logits).max(-1)
  logits[0, 3, 2] = np.nan
  logits[1, 9, 0] = np.inf
  logits[1, 9, 4] = -np.inf
  logits[1, 5, 6] = 1e6  # finite and the largest: must be reported
  out = {k: np.asarray(v) for k, v in lc.logit_stats(jnp.asarray(logits), jnp.asarray(targets)).items()}
  want = np.zeros((2, 10), np.int32)
  want[0, 3], want[1, 9] = 1, 2
  np.testing.assert_array_equal(out["nonfinite"], want)
  assert out["max_abs"][1, 5] == np.float32(1e6)
  assert np.isfinite(out["max_abs"]).all() and out["max_abs"][0, 3] <= clean_max[0, 3]
  ref = np.asarray(optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(logits), targets))
  ok = want == 0
  np.testing.assert_allclose(out["nll"][ok], ref[ok], rtol=1e-6)
  assert not np.isfinite(out["nll"][~ok]).any()


def test_chunked_head_equals_the_full_forward(model):
  tokens = _tokens(2, 51)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  full = np.asarray(model(jnp.asarray(inputs), deterministic=True)[0])
  out = lc.token_stats(model, inputs, targets, head_chunk=16)  # 50 = 3 x 16 + 2: a ragged last slice
  ref = np.asarray(optax.softmax_cross_entropy_with_integer_labels(full, targets))
  np.testing.assert_allclose(out["nll"], ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["max_abs"], np.abs(full).max(-1), rtol=1e-5)
  np.testing.assert_array_equal(out["correct"], (full.argmax(-1) == targets).astype(np.float32))
  assert out["nonfinite"].sum() == 0
  with pytest.raises(ValueError, match="head_chunk must be >= 1"):
    lc.token_stats(model, inputs, targets, head_chunk=0)


def test_a_poisoned_output_row_is_counted_at_every_position():
  m = _model(seed=2)
  assert m.config.tie_embeddings
  m.embed[3, 0] = jnp.inf  # logit 3 = inf * h_0 + ... at every position; inputs avoid token 3
  tokens = _tokens(1, 41, 3)
  tokens[tokens == 3] = 4
  out = lc.token_stats(m, tokens[:, :-1], tokens[:, 1:], head_chunk=16)
  np.testing.assert_array_equal(out["nonfinite"], np.ones((1, 40), np.int32))
  assert np.isfinite(out["max_abs"]).all()


# -- MQAR with the pairs far back --------------------------------------------------------


def test_far_gap_mqar_puts_the_gap_between_the_pairs_and_the_queries():
  train_len, pairs, gap = 24, 4, 8 * 24
  b = evaluate.mqar_with_gap(np.random.default_rng(0), 3, train_len, train_len + gap, vocab_size=VOCAB,
                             num_kv_pairs=pairs)
  x, y, mask = b["inputs"], b["targets"], b["mask"]
  assert x.shape == (3, train_len + gap)
  assert (x[:, 2 * pairs:2 * pairs + gap] == 0).all() and (mask[:, :2 * pairs + gap] == 0).all()
  for row in range(3):
    table = dict(zip(x[row, 0:2 * pairs:2], x[row, 1:2 * pairs:2]))
    queries = np.flatnonzero(mask[row])
    assert len(queries) == pairs and queries.min() == 2 * pairs + gap
    for q in queries:  # every query's target is its key's value, from gap + pairs tokens back
      assert y[row, q] == table[x[row, q]]


def test_mqar_far_recall_scores_each_query_once(model):
  out = lc.mqar_far_recall(model, train_len=24, gap=48, vocab_size=VOCAB, num_kv_pairs=4, num_sequences=2)
  assert out["seq_len"] == 72 and out["gap_x"] == 2.0 and out["count"] == 8
  assert 0.0 <= out["accuracy"] <= 1.0 and out["nonfinite_logits"] == 0 and out["max_abs_logit"] > 0
  with pytest.raises(ValueError, match="gap must be >= 0"):
    lc.mqar_far_recall(model, train_len=24, gap=-1, vocab_size=VOCAB, num_kv_pairs=4)


# -- decode after a long prefill -----------------------------------------------------------


def test_decode_after_a_prefill_matches_the_full_forward(model):
  # P = 300 (not a multiple of the 16-row chunk), then 16 decoded tokens.
  out = lc.decode_consistency(model, _tokens(1, 316, 5), 300)
  assert out["prefill_len"] == 300 and out["num_new"] == 16
  assert out["logits_rel_max"] < 1e-5 and out["prefill_rel_max"] < 1e-5
  assert out["argmax_agreement"] == 1.0
  assert set(out["cache_rel_max"]) == {"kda_state", "kda_conv", "attn_kv"}
  assert max(out["cache_rel_max"].values()) < 1e-5, out["cache_rel_max"]
  with pytest.raises(ValueError, match=r"prefill_len=316 must lie in \[1, T - 1 = 315\]"):
    lc.decode_consistency(model, _tokens(1, 316), 316)


# -- run directories, tables and the driver --------------------------------------------------


def _make_run_dir(workdir, **data):
  """A run directory as the trainer leaves it (config.json + a step-2 checkpoint), made without
  training: the tiny preset at seq_len 32 with `data` fields overridden."""
  import jax
  from k3jax.train import checkpoint as ckpt_lib
  from k3jax.train.config_schema import model_config_from
  from k3jax.train.optimizer import make_optimizer
  from k3jax.train.run_config import write_config
  from k3jax.train.state import create_train_state
  from tests.test_train import _shrunk_tiny
  c = _shrunk_tiny()
  c.data.update(data)
  # A per-token dropless router: a batch capacity would make outputs depend on the other tokens
  # of the forward, and decoding could not match the full forward.
  c.model.router.name, c.model.router.capacity_factor = "topk", 0.0
  cfg = model_config_from(c.model)
  tx, _ = make_optimizer(c.optim, c.num_steps)
  _, state = create_train_state(lambda rngs: lm.HybridLM(cfg, rngs=rngs), tx, c.seed)
  mgr = ckpt_lib.Checkpointer(str(workdir / "checkpoints"), async_save=False)
  mgr.save(2, state.replace(step=jax.numpy.asarray(2, jax.numpy.int32)), {"iterator": {"position": 2}})
  mgr.close()
  write_config(str(workdir), c)
  return workdir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  return _make_run_dir(tmp_path_factory.mktemp("longrun"))


def test_evaluate_run_of_an_mqar_run_asks_recall_far_back(tmp_path):
  workdir = _make_run_dir(tmp_path, kind="mqar", vocab_size=256, mqar_num_kv_pairs=4)
  rec = lc.evaluate_run(str(workdir), gap_multipliers=(2,), mqar_sequences=2, decode_prefill_x=2,
                        decode_new=3)
  assert rec["data"] == "mqar" and "lengths" not in rec
  assert [(e["gap"], e["seq_len"], e["count"]) for e in rec["mqar"]] == [(0, 32, 8), (64, 96, 8)]
  assert rec["decode"]["prefill_len"] == 64 and rec["decode"]["logits_rel_max"] < 1e-4


def test_evaluate_run_buckets_each_length(run_dir):
  rec = lc.evaluate_run(str(run_dir), multipliers=(1, 3), decode_prefill_x=2, decode_new=5)
  assert rec["train_len"] == 32 and rec["step"] == 2 and rec["data"] == "bytes"
  assert rec["ffn"] == "moe topk cf=None"  # 0 in the ConfigDict: dropless
  assert [e["seq_len"] for e in rec["lengths"]] == [32, 96]
  assert [(b["lo"], b["hi"]) for b in rec["lengths"][1]["buckets"]] == [(0, 32), (32, 64), (64, 96)]
  assert all(e["nonfinite_logits"] == 0 for e in rec["lengths"])
  assert rec["decode"]["prefill_len"] == 64 and rec["decode"]["num_new"] == 5
  assert rec["decode"]["logits_rel_max"] < 1e-4
  with pytest.raises(ValueError, match="multipliers must be non-negative ints"):
    lc.evaluate_run(str(run_dir), multipliers=(1.5,))


def _record(variant, task, seed, loss):
  buckets = [{"lo": 0, "hi": 8, "lo_x": 0.0, "hi_x": 1.0, "count": 8, "loss": loss, "accuracy": 0.5},
             {"lo": 8, "hi": 16, "lo_x": 1.0, "hi_x": 2.0, "count": 8, "loss": loss + 1, "accuracy": 0.5}]
  long = ({"mqar": [{"gap_x": 8.0, "accuracy": loss / 10, "nonfinite_logits": 0, "max_abs_logit": 3.0}]}
          if task == "mqar" else
          {"lengths": [{"seq_len": 16, "multiplier": 2.0, "loss": loss + 0.5, "buckets": buckets,
                        "nonfinite_logits": seed, "max_abs_logit": 2.0 + seed}]})
  long["decode"] = {"prefill_len": 8, "num_new": 2, "logits_rel_max": 1e-6 * (seed + 1),
                    "argmax_agreement": 1.0, "cache_rel_max": {"kda_state": 2e-7, "attn_kv": 3e-7}}
  return {"key": f"long/{variant}/{task}/seed{seed}", "sweep": "long", "setting": "quick",
          "variant": variant, "task": task, "seed": seed, "long": long}


def test_long_tables_aggregate_seeds():
  records = [_record(v, t, s, loss) for v, loss in (("bounded", 1.0), ("softplus", 2.0))
             for t in ("bytes", "mqar") for s in (0, 1)]
  records[1]["long"]["lengths"][0]["buckets"][1]["loss"] = 3.0  # bounded seed 1, bucket [1x,2x)
  page = ("a\n<!-- long:text -->\nold\n<!-- /long -->\nb\n<!-- long:mqar -->\n<!-- /long -->\n"
          "<!-- long:decode -->\n<!-- /long -->")
  out = lc.render_long_tables(page, {"runs": records, "setting": "quick", "created": "now"})
  assert "old" not in out and out.startswith("a\n<!-- long:text -->\n| variant |")
  text_rows = [line for line in out.splitlines() if line.startswith("| bounded | 16 (2x)")]
  assert text_rows == ["| bounded | 16 (2x) | 2 | 1.500 ± 0.000 | 1.000 ± 0.000 | 2.500 ± 0.707 "
                       "|  |  |  |  |  | 1 | 3.0 |"]
  assert "| softplus | 2 | 0.200 ± 0.000 | 0 | 3.0 |" in out
  assert "| bounded | bytes | 2 | 8 | 2 | 2.0e-06 | 1.000 | 2.0e-07 | 3.0e-07 |" in out
  lengths = lc.render_long_tables("<!-- long:lengths -->\n<!-- /long -->", {"runs": records, "setting": "q",
                                                                           "created": ""})
  assert "| variant | seeds | loss @16 (2x) | non-finite logits | max abs logit |" in lengths
  assert "| bounded | 2 | 1.500 ± 0.000 | 1 | 3.0 |" in lengths and "| softplus |" in lengths
  with pytest.raises(ValueError, match="unknown long-context table 'nope'"):
    lc.render_long_tables("<!-- long:nope -->\n<!-- /long -->", {"runs": records, "setting": "q", "created": ""})


def test_driver_evaluates_run_directories(run_dir, tmp_path):
  summary = tmp_path / "long.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  res = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "long_context.py"),
                        f"--runs={run_dir}", "--names=tiny", "--multipliers=1,2", "--gaps=8",
                        "--decode_prefill_x=1", "--decode_new=3", f"--summary={summary}"],
                       capture_output=True, text=True, env=env, timeout=300, check=False)
  assert res.returncode == 0, res.stderr[-3000:]
  data = json.loads(summary.read_text())
  (rec,) = data["runs"]
  assert rec["variant"] == "tiny" and rec["task"] == "bytes" and rec["long"]["decode"]["num_new"] == 3
  assert [e["seq_len"] for e in rec["long"]["lengths"]] == [32, 64]
  assert "| tiny | 64 (2x) | 1 |" in res.stdout


def test_driver_combines_the_summaries_of_separate_calls(tmp_path):
  """One summary per call (e.g. one arm each) -> one summary and page; a later file wins per run."""
  paths = []
  for i, recs in enumerate(([_record("bounded", "bytes", 0, 1.0), _record("softplus", "bytes", 0, 2.0)],
                            [_record("softplus", "bytes", 0, 5.0)])):
    paths.append(str(tmp_path / f"call{i}.json"))
    summary_lib.write_summary(summary_lib.make_summary(recs, setting="quick"), paths[-1])
  page = tmp_path / "page.md"
  page.write_text("x\n<!-- long:text -->\n<!-- /long -->\n")
  out = tmp_path / "combined.json"
  script = os.path.join(ROOT, "experiments", "long_context.py")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  run = lambda *args: subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                                     env=env, timeout=300, check=False)
  res = run(f"--combine={','.join(paths)}", f"--summary={out}", f"--results_page={page}")
  assert res.returncode == 0, res.stderr[-3000:]
  runs = {r["variant"]: r for r in json.loads(out.read_text())["runs"]}
  assert sorted(runs) == ["bounded", "softplus"]
  assert runs["softplus"]["long"]["lengths"][0]["loss"] == 5.5   # the later call's record
  assert "| softplus | 16 (2x) | 1 |" in page.read_text()
  res = run(f"--combine={paths[0]}", f"--runs={tmp_path}", f"--summary={out}")
  assert res.returncode != 0 and "--combine needs --summary" in res.stderr


# -- GPU twins (skipped without a GPU) ---------------------------------------------------------


@pytest.mark.gpu
def test_gpu_decode_after_a_prefill_matches_the_full_forward_f32(model):
  import jax
  with jax.default_matmul_precision("highest"):  # no TF32: the same bound as on the CPU
    out = lc.decode_consistency(model, _tokens(1, 316, 5), 300)
  assert out["logits_rel_max"] < 1e-5 and max(out["cache_rel_max"].values()) < 1e-5, out


def test_decode_accuracy_of_a_float32_model_against_its_twin_is_rounding():
  m = _model(num_layers=3, layer_pattern="KKA")
  twin = lc.float32_twin(m)
  assert twin.config.kda.implementation == "naive" and twin.config.dtype == "float32"
  out = lc.decode_accuracy(m, twin, _tokens(1, 80, 9), 60, window=8)
  assert out["num_new"] == 20 and set(out["cache"]) == {"kda_state", "kda_conv", "attn_kv"}
  errors = [out[k] for k in ("full_rel_max", "decoded_rel_max", "decoded_first", "decoded_last")]
  errors += [e for kind in out["cache"].values() for e in kind.values()]
  assert max(errors) < 1e-5 and out["full_argmax"] == out["decoded_argmax"] == 1.0, out
  with pytest.raises(ValueError, match="window=30 must lie in"):
    lc.decode_accuracy(m, twin, _tokens(1, 80, 9), 60, window=30)


@pytest.mark.gpu
@pytest.mark.whole_gpu   # the float32 twin's attention scores alone are 8.7 GB
def test_gpu_decode_after_a_32k_prefill_is_as_accurate_as_the_full_pass():
  # The GPU model path: bf16 compute, Pallas chunked KDA, cuDNN attention; 32k prompt + 256 decoded.
  # Decode and full pass are each measured against the float32 twin: two bf16 evaluations each
  # 0.03-0.04 of the largest logit from it differ from each other by as much (docs/benchmarks.md,
  # "GPU tier"), so their difference bounds neither. The 1.25 allows for the spread of a maximum
  # over a few thousand rounding errors between two evaluations.
  m = _model(d_model=128, num_heads=2, head_dim=64, num_kv_heads=2,
             kda=dict(chunk_size=64, implementation="pallas"), dtype="bfloat16", num_layers=4,
             layer_pattern="KKKA")
  out = lc.decode_accuracy(m, lc.float32_twin(m), _tokens(1, 32768 + 256, 7), 32768, window=64)
  assert out["decoded_rel_max"] <= 1.25 * out["full_rel_max"], out
  assert out["decoded_last"] <= 1.25 * out["decoded_first"], out    # no drift over the decode
  assert out["decoded_argmax"] >= out["full_argmax"] - 0.02, out
  for kind, err in out["cache"].items():
    assert err["decoded"] <= 1.25 * err["prefill"], (kind, out)


@pytest.mark.gpu
def test_gpu_heldout_at_128k_tokens_is_finite():
  from k3jax.data import make_dataset
  from k3jax.train.defaults import base_config
  m = _model(vocab_size=256, d_model=128, num_heads=2, head_dim=64, num_kv_heads=2,
             kda=dict(chunk_size=64, implementation="pallas"), dtype="bfloat16", num_layers=4,
             layer_pattern="KKKA")
  data = base_config().data
  data.kind, data.max_bytes = "bytes", 0  # the whole stdlib tree: the held-out split holds 128k bytes
  corpus = make_dataset(data, seed=0)
  out = lc.heldout_at_length(m, corpus, train_len=2048, seq_len=131072, num_sequences=1)
  assert out["nonfinite_logits"] == 0 and len(out["buckets"]) == 7
  assert [b["hi"] for b in out["buckets"]][-1] == 131072


def test_committed_results_page_matches_its_long_context_summary():
  """docs/results.md's long-context tables are those rendered from the committed summary (GPU if present)."""
  results = os.path.join(ROOT, "docs", "results")
  path = os.path.join(results, "long_context_full.json")
  if not os.path.isfile(path):
    path = os.path.join(results, "long_context_quick.json")
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  with open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8") as f:
    page = f.read()
  assert "<!-- long:lengths -->" in page
  assert lc.render_long_tables(page, data) == page
