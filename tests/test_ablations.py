"""Ablation library: sweep configs, run-or-load, metrics loaders, evaluations, summary tables."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.ablations import evaluate, record, runs, summary, sweeps
from k3jax.models.lm import HybridLM
from k3jax.train.config_schema import model_config_from, validate
from k3jax.train.defaults import base_config
from k3jax.train.metrics import MetricWriter


# -- sweep definitions ------------------------------------------------------------------


@pytest.mark.parametrize("setting", sweeps.SETTINGS)
def test_every_sweep_config_validates(setting):
  keys = []
  for name in sweeps.ALL_SWEEPS:
    sweep = sweeps.make_sweep(name, setting)
    assert sweep.seeds == ((0,) if setting == "quick" else (0, 1, 2))
    for spec in sweep.runs():
      config = spec.config()
      model = validate(config)  # raises on a bad field or an unsafe (lower bound, tile) pair
      assert config.seed == spec.seed
      if name in ("decay", "long") and model.gate == "bounded":
        assert abs(model.kda.lower_bound) * (model.kda.sub_chunk - 1) <= 85
      keys.append(spec.key)
  assert len(keys) == len(set(keys))


def test_full_sweeps_cover_the_arms():
  decay = sweeps.make_sweep("decay", "full")
  assert {v.name for v in decay.variants} == {"softplus", "g1.3_t64", "g2.5_t32", "g5_t16"}
  assert {t.name for t in decay.tasks} == {"mqar", "bytes"} and decay.length_multipliers == (1, 4, 16)
  router = sweeps.make_sweep("router", "full")
  assert [v.name for v in router.variants] == ["quantile", "quantile_lagged", "bias_sign", "aux_loss"]
  residual = sweeps.make_sweep("residual", "full")
  assert {(v.tag("residual"), v.tag("depth")) for v in residual.variants} == {
      (r, d) for r in ("prenorm", "block_attnres", "full_attnres") for d in (4, 8)}


@pytest.mark.parametrize("setting", sweeps.SETTINGS)
def test_long_sweep_arms_differ_only_where_intended(setting):
  sweep = sweeps.make_sweep("long", setting)
  assert [v.name for v in sweep.variants] == ["bounded", "softplus", "attention"]
  assert sweep.length_multipliers == (1, 4, 16, 64) and sweep.gap_multipliers == (8, 16, 32, 64)
  configs = {v.name: sweeps.RunSpec("long", setting, v, sweep.tasks[0], 0, sweep.base).config().to_dict()
             for v in sweep.variants}
  flat = lambda d, p="": {k2: v2 for k, v in d.items() for k2, v2 in (
      flat(v, f"{p}{k}.").items() if isinstance(v, dict) else [(p + k, v)])}
  b, s, a = (flat(configs[n]) for n in ("bounded", "softplus", "attention"))
  assert {k for k in b if b[k] != s[k]} == {"model.kda.lower_bound", "model.kda.diagonal"}
  assert set(validate(sweeps.RunSpec("long", setting, sweep.variant("attention"), sweep.tasks[0], 0,
                                     sweep.base).config()).layer_types) == {"A"}
  assert "model.layer_pattern" in {k for k in b if b[k] != a[k]}
  assert b["seq_len"] == (2048 if setting == "full" else 64)
  # run_ablations' default stays the three ablations; "long" is asked for by name.
  assert "long" not in sweeps.SWEEPS and "long" in sweeps.ALL_SWEEPS


def test_bad_names_and_overrides_raise():
  with pytest.raises(ValueError, match="allowed"):
    sweeps.make_sweep("decay", "medium")
  with pytest.raises(ValueError, match="sweep name"):
    sweeps.make_sweep("dropout")
  with pytest.raises(ValueError, match="no field 'gmin'"):
    sweeps.apply_overrides(base_config(), (("model.gmin", -5.0),))
  with pytest.raises(ValueError, match="seeds"):
    sweeps.make_sweep("router", "quick", (-1,))


# -- run-or-load ---------------------------------------------------------------------------


def _fake_training(calls):
  """Stands in for train_and_evaluate: writes eval records up to num_steps and a checkpoint dir."""
  def train(config, workdir):
    calls.append(workdir)
    os.makedirs(os.path.join(workdir, "checkpoints"), exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    writer = MetricWriter(workdir, tensorboard=False)
    writer.write(config.num_steps, "eval", {"loss": 1.0})
    writer.close()
    return {"interrupted": False, "step": config.num_steps}
  return train


def test_run_or_load_trains_once_then_loads(tmp_path, monkeypatch):
  calls, summaries = [], []
  import k3jax.train.trainer as trainer
  monkeypatch.setattr(trainer, "train_and_evaluate", _fake_training(calls))
  monkeypatch.setattr(record, "summarize_run",
                      lambda spec, workdir, out: summaries.append(workdir) or {"key": spec.key, "step": 40})
  spec = sweeps.make_sweep("router", "quick").runs()[0]
  first = record.run_or_load(spec, str(tmp_path))
  second = record.run_or_load(spec, str(tmp_path))
  assert first == second == {"key": spec.key, "step": 40}
  assert len(calls) == 1 and len(summaries) == 1  # the second call trained and evaluated nothing
  # A different config in the same directory is refused rather than mixed in.
  other = sweeps.RunSpec(spec.sweep, spec.setting, spec.variant, spec.task, spec.seed,
                         spec.base + (("optim.learning_rate", 1e-4),))
  with pytest.raises(ValueError, match="different config"):
    record.run_or_load(other, str(tmp_path))


def test_unfinished_run_is_trained_again(tmp_path, monkeypatch):
  calls = []
  import k3jax.train.trainer as trainer
  monkeypatch.setattr(trainer, "train_and_evaluate", _fake_training(calls))
  spec = sweeps.make_sweep("router", "quick").runs()[0]
  workdir = runs.workdir_of(spec, str(tmp_path))
  writer = MetricWriter(workdir, tensorboard=False)
  writer.write(20, "eval", {"loss": 2.0})  # stopped half-way
  writer.close()
  assert not runs.is_finished(workdir, 40)
  runs.train_run(spec, str(tmp_path))
  assert calls == [workdir] and runs.is_finished(workdir, 40)


def test_load_metrics_keeps_last_record_per_step(tmp_path):
  writer = MetricWriter(str(tmp_path), tensorboard=False)
  writer.write(5, "train", {"loss": 3.0, "router/0/max_vio": 0.5, "router/1/max_vio": 0.25})
  writer.write(10, "train", {"loss": 2.0, "router/0/max_vio": 0.3, "router/1/max_vio": float("nan")})
  writer.write(10, "train", {"loss": 1.5, "router/0/max_vio": 0.1, "router/1/max_vio": 0.2})  # resumed
  writer.write(15, "train", {"loss": 1.0, "router/0/max_vio": 0.2})
  writer.close()
  m = runs.load_metrics(str(tmp_path), "train")
  np.testing.assert_array_equal(m["loss"].steps, [5, 10, 15])
  np.testing.assert_array_equal(m["loss"].values, [3.0, 1.5, 1.0])
  layers = runs.per_layer(m, "max_vio")
  assert sorted(layers) == [0, 1]
  assert math.isnan(layers[1].values[2])
  assert runs.tail_mean(layers[0], 2 / 3) == pytest.approx(0.15)
  assert runs.tail_mean(layers[1], 1.0) == pytest.approx((0.25 + 0.2) / 2)  # NaN skipped
  with pytest.raises(ValueError, match="does not exist"):
    runs.load_metrics(str(tmp_path / "nothing"), "train")


# -- evaluations through the model API ----------------------------------------------------------


def _tiny_model(residual="prenorm", router=None, layers=2, seed=0):
  c = base_config()
  m = c.model
  m.update(d_model=16, num_layers=layers, layer_pattern="A", num_heads=2, head_dim=8, num_kv_heads=2,
           num_experts=0, dense_hidden=32, first_layer_dense=False, residual=residual,
           attnres_block_size=2)
  if router is not None:
    m.update(num_experts=4, top_k=2, expert_hidden=16, num_shared_experts=0)
    m.router.update(router)
  return HybridLM(model_config_from(m), rngs=nnx.Rngs(seed)), c


@pytest.mark.parametrize("residual", ["prenorm", "block_attnres", "full_attnres"])
def test_trace_layers_reproduces_the_forward(residual):
  model, _ = _tiny_model(residual, layers=3)
  # Non-zero pseudo-queries so the AttnRes mixtures are not uniform averages.
  for path, var in nnx.to_flat_state(nnx.state(model.residual, nnx.Param)):
    var.set_value(jax.random.normal(jax.random.key(len(path)), var.get_value().shape))
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
  graphdef, state = nnx.split(model)

  @jax.jit
  def both(state, tokens):
    m = nnx.merge(graphdef, state)
    return m(tokens, deterministic=True)[0], evaluate.trace_layers(m, tokens)

  logits, tr = both(state, tokens)
  np.testing.assert_allclose(tr["logits"], logits, rtol=1e-6, atol=1e-6)
  assert len(tr["stream"]) == 4 and len(tr["sublayer_out"]) == 6
  np.testing.assert_array_equal(tr["stream"][0], np.asarray(model.embed[...])[np.asarray(tokens)])
  expected_stored = {"prenorm": 1, "full_attnres": 7, "block_attnres": 4}[residual]  # 6 sublayers, blocks of 2
  assert int(tr["max_stored"]) == expected_stored


def test_depth_profile_against_numpy():
  model, _ = _tiny_model("full_attnres", layers=2)
  tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 8), 0, 256))
  prof = evaluate.depth_profile(model, tokens)
  tr = jax.jit(lambda s, t: evaluate.trace_layers(nnx.merge(nnx.graphdef(model), s), t))(
      nnx.state(model), tokens)
  s = [np.asarray(h, np.float64) for h in tr["stream"]]
  rms = [np.sqrt(np.mean(h ** 2)) for h in s]
  cos = [np.mean(np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)))
         for a, b in zip(s[:-1], s[1:])]
  np.testing.assert_allclose(prof["stream_rms"], rms, rtol=1e-5)
  np.testing.assert_allclose(prof["cos_next"], cos, rtol=1e-5, atol=1e-6)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert prof["param_bytes"] == 4 * n_params
  assert prof["max_stored"] == 5 and prof["max_keys"] == 5  # embedding + 4 sublayer outputs
  assert prof["residual_bytes_per_token"] == 16 * (5 * 4 + 5 * 4)


def test_routing_leak_separates_causal_and_batch_routers():
  tokens = np.asarray(jax.random.randint(jax.random.key(3), (4, 16), 0, 256))
  causal, _ = _tiny_model(router=dict(name="topk", capacity_factor=0.0), layers=1)
  leak = evaluate.routing_leak(causal, tokens, position=7)
  assert leak["noise"] == 0.0 and leak["changed_fraction"] == 0.0 and leak["max_logit_change"] == 0.0
  # A same-batch capacity shared by 64 tokens: replacing half a sequence moves others' routing.
  shared, _ = _tiny_model(router=dict(name="quantile", capacity_factor=1.0), layers=1)
  leak = evaluate.routing_leak(shared, tokens, position=7)
  assert leak["noise"] == 0.0
  assert leak["changed_fraction"] > 0 and leak["max_logit_change"] > 0
  with pytest.raises(ValueError, match="position"):
    evaluate.routing_leak(shared, tokens, position=15)


def test_mqar_with_gap_keeps_the_recall_problem():
  from k3jax.data import mqar_examples
  same = evaluate.mqar_with_gap(np.random.default_rng(0), 3, 24, 24, vocab_size=64, num_kv_pairs=4)
  ref = mqar_examples(np.random.default_rng(0), 3, 24, vocab_size=64, num_kv_pairs=4)
  for k in ref:
    np.testing.assert_array_equal(same[k], ref[k])
  b = evaluate.mqar_with_gap(np.random.default_rng(0), 3, 24, 96, vocab_size=64, num_kv_pairs=4)
  assert b["inputs"].shape == (3, 96)
  np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
  np.testing.assert_array_equal(b["inputs"][:, 8:80], 0)  # the gap
  assert b["mask"][:, :80].sum() == 0 and b["mask"].sum() == ref["mask"].sum()
  for row in range(3):
    pairs = dict(zip(b["inputs"][row, 0:8:2], b["inputs"][row, 1:8:2]))
    for pos in np.flatnonzero(b["mask"][row]):
      assert pairs[b["inputs"][row, pos]] == b["targets"][row, pos]  # a queried key -> its value
  with pytest.raises(ValueError, match="train_len"):
    evaluate.mqar_with_gap(np.random.default_rng(0), 1, 24, 16, vocab_size=64, num_kv_pairs=4)


def test_eval_at_length_matches_a_direct_computation():
  model, config = _tiny_model(layers=1)
  config.seq_len, config.batch_size, config.eval_batches = 16, 4, 2
  config.data.update(kind="mqar", vocab_size=256, mqar_num_kv_pairs=3)
  rec = evaluate.eval_at_length(model, config, 2)
  assert rec["seq_len"] == 32 and rec["finite"] == 1.0
  batches = evaluate.length_eval_batches(config, 2)
  assert len(batches) == 2 and batches[0]["inputs"].shape == (2, 32)
  nll = correct = count = 0.0
  max_logit = 0.0
  for b in batches:
    logits = np.asarray(model(jnp.asarray(b["inputs"]), deterministic=True)[0], np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.sum(np.exp(logits - top), -1, keepdims=True))
    tgt = np.take_along_axis(logp, b["targets"][..., None], -1)[..., 0]
    nll -= np.sum(tgt * b["mask"])
    correct += np.sum((logits.argmax(-1) == b["targets"]) * b["mask"])
    count += b["mask"].sum()
    max_logit = max(max_logit, np.abs(logits).max())
  assert rec["loss"] == pytest.approx(nll / count, rel=1e-5)
  assert rec["accuracy"] == pytest.approx(correct / count)
  assert rec["max_abs_logit"] == pytest.approx(max_logit, rel=1e-5)


# -- summary and results page ------------------------------------------------------------------


def _records():
  out = []
  for seed, (loss, vio, leak) in enumerate([(1.0, 0.1, 0.5), (2.0, 0.3, 0.25), (3.0, 0.2, 0.0)]):
    for variant in ("quantile", "aux_loss"):
      out.append({"key": f"router/{variant}/bytes/seed{seed}", "sweep": "router", "setting": "full",
                  "variant": variant, "task": "bytes", "seed": seed, "tags": {"router": variant},
                  "workdir": f"router/{variant}/bytes/seed{seed}", "final_eval": {"loss": loss, "bpb": None},
                  "router": {"max_vio": {"1": vio, "2": 2 * vio}, "max_vio_mean": 1.5 * vio,
                             "max_vio_routed_mean": vio, "drop_fraction_mean": 0.0},
                  "leak": {"changed_fraction": leak, "max_logit_change": leak}})
  return out


def test_mean_std_and_tables():
  assert summary.fmt([1.0, 2.0, 3.0]) == "2.000 ± 1.000"
  assert summary.fmt([2.5]) == "2.500"
  assert summary.fmt([None, float("nan")]) == "n/a"
  table = summary.router_table(_records())
  rows = [line for line in table.splitlines() if line.startswith("| quantile")]
  assert rows and "2.000 ± 1.000" in rows[0] and "0.2500 ± 0.2500" in rows[0]
  assert table.index("| quantile") < table.index("| aux_loss")  # the sweep's order, not alphabetical
  layers = summary.router_layer_table(_records())
  assert "MaxVio layer 1" in layers and "0.400 ± 0.200" in layers


def test_render_tables_and_summary_file(tmp_path):
  path = str(tmp_path / "summary.json")
  summary.write_summary(summary.make_summary(_records(), setting="full"), path)
  page = tmp_path / "results.md"
  page.write_text("# R\n<!-- table:meta -->\nold\n<!-- /table -->\n\n<!-- table:router -->\nold\n"
                  "<!-- /table -->\n<!-- table:decay -->\nold\n<!-- /table -->\ntail\n")
  text = summary.update_results_page(str(page), path)
  assert "old" not in text and text.endswith("tail\n")
  assert "6 runs (router)" in text and "_No decay runs in the summary._" in text
  assert summary.render_tables(text, summary.read_summary(path)) == text  # idempotent
  with pytest.raises(ValueError, match="unknown table"):
    summary.render_tables("<!-- table:speed -->\n<!-- /table -->", summary.read_summary(path))
  (tmp_path / "other.json").write_text(json.dumps({"runs": []}))
  with pytest.raises(ValueError, match="not an ablation summary"):
    summary.read_summary(str(tmp_path / "other.json"))


def test_combine_summaries_fills_missing_runs():
  recs = _records()
  first = summary.make_summary(recs[:4], setting="full")
  first.update(missing=[r["key"] for r in recs[4:]] + ["router/x/bytes/seed9"], wall_s=10.0, jobs=8)
  second = summary.make_summary(recs[3:], setting="full")
  second.update(missing=[], wall_s=5.0, jobs=4)
  both = summary.combine_summaries([first, second])
  assert [r["key"] for r in both["runs"]] == sorted(r["key"] for r in recs)
  assert both["missing"] == ["router/x/bytes/seed9"]
  assert both["wall_s"] == 15.0 and len(both["parts"]) == 2
  with pytest.raises(ValueError, match="different settings"):
    summary.combine_summaries([first, summary.make_summary([], setting="quick")])


def test_decay_arm_table_puts_both_tasks_of_a_gate_on_one_row():
  records = []
  for seed, (acc, bpb, finite) in enumerate([(0.9, 1.8, 1.0), (0.7, 2.0, 1.0)]):
    for task, metric, value in (("mqar", "accuracy", acc), ("bytes", "bpb", bpb)):
      lengths = {str(m): {metric: value / m, "finite": finite if task == "bytes" or seed == 0 else 0.0,
                          "max_abs_logit": 10.0 + seed + m} for m in (1, 4, 16)}
      records.append({"key": f"decay/softplus/{task}/seed{seed}", "sweep": "decay", "setting": "full",
                      "variant": "softplus", "task": task, "seed": seed, "lengths": lengths})
  rows = summary.decay_arm_table(records).splitlines()
  assert rows[2:] == ["| softplus | 2 | 0.800 ± 0.141 | 0.050 ± 0.009 | 1.900 ± 0.141 | 0.119 ± 0.009 "
                      "| **no** | 27.0 |"]


def test_tables_text_prints_every_full_table_of_the_summary_sweeps():
  text = summary.tables_text(summary.make_summary(_records(), setting="full"))
  assert "### router\n| router |" in text and "### router_layers\n| router | MaxVio layer 1" in text
  assert "### decay" not in text and "<!--" not in text and "6 runs (router)" in text


def test_committed_results_page_matches_its_summary():
  """docs/results.md's tables are exactly those rendered from docs/results/ablations_summary.json."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  data = summary.read_summary(os.path.join(root, "docs", "results", "ablations_summary.json"))
  with open(os.path.join(root, "docs", "results.md"), encoding="utf-8") as f:
    page = f.read()
  assert summary.render_tables(page, data) == page
  assert not data.get("missing") and len(data["runs"]) == 54
  documents = summary.read_summary(os.path.join(root, "docs", "results", "documents_summary.json"))
  assert summary.documents_table(summary.records_of(documents, "documents")) in page
