"""The trainer on a device mesh (8 fake CPU devices): sharded runs reproduce the one-device
losses, a run checkpointed on one mesh resumes on another, mesh config errors come first."""
import os

import numpy as np
import pytest

from k3jax.parallel import config as pconfig_lib
from k3jax.sharding import rules as rules_lib
from k3jax.train.config_schema import validate, validate_for_devices
from k3jax.train.defaults import base_config
from k3jax.train.metrics import read_jsonl
from k3jax.train.trainer import train_and_evaluate
from tests.config_helpers import set_dotted
from tests.test_train import _RESUME_OVERRIDES, _shrunk_tiny, _stop_at

# Float32 runs that differ only in the order of reductions (sharded matmuls, the
# context-parallel state composition, all-to-all expert sums), compounded over a few
# AdamW steps. Measured on (2, 2, 2): loss 1.7e-7, gradient norm 2.3e-7 (relative).
RTOL = {"loss": 2e-6, "grad_norm": 5e-6}


def _mesh_config(data=1, fsdp=1, expert=1, context=1, **overrides):
  # The test_train config (stateful router included). The model sees no segment ids, which a
  # context axis cannot carry (tests/test_segments.py has them with every other axis).
  c = _shrunk_tiny(**_RESUME_OVERRIDES, **{"data.reset_at_boundaries": False, **overrides})
  c.num_devices = data * fsdp * expert * context
  c.parallel.update(data=data, fsdp=fsdp, expert=expert, context=context)
  return c


def _losses(workdir):
  return [(r["step"], r["loss"], r["grad_norm"]) for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"),
                                                                       "train")]


def _assert_losses_match(got, want, steps):
  assert [s for s, *_ in got] == steps
  want = {s: (loss, gn) for s, loss, gn in want}
  for s, loss, gn in got:
    np.testing.assert_allclose(loss, want[s][0], rtol=RTOL["loss"], err_msg=f"loss at step {s}")
    np.testing.assert_allclose(gn, want[s][1], rtol=RTOL["grad_norm"], err_msg=f"grad norm at step {s}")


# One test, so that under pytest-xdist the three parts share one worker's compiled programs.
def test_mesh_runs_match_one_device_and_resume_across_meshes(tmp_path):
  # 1. The reference: one device, 5 steps.
  ref_dir = str(tmp_path / "one_device")
  ref = train_and_evaluate(_mesh_config(), ref_dir)
  ref_losses = _losses(ref_dir)
  assert ref["mesh"] == {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "context": 1}
  # The losses move (the comparison is not between two untrained models).
  assert ref_losses[-1][1] < ref_losses[0][1] - 0.2

  # 2. (data 2, expert 2, context 2): experts over 2 devices, sequences over 2.
  mesh_dir = str(tmp_path / "mesh_2x2x2")
  result = train_and_evaluate(_mesh_config(data=2, expert=2, context=2), mesh_dir)
  assert result["mesh"] == {"stage": 1, "data": 2, "fsdp": 1, "expert": 2, "context": 2}
  assert result["step"] == 5 and result["num_params"] == ref["num_params"]
  _assert_losses_match(_losses(mesh_dir), ref_losses, [1, 2, 3, 4, 5])
  np.testing.assert_allclose(result["eval"]["loss"], ref["eval"]["loss"], rtol=RTOL["loss"])
  np.testing.assert_allclose(result["first_eval"]["loss"], ref["first_eval"]["loss"], rtol=RTOL["loss"])

  # 3. One run moved through checkpoints: one device -> stop at 2 -> (2, 2, 2) -> stop at 4
  # -> one device. A replicated checkpoint restored onto expert/context shardings, and an
  # expert-sharded one written from 8 devices restored onto one device.
  moved = str(tmp_path / "moved")
  first = train_and_evaluate(_mesh_config(), moved, hooks=[_stop_at(2)])
  assert first["interrupted"] and first["step"] == 2
  second = train_and_evaluate(_mesh_config(data=2, expert=2, context=2), moved, hooks=[_stop_at(4)])
  assert second["mesh"] == {"stage": 1, "data": 2, "fsdp": 1, "expert": 2, "context": 2}
  assert second["interrupted"] and second["step"] == 4 and second["first_eval"] is None
  assert sorted(os.listdir(os.path.join(moved, "checkpoints"))) == ["2", "4"]
  third = train_and_evaluate(_mesh_config(), moved)
  assert third["step"] == 5 and third["mesh"]["expert"] == 1
  _assert_losses_match(_losses(moved), ref_losses, [1, 2, 3, 4, 5])
  # Steps 1-2 ran on one device from the same state as the reference: bit for bit.
  assert _losses(moved)[:2] == ref_losses[:2]


def _cfg(**changes):
  # Without segment ids, so that a context axis meets the mesh checks rather than the documents'.
  return set_dotted(base_config(), {"data.reset_at_boundaries": False, **changes})


@pytest.mark.parametrize("changes,message", [
    ({"parallel.context": 3}, r"seq_len=256 must be divisible by the mesh axes that shard the sequence"),
    ({"parallel.context": 8}, r"seq_len=256 must be divisible by parallel.context=8 x "
                              r"model.kda.chunk_size=64 = 512"),
    ({"parallel.expert": 3, "batch_size": 18}, r"num_experts=8 must be divisible by parallel.expert=3"),
    ({"parallel.fsdp": 3}, r"batch_size=16 must be divisible by the mesh axes that shard the batch "
                           r"\(parallel.rules.batch: data=\? x fsdp=3 x expert=1, product 3\)"),
    ({"parallel.expert": 0}, r"config parallel: MeshConfig.expert=0; must be a positive int or -1"),
    ({"parallel.data": -1, "parallel.expert": -1}, r"at most one axis may be -1"),
    ({"parallel.dispatch_slot_factor": -1.0}, r"dispatch_slot_factor=-1.0; must be >= 0"),
    ({"parallel.rules.embed": "fsdp,expertt"}, r"unknown mesh axis 'expertt'; did you mean 'expert'"),
    ({"parallel.rules.batch": "data,context", "parallel.context": 2},
     r"parallel.rules.batch=\('data', 'context'\) includes 'context'"),
    ({"parallel.fsdp": 3, "batch_size": 48}, r"d_model=256 must be divisible by .*fsdp=3"),
])
def test_parallel_config_errors(changes, message):
  with pytest.raises(ValueError, match=message):
    validate(_cfg(**changes))


def test_parallel_typos_suggest_the_key():
  c = base_config()
  with c.unlocked():
    c.parallel.expertt = 2
  with pytest.raises(ValueError, match=r"unknown config key 'parallel.expertt'; did you mean 'parallel.expert'"):
    validate(c)
  c = base_config()
  with c.unlocked():
    c.parallel.rules.embd = "fsdp"
  with pytest.raises(ValueError, match=r"unknown logical axis 'embd'; did you mean 'embed'"):
    validate(c)


def test_mesh_must_use_the_devices_and_fails_before_the_run(tmp_path):
  c = _mesh_config(expert=2, context=2)
  c.num_devices = 8  # the fixed axes use 4 of them, data=1 is fixed too
  with pytest.raises(ValueError, match=r"has 4 devices, but 8 are available"):
    train_and_evaluate(c, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
  # data=-1 takes the devices the other axes leave.
  c.parallel.data = -1
  _, pconf, sizes = validate_for_devices(c, 8)
  assert sizes == {"stage": 1, "data": 2, "fsdp": 1, "expert": 2, "context": 2}
  assert pconf.dispatch_slot_factor is None  # 0 in the config: lossless dispatch


def test_default_rules_match_the_library_and_overrides_apply():
  pconf = pconfig_lib.ParallelConfig.from_trainer_config(base_config().parallel)
  assert pconf.rules == rules_lib.DEFAULT_RULES
  assert pconf.mesh.sizes() == (1, -1, 1, 1, 1)  # stage first
  assert pconf.microbatches == 1
  c = base_config()
  c.parallel.rules.embed = ""
  c.parallel.rules.mlp = "fsdp"
  c.parallel.dispatch_slot_factor = 2.0
  pconf = pconfig_lib.ParallelConfig.from_trainer_config(c.parallel)
  table = dict(pconf.rules)
  assert table["embed"] is None and table["mlp"] == "fsdp" and table["batch"] == ("data", "fsdp", "expert")
  assert pconf.dispatch_slot_factor == 2.0


def test_batch_only_mesh_keeps_pallas_kernel_calls_per_device():
  """A data-parallel run with the Pallas KDA path gets the mesh-aware layers (shard_map calls)."""
  from k3jax.parallel.model_layout import ModelLayout  # pylint: disable=g-import-not-at-top
  sizes = {"stage": 1, "data": 2, "fsdp": 1, "expert": 1, "context": 1}
  assert ModelLayout.for_mesh(sizes, "pallas", 1).mesh_aware_kda
  assert not ModelLayout.for_mesh(dict(sizes, data=1), "pallas", 1).mesh_aware_kda
  assert not ModelLayout.for_mesh(sizes, "xla", 1).mesh_aware_kda
  assert ModelLayout.for_mesh(dict(sizes, context=2), "xla", 1).mesh_aware_kda
