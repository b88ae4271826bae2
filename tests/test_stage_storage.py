"""Stage-local layer storage (8 fake CPU devices): a pipelined model stores its layers stacked
per stage, each stage's layers and their moments on that stage's devices only."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax.models.lm import HybridLM
from k3jax.parallel import pipeline_bytes, stage_storage
from k3jax.parallel.pipelined_lm import PipelinedLM
from k3jax.sharding import rules
from k3jax.sharding.mesh import MeshConfig, make_mesh
from k3jax.train.optimizer import decay_mask
from k3jax.train.state import TrainState
from tests.test_pipeline_equality import config

CFG = config("block_attnres", 4)  # 4 layers


def _pair(stages: int = 2):
  """(plain model, the same values pipelined over `stages`)."""
  plain = HybridLM(CFG, rngs=nnx.Rngs(0))
  return plain, PipelinedLM(nnx.merge(*nnx.split(plain)), 4, stages)


def test_stacks_hold_every_layer_value_under_the_stage_axis_name():
  plain, pipelined = _pair(stages=2)
  assert not hasattr(pipelined, "layers") and len(pipelined.stage_layers) == 2
  want = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(plain))}
  got = stage_storage.plain_items(nnx.to_flat_state(nnx.state(pipelined)))
  assert sorted(p for p, _ in got) == sorted(want)
  for path, value in got:
    np.testing.assert_array_equal(value, want[path], err_msg=str(path))
  axes = {p: v.get_metadata()["out_sharding"] for p, v in nnx.to_flat_state(nnx.state(pipelined))}
  # Layer 2 (stage 1's first layer) is slice 1 of stack 0; the names gain "stage" in front.
  assert axes[("stage_layers", 0, "mixer", "wq")] == ("stage", "embed", "heads", "kv")
  assert axes[("embed",)] == ("vocab", "embed")


def test_each_device_holds_only_its_stage_layers_and_moments():
  stages = 4
  _, pipelined = _pair(stages)
  _, params, model_state = nnx.split(pipelined, nnx.Param, ...)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                     opt_state=optax.adamw(1e-3).init(params))
  mesh = make_mesh(MeshConfig(stage=stages, data=2))
  placed = rules.shard_tree(state, mesh)
  layer = other = 0
  for path, x in jax.tree_util.tree_flatten_with_path(placed)[0]:
    if stage_storage.STACKED in jax.tree_util.keystr(path):
      layer += x.nbytes
    else:
      other += x.nbytes
  assert layer > other  # the layers (and their two moments) are most of the state
  # The step counter is replicated; the shape-only count leaves it out.
  predicted = pipeline_bytes.state_bytes_per_device(CFG, stages, optax.adamw(1e-3))
  assert predicted["layers"] == layer // stages
  assert predicted["other"] == other - placed.step.nbytes
  for device in mesh.devices.flat:
    held = sum(s.data.nbytes for x in jax.tree.leaves(placed) for s in x.addressable_shards
               if s.device == device)
    assert held == other + layer // stages, device


def test_plain_entry_points_run_from_the_stacks_without_a_stage_mesh():
  plain, pipelined = _pair(stages=2)
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, CFG.vocab_size)
  np.testing.assert_array_equal(pipelined(tokens, deterministic=True)[0],
                                plain(tokens, deterministic=True)[0])
  logits, cache = pipelined.prefill(tokens, max_len=9)
  want_logits, want_cache = plain.prefill(tokens, max_len=9)
  np.testing.assert_array_equal(logits, want_logits)
  step = pipelined.decode(tokens[:, :1], cache)[0]
  np.testing.assert_array_equal(step, plain.decode(tokens[:, :1], want_cache)[0])


def test_a_mesh_of_another_stage_count_names_the_fix():
  _, pipelined = _pair(stages=2)
  graphdef, state = nnx.split(pipelined)
  mesh = make_mesh(MeshConfig(stage=4, data=2))
  tokens = jnp.zeros((8, 8), jnp.int32)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"stages=4\) \(a checkpoint"):
    nnx.merge(graphdef, state)(tokens)


def test_stacking_refuses_layers_of_different_structure():
  moe_layer = HybridLM(CFG, rngs=nnx.Rngs(0)).layers[0]
  dense_layer = HybridLM(config("prenorm", 0), rngs=nnx.Rngs(0)).layers[0]
  with pytest.raises(ValueError, match="layer 1 differs in structure from layer 0"):
    stage_storage.stack_layers([moe_layer, dense_layer], 2)


def test_convert_layout_moves_between_stage_counts_and_back():
  rng = np.random.default_rng(0)
  plain = {"params": {"layers": {str(i): {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=3)}
                                 for i in range(8)}, "embed": rng.normal(size=(4, 2))},
           "step": np.int32(5)}
  two = stage_storage.convert_layout(plain, 2)
  assert sorted(two["params"]) == ["embed", "stage_layers"]
  assert two["params"]["stage_layers"]["1"]["w"].shape == (2, 3, 2)
  np.testing.assert_array_equal(two["params"]["stage_layers"]["1"]["w"][1],
                                plain["params"]["layers"]["5"]["w"])  # stage 1, local layer 1
  assert stage_storage.stage_count(two) == 2 and stage_storage.stage_count(plain) == 0
  back = stage_storage.convert_layout(stage_storage.convert_layout(two, 4), 0)
  assert jax.tree.structure(back) == jax.tree.structure(plain)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="8 layers do not split into 3 stages"):
    stage_storage.convert_layout(plain, 3)


def test_the_stage_name_maps_to_the_stage_axis_and_takes_no_rule():
  mesh = make_mesh(MeshConfig(stage=2, fsdp=4))
  assert rules.logical_to_spec(("stage", "embed", None), mesh) == P("stage", "fsdp")
  assert rules.logical_to_spec(("stage", "embed"), make_mesh(MeshConfig(fsdp=8))) == P(None, "fsdp")
  with pytest.raises(ValueError, match="takes no rule"):
    rules.make_rules([("stage", None)])


def test_weight_decay_mask_does_not_count_the_stage_dim():
  plain, pipelined = _pair(stages=2)
  want = {p: m.get_value() for p, m in nnx.to_flat_state(decay_mask(nnx.state(plain, nnx.Param)))}
  got = {}
  for path, m in nnx.to_flat_state(decay_mask(nnx.state(pipelined, nnx.Param))):
    if path[0] != stage_storage.STACKED:
      got[path] = m.get_value()
      continue
    for s in range(2):  # stack j, slice s is layer 2 s + j
      got[("layers", 2 * s + path[1], *path[2:])] = m.get_value()
  assert got == want
  assert not want[("final_norm", "scale")] and not want[("layers", 3, "ffn_norm", "scale")]
  assert want[("layers", 3, "mixer", "wq")]
