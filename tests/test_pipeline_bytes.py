"""Bytes crossing a pipeline stage boundary, measured from the compiled program's
collective-permutes, against the formula; full AttnRes pipelined equals one device."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.models.lm import HybridLM
from k3jax.parallel import pipeline_bytes
from k3jax.parallel.pipeline_layout import PipelineLayout
from k3jax.parallel.pipelined_lm import PipelinedLM
from k3jax.sharding import rules
from k3jax.sharding.mesh import MeshConfig, make_mesh
from tests.kda_inputs import assert_close
from tests.test_pipeline_equality import FAST_COMPILE, config

BATCH, LENGTH, MICRO = 8, 16, 4


def _slots(residual: str, stages: int, layers: int = 4, block: int = 2) -> int:
  """[mb, T, D] tensors per boundary, written out from the definitions: the running sum;
  or the embedding plus the block summaries completed before the last stage."""
  if residual == "prenorm":
    return 1
  per_block = 1 if residual == "full_attnres" else block
  blocks = 2 * layers // per_block
  return 1 + blocks * (stages - 1) // stages


@pytest.mark.parametrize("residual, stages", [
    ("prenorm", 2), ("block_attnres", 2), ("block_attnres", 4), ("full_attnres", 2)])
def test_bytes_crossing_a_boundary_match_the_formula(residual, stages):
  cfg = config(residual, 0)  # 4 layers, blocks of 2 sublayers, d_model 8, float32
  layout = PipelineLayout(stages=stages, microbatches=MICRO)
  measured = pipeline_bytes.measured_boundary_bytes(cfg, layout, batch=BATCH, seq_len=LENGTH)
  tensor = (BATCH // MICRO) * LENGTH * cfg.d_model * 4
  assert measured == _slots(residual, stages) * tensor
  assert measured == pipeline_bytes.predicted_boundary_bytes(cfg, layout,
                                                             (BATCH // MICRO) * LENGTH)


def test_block_boundaries_send_less_than_full_attnres():
  # 8 layers on 4 stages, 4 sublayers a stage: the running sum; the embedding + 3 block
  # summaries (blocks of 4 sublayers); the embedding + 3 x 4 sublayer outputs.
  sizes = {r: PipelineLayout(4, 4).boundary_slots(dataclasses.replace(
      config(r, 0), num_layers=8, attnres_block_size=4))
           for r in ("prenorm", "block_attnres", "full_attnres")}
  assert sizes == {"prenorm": 1, "block_attnres": 4, "full_attnres": 13}


def test_hlo_operand_parsing():
  text = "\n".join([
      '  %ppermute.5 = f32[3,2,16,8]{3,2,1,0} collective-permute(%x), channel_id=1, '
      'source_target_pairs={{0,1}}',
      '  %cp.1 = f32[1,8]{1,0} collective-permute(%y), frontend_attributes='
      '{is_spmd_generated="true"}',
      '  %cps = (bf16[4,8]{1,0}, bf16[4,8]{1,0}) collective-permute-start(%z)',
      '  %add = f32[4]{0} add(%a, %b)'])
  assert pipeline_bytes.collective_permute_operands(text) == [
      ("f32", (3, 2, 16, 8), 3072), ("bf16", (4, 8), 64)]
  assert pipeline_bytes.collective_permute_operands(text, spmd_generated=True) == [
      ("f32", (1, 8), 32)]


def test_full_attnres_forward_equals_one_device():
  cfg = config("full_attnres", 0)
  model = HybridLM(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(5), (BATCH, LENGTH), 0, cfg.vocab_size)
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, t: nnx.merge(graphdef, state)(t, deterministic=True)[0],
                    compiler_options=FAST_COMPILE)
  logits_ref = forward(state, tokens)
  mesh = make_mesh(MeshConfig(stage=4, data=2))
  pipelined = PipelinedLM(model, MICRO, stages=4)
  graphdef, state = nnx.split(pipelined)
  with jax.set_mesh(mesh):
    logits = jax.jit(lambda state, t: nnx.merge(graphdef, state)(t, deterministic=True)[0],
                     compiler_options=FAST_COMPILE)(
        rules.shard_tree(state, mesh), jax.device_put(tokens, rules.batch_sharding(mesh)))
  assert_close(logits, logits_ref, 1e-5, "logits")
  assert np.isfinite(np.asarray(logits, np.float64)).all() and logits.dtype == jnp.float32
