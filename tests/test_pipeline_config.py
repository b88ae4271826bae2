"""Pipeline settings: parallel.stages / parallel.microbatches, the stage mesh axis, and the
errors for layouts the pipeline cannot run (each naming what would)."""
import jax
import pytest

from k3jax.parallel.config import ParallelConfig
from k3jax.parallel.pipeline_layout import PipelineLayout
from k3jax.sharding.mesh import MeshConfig, make_mesh
from k3jax.train.config_schema import validate_for_devices, validate
from k3jax.train.defaults import base_config
from tests.config_helpers import set_dotted

# Pipeline-ready trainer defaults: every stage holds the same layer kinds.
_READY = {"model.layer_pattern": "KA", "model.first_layer_dense": False}


def _cfg(**changes):
  return set_dotted(base_config(), {**_READY, **changes})


def test_stages_and_microbatches_reach_the_mesh():
  _, pconf, sizes = validate_for_devices(_cfg(**{"parallel.stages": 2, "parallel.microbatches": 4}), 8)
  assert sizes == {"stage": 2, "data": 4, "fsdp": 1, "expert": 1, "context": 1}
  assert (pconf.stages, pconf.microbatches) == (2, 4)
  mesh = pconf.make_mesh(jax.devices())
  assert mesh.axis_names[0] == "stage" and dict(mesh.shape)["stage"] == 2
  # Stage is the slowest axis: the devices of one stage are contiguous.
  assert sorted(d.id for d in mesh.devices[0].ravel()) == [0, 1, 2, 3]
  assert dict(make_mesh(MeshConfig(stage=4, data=-1)).shape)["data"] == 2
  # Defaults: no pipeline.
  _, pconf, sizes = validate_for_devices(base_config(), 8)
  assert (sizes["stage"], pconf.microbatches) == (1, 1)


@pytest.mark.parametrize("changes,message", [
    ({"parallel.stages": 3, "parallel.data": 1, "model.num_layers": 4},
     r"parallel.stages=3 does not divide model.num_layers=4: .* Stage counts that divide it: "
     r"\[2, 4\]"),
    ({"model.layer_pattern": "KKKA", "parallel.stages": 2},
     r"stage 1 holds layers K\(moe\)A\(moe\), stage 0 K\(moe\)K\(moe\); .* model.layer_pattern whose "
     r"length divides model.num_layers / stages = 2"),
    ({"model.first_layer_dense": True, "parallel.stages": 2},
     r"stage 1 holds .* and model.first_layer_dense=False"),
    ({"model.residual": "block_attnres", "model.attnres_block_size": 4, "parallel.stages": 4,
      "model.layer_pattern": "K"},
     r"parallel.stages=4: a stage holds 2 sublayers, which is not a whole number of "
     r"attention-residual blocks \(model.attnres_block_size=4\).*parallel.stages in \[2\], or "
     r"model.attnres_block_size in \[1, 2\]"),
    ({"parallel.stages": 2, "parallel.data": 4, "parallel.microbatches": 3},
     r"batch_size=16 does not divide into parallel.microbatches=3 microbatches .* 4 devices .*"
     r"parallel.microbatches in \[1, 2, 4\]"),
    ({"parallel.microbatches": 0}, r"parallel.microbatches=0; must be a positive int"),
    ({"parallel.microbatches": 4}, r"parallel.microbatches=4 streams microbatches through "
                                   r"pipeline stages, but parallel.stages=1"),
    ({"parallel.stages": 2, "parallel.expert": 2, "parallel.rules.batch": "data",
      "batch_size": 4, "seq_len": 1, "parallel.microbatches": 2, "model.layer_pattern": "A"},
     r"batch_size / parallel.microbatches x seq_len = 2 tokens must be divisible by the 4 "
     r"devices of a stage"),
    ({"parallel.stages": 0}, r"MeshConfig.stage=0; must be a positive int"),
    ({"parallel.rules.embed": "fsdp,stage"}, r"parallel.rules.embed maps to the 'stage' axis"),
    ({"parallel.stages": 2, "model.router.name": "bias_sign"},
     r"stateful router updates its bias once per batch"),
])
def test_layouts_the_pipeline_cannot_run_are_refused(changes, message):
  with pytest.raises(ValueError, match=message):
    validate_for_devices(_cfg(**changes), 8)


def test_fixed_stage_count_is_checked_without_the_devices():
  with pytest.raises(ValueError, match="parallel.stages=3 does not divide"):
    validate(_cfg(**{"parallel.stages": 3}))


def test_library_layout_and_validate_for_devices():
  pconf = ParallelConfig.from_dict({"mesh": {"stage": 2, "data": -1}, "microbatches": 8})
  assert (pconf.stages, pconf.microbatches) == (2, 8)
  with pytest.raises(ValueError, match=r"parallel.microbatches=2.0"):
    ParallelConfig.from_dict({"microbatches": 2.0})
  with pytest.raises(ValueError, match=r"parallel.stages=0"):
    PipelineLayout(stages=0, microbatches=1)
  assert PipelineLayout(2, 6).bubble_fraction() == pytest.approx(1 / 7)
