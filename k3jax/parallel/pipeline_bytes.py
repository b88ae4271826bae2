"""Bytes of a pipeline: what crosses a stage boundary (predicted from the layout, measured
from the compiled program) and what each device stores.

    predicted_boundary_bytes(config, layout, microbatch_tokens)
    measured_boundary_bytes(config, layout, batch=B, seq_len=T)   # compiles the forward
    state_bytes_per_device(config, stages, tx)                    # from the shapes alone

The prediction is `PipelineLayout.boundary_slots` tensors of one microbatch's
[mb, T, D] in the compute dtype. The measurement compiles the pipelined forward
on S devices of a stage-only mesh (one device per stage, so an operand is a
whole microbatch's) and sums the operand sizes of the program's
collective-permutes that come from a `ppermute`: the one of the tick loop,
which runs once per tick, so its operand is what one stage sends the next per
microbatch. The partitioner's own permutes (`is_spmd_generated`: moving the
attention-residual query rows to their stages, once per step) are left out.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.models.config import ModelConfig
from k3jax.models.lm import HybridLM
from k3jax.parallel.pipeline_layout import PipelineLayout
from k3jax.parallel.pipelined_lm import PipelinedLM
from k3jax.parallel.stage_storage import PLAIN, STACKED
from k3jax.sharding import rules as rules_lib
from k3jax.sharding.mesh import MeshConfig, make_mesh

# `%name = f32[2,4,16]{...} collective-permute(...)`, or a start op whose result is a
# tuple led by its operand: `(f32[2,4,16]{...}, ...) collective-permute-start(...)`.
_PERMUTE = re.compile(r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\][^=]*?\s(collective-permute(?:-start)?)\(")
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "pred": 1,
             "s8": 1, "u8": 1}


def collective_permute_operands(hlo_text: str, *, spmd_generated: bool = False
                                ) -> list[tuple[str, tuple[int, ...], int]]:
  """(dtype, shape, bytes) of every collective-permute in an HLO module's text that a
  `ppermute` asked for (with `spmd_generated`, instead those the partitioner added)."""
  found = []
  for line in hlo_text.splitlines():
    match = _PERMUTE.search(line)
    if match and ('is_spmd_generated="true"' in line) == spmd_generated:
      dtype, dims = match.group(1), match.group(2)
      shape = tuple(int(d) for d in dims.split(",") if d)
      found.append((dtype, shape, int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]))
  return found


def predicted_boundary_bytes(config: ModelConfig, layout: PipelineLayout,
                             microbatch_tokens: int) -> int:
  """boundary_slots x microbatch tokens x d_model x the compute dtype's bytes."""
  itemsize = jnp.dtype(config.compute_dtype).itemsize
  return layout.boundary_slots(config) * microbatch_tokens * config.d_model * itemsize


def measured_boundary_bytes(config: ModelConfig, layout: PipelineLayout, *, batch: int,
                            seq_len: int) -> int:
  """Collective-permute operand bytes of the compiled pipelined forward (per microbatch and
  boundary), on the first S devices; nothing is run."""
  layout.check_model(config)
  layout.check_batch(batch, 1)
  mesh = make_mesh(MeshConfig(stage=layout.stages, data=1),
                   devices=jax.devices()[:layout.stages])
  abstract = nnx.eval_shape(lambda: PipelinedLM(HybridLM(config, rngs=nnx.Rngs(0)),
                                                          layout.microbatches, layout.stages))
  graphdef, state = nnx.split(abstract)

  def forward(state, tokens_bt):
    return nnx.merge(graphdef, state)(tokens_bt, deterministic=True)[0]

  tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  with jax.set_mesh(mesh):
    text = jax.jit(forward).lower(state, tokens).compile().as_text()
  return sum(size for _, _, size in collective_permute_operands(text))


def state_bytes_per_device(config: ModelConfig, stages: int, tx, *,
                           rules: rules_lib.Rules = rules_lib.DEFAULT_RULES) -> dict[str, int]:
  """Bytes of the parameters and the optimizer state one device stores under `stages` stages.

  From the shapes and the sharding rules alone, on a mesh of `stages` devices
  (stage only; 1 is the plain model). Returns {"layers": the decoder layers'
  part, "other": the embedding, head, norms and queries, "total"}.
  """
  mesh = make_mesh(MeshConfig(stage=stages, data=1), devices=jax.devices()[:stages])

  def build():
    model = HybridLM(config, rngs=nnx.Rngs(0))
    return PipelinedLM(model, 1, stages) if stages > 1 else model

  params = nnx.state(nnx.eval_shape(build), nnx.Param)
  tree = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}
  shardings = jax.tree.leaves(rules_lib.tree_shardings(tree, mesh, rules))
  out = {"layers": 0, "other": 0}
  for (path, leaf), sharding in zip(jax.tree_util.tree_flatten_with_path(tree)[0], shardings):
    part = "layers" if any(getattr(p, "key", None) in (PLAIN, STACKED) for p in path) else "other"
    out[part] += int(np.prod(sharding.shard_shape(leaf.shape), dtype=np.int64)) * leaf.dtype.itemsize
  out["total"] = out["layers"] + out["other"]
  return out
