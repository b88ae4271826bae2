"""The ablation launcher's GPU assignment (no runs are launched here)."""
import sys
from pathlib import Path

import pytest
from absl import flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import run_ablations  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture
def parsed_flags():
  def parse(*argv):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["run_ablations", *argv])
  yield parse
  flags.FLAGS.unparse_flags()


def test_gpu_ids_pick_physical_gpus(parsed_flags):
  parsed_flags("--gpu_ids=1,3", "--num_gpus=8")
  assert run_ablations._gpu_ids() == [1, 3]  # pylint: disable=protected-access
  env = run_ablations._env(3, "/tmp/cache")  # pylint: disable=protected-access
  assert env["CUDA_VISIBLE_DEVICES"] == "3"
  assert "deterministic" not in env.get("XLA_FLAGS", "")
  assert "--xla_gpu_deterministic_ops=true" in run_ablations._env(3, "/tmp/c", True)["XLA_FLAGS"]  # pylint: disable=protected-access


def test_num_gpus_counts_from_zero_and_cpu(parsed_flags):
  parsed_flags("--num_gpus=2")
  assert run_ablations._gpu_ids() == [0, 1]  # pylint: disable=protected-access
  parsed_flags("--num_gpus=0")
  assert run_ablations._gpu_ids() == []  # pylint: disable=protected-access
  assert run_ablations._env(None, "/tmp/cache")["JAX_PLATFORMS"] == "cpu"  # pylint: disable=protected-access


def test_set_overrides_reach_every_run(parsed_flags):
  parsed_flags("--sweeps=residual", "--setting=full", "--seeds=0",
               "--set=model.moe_impl=buffered,optim.learning_rate=1e-3,progress_bar=true",
               )
  assert run_ablations.parse_set(["a.b=3", "c=x", "d=False", "e=0.5"]) == (
      ("a.b", 3), ("c", "x"), ("d", False), ("e", 0.5))
  specs = run_ablations._specs()  # pylint: disable=protected-access
  assert specs and all(s.config().model.moe_impl == "buffered" for s in specs)
  assert all(s.config().optim.learning_rate == 1e-3 for s in specs)
  with pytest.raises(Exception, match="not dotted.name=value"):
    run_ablations.parse_set(["nonsense"])


def test_worker_runs_its_spec_and_prints_the_record(parsed_flags, monkeypatch, capsys):
  parsed_flags("--sweeps=documents", "--setting=quick", "--seeds=0")
  seen = []

  def fake_run_or_load(spec, out):
    seen.append((spec.key, out))
    return {"final_eval": {"loss": 1.5}}

  monkeypatch.setattr(run_ablations.record, "run_or_load", fake_run_or_load)
  run_ablations._worker("documents/reset/bytes/seed0", "/tmp/out")  # pylint: disable=protected-access
  assert seen == [("documents/reset/bytes/seed0", "/tmp/out")]
  assert "final eval {'loss': 1.5}" in capsys.readouterr().out
