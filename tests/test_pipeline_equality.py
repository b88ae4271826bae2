"""The pipelined HybridLM (8 fake CPU devices) equals the one-device model: loss and every
parameter gradient at float32, over stages, microbatches, residuals, MoE, and composed
with the data, expert and context axes."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax.layers import moe_path
from k3jax.models.config import ModelConfig
from k3jax.models.lm import HybridLM
from k3jax.parallel import pipeline, stage_storage
from k3jax.parallel.layers import ContextParallelKDA
from k3jax.parallel.pipelined_lm import PipelinedLM
from k3jax.routing.config import RouterConfig
from k3jax.sharding import rules
from k3jax.sharding.mesh import MeshConfig, make_mesh
from pallas_kernels.kda.spec import KdaSpec
from tests.call_counts import count_calls
from tests.kda_inputs import assert_close

TOL = 1e-5  # relative, float32: the pipeline changes only the order of reductions
BATCH, LENGTH = 16, 16
# The CPU backend's code generation unoptimised: the same XLA program (its HLO passes all
# run), compiled in about half the time; nothing here is timed.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.cache
def config(residual: str, experts: int) -> ModelConfig:
  # Attention mixers (the cheapest to compile; KDA runs pipelined in the trainer test) and a
  # per-token router without capacity, whose routing does not depend on the batch, so
  # microbatches route as the whole batch does. Ragged experts serve expert parallelism too.
  return ModelConfig(vocab_size=32, d_model=8, num_layers=4, layer_pattern="A", num_heads=2,
                     head_dim=4, num_kv_heads=2, num_experts=experts, top_k=2, expert_hidden=8,
                     dense_hidden=8, first_layer_dense=False, residual=residual, moe_impl="ragged",
                     attnres_block_size=2, router=RouterConfig(name="topk", capacity_factor=None),
                     kda=KdaSpec(chunk_size=8, sub_chunk=4, lower_bound=-5.0))


def _tokens():
  return jax.random.randint(jax.random.key(3), (BATCH, LENGTH), 0, 32)


def _loss(model, tokens):
  logits, aux = model(tokens, deterministic=True)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.roll(tokens, -1, 1)).mean()
  return ce + aux["aux_loss"], aux


@functools.cache
def _reference(cfg: ModelConfig):
  """(loss, {path: gradient}, aux, the model) on one device; the model is initialised once
  per config, and the pipelined model stacks its values."""
  model = HybridLM(cfg, rngs=nnx.Rngs(0))
  loss, grads, aux = _loss_and_grads(nnx.graphdef(model))(nnx.state(model), _tokens())
  return float(loss), dict(nnx.to_flat_state(grads)), aux, model


def stacked_state(model: HybridLM, microbatches: int, stages: int):
  """`model`'s values in the layout of `PipelinedLM(model, microbatches, stages)`;
  `model` itself is left as it is."""
  copy = nnx.merge(*nnx.split(model))
  return nnx.state(PipelinedLM(copy, microbatches, stages))


def _loss_and_grads(graphdef):
  """jit of (state, tokens) -> (loss, parameter gradients, the model's aux dict)."""
  def run(state, tokens):
    (loss, aux), grads = nnx.value_and_grad(_loss, has_aux=True)(nnx.merge(graphdef, state), tokens)
    return loss, nnx.state(grads, nnx.Param), aux
  return jax.jit(run, compiler_options=FAST_COMPILE)


# Stages x microbatches, with and without block AttnRes and MoE; the cases of one model share
# its one-device reference. Beside the data axis: fsdp (parameters split along the model
# width), and expert with context (experts over expert, attention's heads over context).
@pytest.mark.parametrize("stages, microbatches, residual, experts, axes", [
    (2, 4, "prenorm", 0, {"data": 4}),
    (4, 8, "prenorm", 0, {"fsdp": 2, "data": 1}),
    (2, 8, "block_attnres", 4, {"data": 2}),
    (4, 4, "block_attnres", 4, {"data": 2}),
    (2, 4, "block_attnres", 4, {"expert": 2, "context": 2}),
])
def test_pipeline_equals_one_device(stages, microbatches, residual, experts, axes, monkeypatch):
  expert_parallel = moe_path.ExpertParallel() if axes.get("expert", 1) > 1 else None
  cfg = config(residual, experts)
  calls = count_calls(monkeypatch, ((pipeline, "gpipe", "gpipe"),
                                     (moe_path, "expert_parallel_swiglu", "expert")))
  mesh_config = MeshConfig(stage=stages, **axes)
  n_devices = stages * np.prod(list(axes.values()))
  mesh = make_mesh(mesh_config, devices=jax.devices()[:n_devices])
  loss_ref, grads_ref, aux_ref, model = _reference(cfg)
  abstract = nnx.eval_shape(lambda: PipelinedLM(HybridLM(
      cfg, rngs=nnx.Rngs(0), expert_parallel=expert_parallel, kda_class=ContextParallelKDA),
      microbatches, stages))
  graphdef = nnx.split(abstract)[0]
  state = rules.shard_tree(stacked_state(model, microbatches, stages), mesh)
  tokens = jax.device_put(_tokens(), rules.batch_sharding(mesh))

  with jax.set_mesh(mesh):
    loss, grads, aux = _loss_and_grads(graphdef)(state, tokens)
  # The pipeline ran (one stage program, traced once), and its MoE layers took their
  # expert-parallel path.
  assert calls["gpipe"] == 1
  assert calls["expert"] == (cfg.num_layers // stages if expert_parallel else 0)

  np.testing.assert_allclose(float(loss), loss_ref, rtol=TOL)
  # Every layer's statistics, by its global index; means, fractions and mins over the
  # microbatches equal the whole batch's (spreads such as max_vio are the microbatches').
  assert sorted(aux) == sorted(aux_ref)
  for key, value in aux.items():
    if key.rsplit("/", 1)[-1] in ("aux_loss", "drop_fraction", "reassigned_fraction", "mean", "min"):
      np.testing.assert_allclose(float(value), float(aux_ref[key]), rtol=TOL, atol=1e-7,
                                 err_msg=key)
    assert np.isfinite(float(value)), key
  # The stacked layers' gradients stay on their stages' devices.
  for path, var in nnx.to_flat_state(grads):
    if path[0] == stage_storage.STACKED:
      assert var.get_value().sharding.spec[0] == "stage", path
  flat = stage_storage.plain_items(nnx.to_flat_state(grads))
  assert len(flat) == len(grads_ref)
  for path, grad in flat:
    assert_close(grad, grads_ref[path].get_value(), TOL, f"d{path}")
