"""A train state saved under one pipeline stage layout restores under another, and under none
(and a plain one under a pipeline): the layers move between their stacked and plain layouts."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax.models.lm import HybridLM
from k3jax.parallel import stage_storage
from k3jax.parallel.pipelined_lm import PipelinedLM
from k3jax.sharding import rules
from k3jax.sharding.mesh import MeshConfig, make_mesh
from k3jax.train import checkpoint
from k3jax.train.state import TrainState
from tests.test_pipeline_equality import config

CFG = config("block_attnres", 4)
TX = optax.adamw(1e-3)


def _model(seed: int, stages: int):
  model = HybridLM(CFG, rngs=nnx.Rngs(seed))
  return model if not stages else PipelinedLM(model, 4, stages)


def _state(seed: int, stages: int, step: int):
  """A TrainState of the model of `seed` in the layout of `stages` (0: plain), placed on a
  mesh of that many stages (one device for the plain one)."""
  _, params, model_state = nnx.split(_model(seed, stages), nnx.Param, ...)
  # Moments unlike the parameters, so a restore that mixed leaves up would show.
  opt_state = jax.tree.map(lambda x: x + 0.25 if jnp.issubdtype(x.dtype, jnp.floating) else x,
                           TX.init(params))
  state = TrainState(step=jnp.asarray(step, jnp.int32), params=params, model_state=model_state,
                     opt_state=opt_state)
  if not stages:
    return jax.device_put(state, jax.devices()[0])
  return rules.shard_tree(state, make_mesh(MeshConfig(stage=stages, data=8 // stages)))


def _plain(state) -> dict:
  """{path: host array} of `state` with its layers in the plain layout."""
  nested = stage_storage.convert_layout(
      jax.tree.map(np.asarray, jax.device_get(checkpoint.to_nested_dict(state))), 0)
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(nested)[0]}


@pytest.mark.parametrize("saved_stages, restored_stages", [(2, 4), (2, 0), (0, 2), (2, 2)])
def test_checkpoint_moves_between_stage_layouts(saved_stages, restored_stages, tmp_path):
  saved = _state(0, saved_stages, 7)
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(7, saved, {"position": 7})
  ckpt.wait()
  template = _state(1, restored_stages, 0)  # other values, the target layout
  restored, data_state = ckpt.restore(template)
  ckpt.close()
  assert data_state == {"position": 7}
  want, got = _plain(saved), _plain(restored)
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)
  assert jax.tree.structure(restored) == jax.tree.structure(template)
  for a, t in zip(jax.tree.leaves(restored), jax.tree.leaves(template)):
    assert a.sharding == t.sharding and a.shape == t.shape and a.dtype == t.dtype
  if restored_stages:  # every layer variable and moment on its own stage's devices
    stacked = [x for p, x in jax.tree_util.tree_flatten_with_path(
        checkpoint.to_nested_dict(restored))[0] if stage_storage.STACKED in jax.tree_util.keystr(p)]
    assert stacked and all(x.sharding.spec[0] == "stage" for x in stacked)
