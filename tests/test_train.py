"""Trainer: smoke run on a shrunk `tiny`, exact resume after a signal, non-finite stop, the
run's config.json as the resume contract, honest logs and summaries, pieces."""
import json
import logging
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax.train import checkpoint as ckpt_lib
from k3jax.train import report
from k3jax.train import run_config
from k3jax.train.config_files import load_config_file
from k3jax.train.metrics import MetricWriter, read_jsonl
from k3jax.train.optimizer import make_optimizer
from k3jax.train.step import flatten_scalars, masked_cross_entropy
from k3jax.train.trainer import NonFiniteLossError, PastNumStepsError, train_and_evaluate
from tests.config_helpers import set_dotted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shrunk_tiny(**overrides):
  """configs/tiny.py made small enough for a CI test: 2 layers (KDA + attention), short sequences."""
  c = load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
  c.num_steps, c.batch_size, c.seq_len = 5, 8, 32
  c.num_devices = 1  # the 8 fake CPU devices would multiply compile time; data parallelism is tested below
  c.log_every = c.eval_every = c.checkpoint_every = 1
  c.eval_batches = 1
  c.progress_bar = False
  c.optim.warmup_steps = 1
  c.async_checkpoints = False
  c.data.max_bytes = 200_000
  c.model.update(num_layers=2, layer_pattern="KA", d_model=32, num_heads=2, head_dim=16,
                 num_kv_heads=2, kda=dict(chunk_size=16, sub_chunk=16), num_experts=4,
                 expert_hidden=32, dense_hidden=64, first_layer_dense=False)
  return set_dotted(c, overrides)


class _Counter(nnx.Variable):
  """Non-trainable state updated by the forward pass, as a stateful router's bias is."""


class _StandIn(nnx.Module):
  """Test-only byte LM: embedding, causal running mean, linear head; poisons logits after N calls."""

  def __init__(self, vocab, d, *, rngs, nan_after=-1):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.mix = nnx.Linear(d, d, rngs=rngs)
    self.out = nnx.Linear(d, vocab, rngs=rngs)
    self.calls = _Counter(jnp.zeros((), jnp.int32))
    self.nan_after = nan_after

  def __call__(self, tokens_bt, *, segment_ids=None, max_segments=None, deterministic=False):
    del max_segments
    h = self.embed(tokens_bt)
    # A causal running mean, within each document when the rows carry segment ids.
    t = tokens_bt.shape[1]
    seen_btt = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (tokens_bt.shape[0], t, t))
    if segment_ids is not None:
      seen_btt = seen_btt & (segment_ids[:, :, None] == segment_ids[:, None, :])
    weights = seen_btt / jnp.sum(seen_btt, axis=-1, keepdims=True)
    h = h + jnp.einsum("bts,bsd->btd", weights, jax.nn.gelu(self.mix(h)))
    logits = self.out(h).astype(jnp.float32)
    if not deterministic:
      self.calls[...] = self.calls[...] + 1
    if self.nan_after >= 0:
      logits = jnp.where(self.calls[...] > self.nan_after, jnp.nan, logits)
    return logits, {"aux_loss": jnp.float32(0.0), "router/0/max_vio": jnp.mean(h) ** 2}


def _stop_at(stop_step):
  """A hook that sends this process SIGTERM after `stop_step`, as a scheduler's preemption would."""
  def hook(step, metrics):
    del metrics
    if step == stop_step:
      os.kill(os.getpid(), signal.SIGTERM)
  return hook


# Both trainer tests share one config so that, in one process, the steps compile once.
_RESUME_OVERRIDES = {"checkpoint_every": 0, "eval_every": 0, "model.router.name": "quantile_lagged"}


def test_one_step_smoke_on_shrunk_tiny(tmp_path, caplog):
  c = _shrunk_tiny(**_RESUME_OVERRIDES)
  with caplog.at_level(logging.INFO, logger="k3jax.train.trainer"):
    result = train_and_evaluate(c, str(tmp_path), hooks=[_stop_at(1)])
  assert result["step"] == 1 and result["interrupted"]
  # No progress bar: the step and eval lines go to the log.
  assert "step 1/5 loss=" in caplog.text and "eval at step 0: accuracy=" in caplog.text
  assert "bpb=" in caplog.text
  # The summary labels the step-0 evaluation as such, never as final.
  line = report.summary(result)
  assert "eval at step 0:" in line and "final" not in line
  assert "preempted by SIGTERM at step 1" in line and "latest evaluation is from step 0" in line
  assert result["signal"] == "SIGTERM"
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["model"]["layer_pattern"] == "KA" and saved["num_steps"] == 5
  train = read_jsonl(str(tmp_path / "metrics.jsonl"), "train")
  evals = read_jsonl(str(tmp_path / "metrics.jsonl"), "eval")
  assert [r["step"] for r in train] == [1] and [r["step"] for r in evals] == [0]
  rec = train[0]
  assert np.isfinite(rec["loss"]) and rec["grad_norm"] > 0
  assert any(k.startswith("router/") and k.endswith("max_vio") for k in rec)
  assert any(k.startswith("router/") and k.endswith("drop_fraction") for k in rec)
  assert any(k.startswith("gate/") for k in rec)
  # A freshly initialised byte model sits near log(256) nats; bits/byte follows from the loss.
  assert evals[0]["bpb"] == pytest.approx(evals[0]["loss"] / np.log(2.0))
  assert 5.0 < evals[0]["loss"] < 7.0
  assert (tmp_path / "checkpoints" / "1").is_dir()
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


def test_signal_then_resume_reproduces_uninterrupted_losses(tmp_path):
  # A stateful router makes the resumed run depend on restored non-trainable state too.
  c = _shrunk_tiny(**_RESUME_OVERRIDES)
  full = train_and_evaluate(c, str(tmp_path / "full"))
  assert full["step"] == 5
  handler_before = signal.getsignal(signal.SIGTERM)
  first = train_and_evaluate(c, str(tmp_path / "resumed"), hooks=[_stop_at(3)])
  assert first["interrupted"] and first["step"] == 3
  assert signal.getsignal(signal.SIGTERM) is handler_before
  assert sorted(os.listdir(tmp_path / "resumed" / "checkpoints")) == ["3"]
  second = train_and_evaluate(c, str(tmp_path / "resumed"))
  assert second["step"] == 5 and second["first_eval"] is None

  losses = lambda d: [(r["step"], r["loss"], r["grad_norm"])
                      for r in read_jsonl(str(tmp_path / d / "metrics.jsonl"), "train")]
  assert [s for s, *_ in losses("full")] == [1, 2, 3, 4, 5]
  assert losses("resumed") == losses("full")  # exact, not approximate
  assert second["eval"] == full["eval"]


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  c = _shrunk_tiny(num_steps=6, checkpoint_every=2, num_devices=0)  # all 8 devices: data parallel
  model_fn = lambda rngs: _StandIn(256, 16, rngs=rngs, nan_after=3)
  with pytest.raises(NonFiniteLossError, match=r"at step 4.*started from step 0.*newest checkpoint is step 2"):
    train_and_evaluate(c, str(tmp_path), model_fn=model_fn)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
  # Run again: the restored (finite, verified) step 2 is named as the origin of the failure.
  with pytest.raises(NonFiniteLossError, match=r"at step 4.*resumed from the checkpoint of step 2"):
    train_and_evaluate(c, str(tmp_path), model_fn=model_fn)
  # The kept checkpoint holds finite parameters and the stand-in's non-trainable counter.
  mgr = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"))
  from k3jax.train.state import create_train_state
  tx, _ = make_optimizer(c.optim, c.num_steps)
  _, template = create_train_state(lambda rngs: _StandIn(256, 16, rngs=rngs), tx, 0)
  assert int(template.model_state["calls"][...]) == 0
  state, data_state = mgr.restore(template)
  mgr.close()
  assert int(state.step) == 2 and data_state["iterator"]["position"] == 2
  assert int(state.model_state["calls"][...]) == 2
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(state.params))


def test_checkpoint_roundtrip_of_nested_pytrees(tmp_path):
  tree = {"a": [jnp.arange(3.0), (jnp.ones((2, 2), jnp.bfloat16),)],
          "opt": optax.adam(1e-3).init({"w": jnp.zeros(4)}), "key": jax.random.PRNGKey(7)}
  nested = ckpt_lib.to_nested_dict(tree)
  back = ckpt_lib.from_nested_dict(tree, nested)
  chex_eq = jax.tree.map(lambda x, y: bool((x == y).all()) and x.dtype == y.dtype, tree, back)
  assert all(jax.tree.leaves(chex_eq))
  mgr = ckpt_lib.Checkpointer(str(tmp_path), async_save=False)
  mgr.save(5, tree, {"seed": 1, "position": 5})
  restored, data = mgr.restore(jax.tree.map(jnp.zeros_like, tree))
  mgr.close()
  assert data == {"seed": 1, "position": 5}
  for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    assert x.dtype == y.dtype


def test_optimizer_schedule_and_decay_mask():
  c = _shrunk_tiny().optim
  c.learning_rate, c.warmup_steps, c.end_lr_fraction = 1e-2, 10, 0.1
  tx, schedule = make_optimizer(c, 100)
  assert float(schedule(0)) == 0.0
  assert float(schedule(10)) == pytest.approx(1e-2)
  assert float(schedule(100)) == pytest.approx(1e-3)
  assert float(schedule(55)) == pytest.approx(1e-3 + 0.5 * (1e-2 - 1e-3), rel=1e-5)
  # Clipping: a huge gradient moves weights by at most lr-sized steps; vectors get no weight decay.
  params = {"w": jnp.ones((3, 3)), "b": jnp.ones(3)}
  state = tx.init(params)
  for _ in range(11):
    updates, state = tx.update({"w": jnp.zeros((3, 3)), "b": jnp.zeros(3)}, state, params)
  np.testing.assert_allclose(updates["b"], 0.0)
  assert float(jnp.abs(updates["w"]).max()) > 0  # decoupled weight decay on the matrix


def test_masked_cross_entropy_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, size=(2, 5))
  mask = (rng.random((2, 5)) > 0.4).astype(np.float32)
  nll, correct, count = masked_cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
  logp = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
  ref = -(np.take_along_axis(logp, targets[..., None], -1)[..., 0] * mask).sum()
  np.testing.assert_allclose(float(nll), ref, rtol=1e-5)
  assert float(correct) == ((logits.argmax(-1) == targets) * mask).sum()
  assert float(count) == mask.sum()


def test_flatten_scalars_and_metric_writer(tmp_path):
  flat = flatten_scalars({"router": {"0": {"max_vio": jnp.float32(0.5), "load": jnp.ones(4)}}, "x": 1.0})
  assert set(flat) == {"router/0/max_vio", "x"}
  w = MetricWriter(str(tmp_path))
  w.write(1, "train", {"loss": 2.0, "bad": float("nan")})
  w.write(1, "train", {"loss": 1.5})
  w.write(2, "eval", {"bpb": 3.0})
  w.close()
  assert read_jsonl(str(tmp_path / "metrics.jsonl"), "train") == [{"step": 1, "split": "train", "loss": 1.5}]
  first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  assert first["bad"] is None


def test_mqar_run_reports_heldout_accuracy(tmp_path):
  c = _shrunk_tiny(num_steps=2, checkpoint_every=0, eval_every=0, **{
      "data.kind": "mqar", "data.vocab_size": 64, "data.mqar_num_kv_pairs": 4, "model.vocab_size": 64})
  result = train_and_evaluate(c, str(tmp_path), model_fn=lambda rngs: _StandIn(64, 16, rngs=rngs))
  evals = read_jsonl(str(tmp_path / "metrics.jsonl"), "eval")
  assert [r["step"] for r in evals] == [0, 2]
  assert "bpb" not in evals[0] and 0.0 <= evals[0]["accuracy"] <= 1.0
  assert result["eval"]["accuracy"] == evals[-1]["accuracy"]


def _standin_run(tmp_path, **overrides):
  c = _shrunk_tiny(**{"num_steps": 2, "checkpoint_every": 0, "eval_every": 0, **overrides})
  return c, train_and_evaluate(c, str(tmp_path), model_fn=lambda rngs: _StandIn(256, 16, rngs=rngs))


def test_changed_model_config_is_refused_and_config_json_untouched(tmp_path):
  _standin_run(tmp_path)
  saved_bytes = (tmp_path / "config.json").read_bytes()
  before = {p: os.path.getmtime(tmp_path / p) for p in ("config.json", "metrics.jsonl")}
  changed = _shrunk_tiny(num_steps=4, checkpoint_every=0, eval_every=0, seed=3,
                         **{"model.d_model": 64, "data.max_bytes": 100_000})
  with pytest.raises(run_config.ConfigMismatchError) as info:
    train_and_evaluate(changed, str(tmp_path), model_fn=lambda rngs: _StandIn(256, 16, rngs=rngs))
  message = str(info.value)
  refused = [line.split(":")[0].strip() for line in message.splitlines() if "(saved) ->" in line]
  assert refused == ["data.max_bytes", "model.d_model", "seed"]  # exactly those; not num_steps
  assert "model.d_model: 32 (saved) -> 64 (now)" in message and "new run directory" in message
  assert (tmp_path / "config.json").read_bytes() == saved_bytes
  assert {p: os.path.getmtime(tmp_path / p) for p in before} == before
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]


def test_resumable_config_changes_are_allowed_and_logged(tmp_path, caplog):
  _standin_run(tmp_path)
  c = _shrunk_tiny(num_steps=3, checkpoint_every=0, eval_every=0, log_every=3,
                   **{"optim.learning_rate": 1e-3})
  with caplog.at_level(logging.INFO, logger="k3jax.train.run_config"):
    result = train_and_evaluate(c, str(tmp_path), model_fn=lambda rngs: _StandIn(256, 16, rngs=rngs))
  assert result["step"] == 3 and result["resumed_from"] == 2
  assert "config change on resume: num_steps 2 -> 3" in caplog.text
  assert "optim.learning_rate" in caplog.text and "log_every" in caplog.text
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["num_steps"] == 3 and saved["optim"]["learning_rate"] == 1e-3


def _raw_records(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_moves_superseded_metric_records_aside_and_logs_every_eval(tmp_path, caplog):
  # Checkpoints at 2 and 4; dropping 4 leaves the run as a kill before its save would: records of
  # steps 3 and 4 (and a torn line) that the resumed run writes again.
  overrides = {"num_steps": 4, "checkpoint_every": 2, "eval_every": 2, "progress_bar": True}
  with caplog.at_level(logging.INFO, logger="k3jax.train.trainer"):
    _, full = _standin_run(tmp_path, **overrides)
  assert full["step"] == 4 and sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
  first_pass = _raw_records(tmp_path / "metrics.jsonl")
  import shutil
  shutil.rmtree(tmp_path / "checkpoints" / "4")
  with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
    f.write('{"step": 5, "split": "tra')
  with caplog.at_level(logging.INFO, logger="k3jax.train.trainer"):
    _, resumed = _standin_run(tmp_path, **overrides)
  assert resumed["resumed_from"] == 2 and resumed["step"] == 4
  records = _raw_records(tmp_path / "metrics.jsonl")
  keys = [(r["split"], r["step"]) for r in records]
  assert len(keys) == len(set(keys))  # one record per (split, step), without the readers' help
  assert sorted(keys) == sorted((r["split"], r["step"]) for r in first_pass)
  assert sorted(records, key=lambda r: (r["step"], r["split"])) == read_jsonl(str(tmp_path / "metrics.jsonl"))
  backup = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
  moved = [json.loads(line) for line in backup[:-1]]
  assert sorted((r["split"], r["step"]) for r in moved) == [("eval", 4), ("train", 3), ("train", 4)]
  assert backup[-1] == '{"step": 5, "split": "tra'
  assert "moved 4 record(s) past step 2" in caplog.text
  # Each evaluation has its log line, the bar notwithstanding: steps 0, 2 and 4, then 4 again.
  evals = [m for m in caplog.messages if m.startswith("eval at step ")]
  assert [m.split(":")[0] for m in evals] == ["eval at step 0", "eval at step 2", "eval at step 4",
                                              "eval at step 4"]
  assert all("bpb=" in m for m in evals)


def test_num_steps_at_or_below_the_saved_step_changes_nothing(tmp_path):
  _standin_run(tmp_path, num_steps=3)
  files = ("config.json", "metrics.jsonl")
  before = {p: (tmp_path / p).read_bytes() for p in files}
  with pytest.raises(PastNumStepsError, match=r"already at step 3, past num_steps=2: nothing to do"):
    _standin_run(tmp_path, num_steps=2)
  _, again = _standin_run(tmp_path, num_steps=3, log_every=3)  # log_every may change; nothing runs
  assert again["nothing_to_do"] and again["step"] == 3
  assert report.summary(again).startswith("run already at step 3 of num_steps=3: nothing to do")
  assert {p: (tmp_path / p).read_bytes() for p in files} == before
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3"]


def test_diff_configs_splits_refused_from_allowed_fields():
  saved = {"seed": 0, "num_steps": 10, "model": {"d_model": 32, "kda": {"implementation": "pallas"}},
           "parallel": {"expert": 2}, "data": {"paths": ["a"]}}
  new = {"seed": 0, "num_steps": 20, "model": {"d_model": 32, "kda": {"implementation": "xla"}, "extra": 1},
         "parallel": {"expert": 1}, "data": {"paths": ["a", "b"]}}
  refused, allowed = run_config.diff_configs(saved, new)
  assert refused == [("data.paths", ["a"], ["a", "b"])]
  assert [k for k, *_ in allowed] == ["model.extra", "model.kda.implementation", "num_steps",
                                      "parallel.expert"]


def test_a_data_error_leaves_no_run_directory(tmp_path):
  workdir = tmp_path / "run"
  c = _shrunk_tiny(**{"data.paths": (str(tmp_path / "no_such_corpus"),)})
  with pytest.raises(ValueError, match="does not exist"):
    train_and_evaluate(c, str(workdir), model_fn=lambda rngs: _StandIn(256, 16, rngs=rngs))
  assert not workdir.exists()


def test_torn_trailing_jsonl_line_then_appended_records_read_fine(tmp_path, caplog):
  w = MetricWriter(str(tmp_path), tensorboard=False)
  w.write(1, "train", {"loss": 2.0})
  w.close()
  with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
    f.write('{"step": 2, "split": "tra')  # a kill mid-write
  with caplog.at_level(logging.WARNING):
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1]
  assert "skipped 1 line" in caplog.text
  w = MetricWriter(str(tmp_path), tensorboard=False)  # the resumed run appends
  w.write(2, "train", {"loss": 1.5})
  w.write(2, "eval", {"bpb": 3.0})
  w.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert lines[1] == '{"step": 2, "split": "tra' and len(lines) == 4
  assert read_jsonl(str(tmp_path / "metrics.jsonl")) == [
      {"step": 1, "split": "train", "loss": 2.0}, {"step": 2, "split": "eval", "bpb": 3.0},
      {"step": 2, "split": "train", "loss": 1.5}]


def test_summary_and_step_lines_label_every_number():
  rec = {"bpb": 8.5, "accuracy": 0.01}
  done = {"step": 300, "num_steps": 300, "evals": [(0, rec), (100, rec), (300, {"bpb": 2.5})],
          "interrupted": False}
  line = report.summary(done)
  assert line.startswith("step 300 of 300 | eval at step 0: accuracy=0.0100, bpb=8.5000")
  assert line.endswith("eval at step 300: bpb=2.5000") and "step 100" not in line
  resumed = {"step": 26, "num_steps": 300, "evals": [], "interrupted": True, "resumed_from": 20}
  assert report.summary(resumed) == ("step 26 of 300 (resumed from step 20) | no evaluation in this "
                                     "invocation | preempted by a signal at step 26: checkpoint saved, "
                                     "the same command resumes from it")
  step = report.step_line(20, 300, {"loss": 3.25, "tokens_per_s": 2700.4, "mfu": 0.0123,
                                    "learning_rate": 3e-3})
  assert step == "step 20/300 loss=3.2500 tokens/s=2700 MFU=1.23% lr=0.003"
  assert "compilation" in report.step_line(10, 300, {"loss": 5.0})
