"""A train state saved under one pipeline stage layout restores under another, and under none."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from k3jax.models.lm import HybridLM
from k3jax.parallel.pipelined_lm import pipeline_parallelize
from k3jax.sharding import rules
from k3jax.sharding.mesh import MeshConfig, make_mesh
from k3jax.train import checkpoint
from k3jax.train.state import TrainState
from tests.test_pipeline_equality import config

CFG = config("block_attnres", 4)


def _state(model, tx, step, mesh=None):
  _, params, model_state = nnx.split(model, nnx.Param, ...)
  # Moments unlike the parameters, so a restore that mixed leaves up would show.
  opt_state = jax.tree.map(lambda x: x + 0.25 if jnp.issubdtype(x.dtype, jnp.floating) else x,
                           tx.init(params))
  state = TrainState(step=jnp.asarray(step, jnp.int32), params=params, model_state=model_state,
                     opt_state=opt_state, rng=jax.random.PRNGKey(step))
  return state if mesh is None else rules.shard_tree(state, mesh)


def _host(x):
  return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def test_checkpoint_moves_between_stage_layouts_and_to_none(tmp_path):
  tx = optax.adamw(1e-3)
  two_stages = make_mesh(MeshConfig(stage=2, data=4))
  saved = _state(pipeline_parallelize(HybridLM(CFG, rngs=nnx.Rngs(0)), 4), tx, 7, two_stages)
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(7, saved, {"position": 7})
  ckpt.wait()
  # The plain model's state has the pipelined one's tree: the pipeline adds no variable.
  plain = nnx.state(nnx.eval_shape(lambda: HybridLM(CFG, rngs=nnx.Rngs(0))))
  assert jax.tree.structure(plain) == jax.tree.structure(nnx.state(nnx.merge(
      *nnx.split(pipeline_parallelize(nnx.eval_shape(lambda: HybridLM(CFG, rngs=nnx.Rngs(0))),
                                      4)))))
  # Templates: other values, the target layouts (4 stages; one device, no mesh).
  other = jax.tree.map(lambda x: x if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x + 1,
                       jax.device_get(saved))
  targets = {"4 stages": rules.shard_tree(other, make_mesh(MeshConfig(stage=4, data=2))),
             "no pipeline": jax.device_put(other, jax.devices()[0])}
  want = [_host(x) for x in jax.tree.leaves(saved)]
  for name, template in targets.items():
    restored, data_state = ckpt.restore(template)
    assert data_state == {"position": 7}, name
    got = jax.tree.leaves(restored)
    assert len(got) == len(want), name
    for a, b, t in zip(want, got, jax.tree.leaves(template)):
      np.testing.assert_array_equal(a, _host(b), err_msg=name)
      assert b.sharding == t.sharding, name
  ckpt.close()
