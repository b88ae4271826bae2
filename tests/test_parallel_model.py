"""A tiny HybridLM sharded over (data, expert, context) equals the one-device model;
a sharded checkpoint restores onto another mesh."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax.models.config import ModelConfig
from k3jax.models.lm import HybridLM
from k3jax.layers import moe_path
from k3jax.parallel import context_parallel, layers
from k3jax.parallel.model_layout import ModelLayout
from k3jax.sharding import rules
from k3jax.train import sharded_state
from k3jax.sharding.mesh import MeshConfig, make_mesh
from k3jax.train import checkpoint
from k3jax.train.state import TrainState
from k3jax.train.step import make_train_step
from pallas_kernels.kda.spec import KdaSpec
from tests.call_counts import count_calls
from tests.kda_inputs import assert_close

# Relative L2 errors of float32 results whose only difference is the order
# of reductions (sharded matmuls, state composition across devices).
TOL = {jnp.dtype(jnp.float32): {"logits": 1e-5, "grad": 5e-5}}

CONFIG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, layer_pattern="KA", num_heads=2,
                     head_dim=16, num_kv_heads=2, num_experts=8, top_k=2, expert_hidden=16,
                     dense_hidden=32, first_layer_dense=False,
                     kda=KdaSpec(chunk_size=16, sub_chunk=8, lower_bound=-5.0))


def _loss(model, tokens):
  logits, aux = model(tokens, deterministic=True)
  targets = jnp.roll(tokens, -1, axis=1)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  return ce + aux["aux_loss"], logits


def _tokens():
  return jax.random.randint(jax.random.key(7), (8, 32), 0, CONFIG.vocab_size)


@functools.cache
def _reference():
  model = HybridLM(CONFIG, rngs=nnx.Rngs(0))
  (loss, logits), grads = nnx.jit(nnx.value_and_grad(_loss, has_aux=True))(model, _tokens())
  return loss, logits, nnx.state(grads, nnx.Param)


def test_the_layout_builds_mesh_aware_layers_with_the_plain_parameters():
  plain = HybridLM(CONFIG, rngs=nnx.Rngs(0))
  aware = ModelLayout(mesh_aware_kda=True).build_lm(CONFIG, rngs=nnx.Rngs(0))
  kinds = [type(m) for _, m in nnx.iter_modules(aware)]
  assert layers.ContextParallelKDA in kinds and layers.KDA not in kinds
  got, want = nnx.to_flat_state(nnx.state(aware)), nnx.to_flat_state(nnx.state(plain))
  assert [p for p, _ in got] == [p for p, _ in want]
  for (path, a), (_, b) in zip(got, want):
    np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(path))
  ModelLayout(mesh_aware_kda=True).check_built_for(aware)
  with pytest.raises(ValueError, match="layers/0/mixer must be a k3jax.parallel.layers.ContextParallelKDA"):
    ModelLayout(mesh_aware_kda=True).check_built_for(plain)


def test_the_layout_keeps_the_document_mask_on_a_mesh_of_devices():
  """Attention's documents path: the layer's default on one device, the mask on any mesh
  of more than one (the packed layout's split over devices is unchecked); a model whose
  attention took another path is refused, naming the layer."""
  one = {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "context": 1}
  assert ModelLayout.for_mesh(one, "pallas", 1).attention_documents is None
  for axis in one:
    assert ModelLayout.for_mesh(dict(one, **{axis: 2}), "xla", 4).attention_documents == "mask"
  layout = ModelLayout(attention_documents="mask")
  model = layout.build_lm(CONFIG, rngs=nnx.Rngs(0))
  attention = model.layers[1].mixer
  assert attention.documents == "mask"
  layout.check_built_for(model)
  attention.documents = "packed"  # as a model built for one GPU would hold
  ModelLayout().check_built_for(model)
  with pytest.raises(ValueError, match="layers/1/mixer keeps documents apart with 'packed', "
                                       "but this mesh needs 'mask'"):
    layout.check_built_for(model)


def test_mesh_aware_layer_refuses_calls_it_cannot_split():
  """Built for a mesh, the layer does not fall back to the plain call: without a mesh, or on
  a batch the mesh's batch axes do not divide, it names the fix."""
  spec = KdaSpec(chunk_size=16, sub_chunk=8, lower_bound=-5.0, implementation="pallas")
  layer = layers.ContextParallelKDA(16, 2, 8, spec=spec, rngs=nnx.Rngs(0))
  x = jnp.zeros((3, 16, 16))
  with pytest.raises(ValueError, match=r"call the model under jax.set_mesh\(mesh\)"):
    layer(x)
  with jax.set_mesh(make_mesh(MeshConfig(data=2), devices=jax.devices()[:2])):
    with pytest.raises(ValueError, match="batch B=3 .* pad the batch to a multiple of 2"):
      layer(x)


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 1, 8)])
def test_sharded_forward_and_gradients_equal_one_device(shape, monkeypatch):
  data, expert, ctx = shape
  mesh = make_mesh(MeshConfig(data=data, expert=expert, context=ctx))
  used = count_calls(monkeypatch, ((moe_path, "expert_parallel_swiglu", "ep"),
                                    (context_parallel, "chunk_kda_context_parallel", "cp"),
                                    (context_parallel, "_local_summary", "scan")))

  model = HybridLM(CONFIG, rngs=nnx.Rngs(0), expert_parallel=moe_path.ExpertParallel(),
                   kda_class=layers.ContextParallelKDA)
  graphdef, state = nnx.split(model)
  state = rules.shard_tree(state, mesh)
  tokens = jax.device_put(_tokens(), rules.batch_sharding(mesh))

  @jax.jit
  def run(state, tokens):
    (loss, logits), grads = nnx.value_and_grad(_loss, has_aux=True)(
        nnx.merge(graphdef, state), tokens)
    return loss, logits, nnx.state(grads, nnx.Param)

  with jax.set_mesh(mesh):
    loss, logits, grads = run(state, tokens)
  # Traced once per layer: two MoE layers, one KDA layer.
  assert used["ep"] == (2 if expert > 1 else 0)
  # The mesh-aware layer always calls through the mesh; only context > 1 splits the scan.
  assert used["cp"] == 1
  assert used["scan"] == (1 if ctx > 1 else 0)
  if expert > 1:
    wi = grads["layers"][1]["ffn"]["wi_gate"].get_value()
    assert wi.sharding.spec == P("expert")
  loss_ref, logits_ref, grads_ref = _reference()
  tol = TOL[jnp.dtype(jnp.float32)]
  np.testing.assert_allclose(float(loss), float(loss_ref), rtol=tol["logits"])
  assert_close(logits, logits_ref, tol["logits"], "logits")
  ref_flat = dict(nnx.to_flat_state(grads_ref))
  flat = nnx.to_flat_state(grads)
  assert len(flat) == len(ref_flat)
  for path, var in flat:
    assert_close(var.get_value(), ref_flat[path].get_value(), tol["grad"], f"d{path}")


def test_checkpoint_saved_on_one_mesh_restores_on_another(tmp_path):
  tx = optax.adamw(1e-3)
  abstract = nnx.eval_shape(lambda: HybridLM(CONFIG, rngs=nnx.Rngs(0)))
  _, abstract_params, _ = nnx.split(abstract, nnx.Param, ...)

  def make_state(mesh, seed):
    _, params, model_state = nnx.split(HybridLM(CONFIG, rngs=nnx.Rngs(seed)), nnx.Param, ...)
    # Distinct moments, so a restore that mixed up leaves would show.
    opt_state = tx.init(params)
    opt_state = jax.tree.map(lambda x: x + 0.5 if jnp.issubdtype(x.dtype, jnp.floating) else x,
                             opt_state)
    state = TrainState(step=jnp.asarray(3, jnp.int32), params=params, model_state=model_state,
                       opt_state=opt_state)
    return rules.shard_tree(state, mesh)

  src_mesh = make_mesh(MeshConfig(data=2, expert=4))
  saved = make_state(src_mesh, seed=0)
  assert saved.params["layers"][1]["ffn"]["wo"].get_value().sharding.spec == P("expert")
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(3, saved, {"position": 11})
  ckpt.wait()

  dst_mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=2, context=2))
  template = make_state(dst_mesh, seed=1)  # other values, target shardings
  restored, data_state = ckpt.restore(template)
  ckpt.close()
  assert data_state == {"position": 11}
  wo = restored.params["layers"][1]["ffn"]["wo"].get_value()
  assert wo.sharding.mesh.shape == dst_mesh.shape
  assert wo.sharding.spec == P("expert", None, "fsdp")
  src_leaves = jax.tree_util.tree_leaves_with_path(saved)
  dst_leaves = jax.tree.leaves(restored)
  tmpl_leaves = jax.tree.leaves(template)
  assert len(src_leaves) == len(dst_leaves)
  for (path, a), b, t in zip(src_leaves, dst_leaves, tmpl_leaves):
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(a) if jnp.issubdtype(
        a.dtype, jax.dtypes.prng_key) else a), np.asarray(jax.random.key_data(b) if jnp.issubdtype(
            b.dtype, jax.dtypes.prng_key) else b), err_msg=str(path))
    assert b.sharding == t.sharding, path
  del abstract_params


def test_train_step_on_a_mesh_equals_one_device():
  tx = optax.adamw(1e-2)
  schedule = optax.constant_schedule(1e-2)
  model_fn = lambda rngs: HybridLM(CONFIG, rngs=rngs, kda_class=layers.ContextParallelKDA)
  tokens = np.asarray(_tokens())
  batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1),
           "mask": np.ones(tokens.shape, np.float32)}

  mesh = make_mesh(MeshConfig(data=2, expert=2, context=2))
  graphdef, state = sharded_state.create_sharded_train_state(model_fn, tx, 0, mesh)
  wo = state.params["layers"][1]["ffn"]["wo"].get_value()
  assert wo.sharding.spec == P("expert")
  assert state.opt_state[0].mu["layers"][1]["ffn"]["wo"].get_value().sharding.spec == P("expert")
  state_specs = {p: v.get_value().sharding.spec for p, v in nnx.to_flat_state(state.params)}
  # One-device expectation: the reference gradients through the same optimizer.
  # (The step donates its input state, so this is computed first.)
  loss_ref, _, grads_ref = _reference()
  params0 = jax.device_get(state.params)
  expected = jax.jit(lambda g, p: optax.apply_updates(p, tx.update(g, tx.init(p), p)[0]))(
      grads_ref, params0)
  step = make_train_step(graphdef, tx, schedule)
  with jax.set_mesh(mesh):
    new, metrics = step(state, sharded_state.shard_batch(batch, mesh))
  tol = TOL[jnp.dtype(jnp.float32)]
  np.testing.assert_allclose(float(metrics["loss"]), float(loss_ref), rtol=tol["logits"])
  np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(grads_ref)),
                             rtol=tol["grad"])
  ref = dict(nnx.to_flat_state(expected))
  before = dict(nnx.to_flat_state(params0))
  for path, var in nnx.to_flat_state(new.params):
    # Adam's first step moves each weight by about lr * sign(grad): compare updates.
    delta = np.asarray(var.get_value()) - np.asarray(before[path].get_value())
    assert_close(delta, np.asarray(ref[path].get_value()) - np.asarray(before[path].get_value()),
                 1e-4, f"{path}")
    assert var.get_value().sharding.spec == state_specs[path]
