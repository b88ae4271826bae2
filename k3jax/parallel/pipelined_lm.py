"""HybridLM with its layer stack pipelined over the mesh's stage axis.

    model = pipeline_parallelize(HybridLM(config, rngs=rngs), microbatches=8)
    with jax.set_mesh(mesh):                  # a mesh whose stage axis is S > 1
      logits_btv, aux = model(tokens_bt)

`pipeline_parallelize` swaps the model's class for `PipelinedLM` in place
(same variables, so states and checkpoints are those of the plain model).
Under a mesh whose stage axis is > 1, `__call__` embeds the batch, cuts it
into microbatches, runs the layers on the GPipe schedule (`pipeline.gpipe`,
stage s holding layers [s L/S, (s + 1) L/S)) and applies the head; without
one it is the plain model. The embedding and the head run on every stage's
devices. `features`, `trace`, `prefill` and `decode` run unpipelined.

Per-layer statistics (`router/...`, `gate/...`) are not returned under a
pipeline; `aux_loss` is the mean over microbatches of the summed layer losses.
Routers that look at the whole batch (quantile thresholds, capacities, the
auxiliary loss) see one microbatch at a time, as under gradient accumulation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.models.lm import HybridLM
from k3jax.parallel import pipeline
from k3jax.parallel.pipeline_layout import PipelineLayout
from k3jax.parallel.pipeline_residual import StageResidual
from k3jax.sharding import mesh as mesh_lib
from k3jax.sharding.rules import constrain

_BTD = ("batch", "length", "embed")


def _shard(x, axes):
  return constrain(x, axes, skip_indivisible=True)


class PipelinedLM(HybridLM):
  """HybridLM whose `__call__` pipelines the layers when the mesh has stages.

  `pipeline_microbatches` (set by `pipeline_parallelize`) is M; the stage count
  S is the current mesh's stage axis.
  """

  pipeline_microbatches: int = 1

  def __call__(self, tokens_bt: jax.Array, *, deterministic: bool = False):
    """tokens_bt: [B, T] int -> (logits [B, T, V] float32, aux dict)."""
    stages = mesh_lib.axis_size(mesh_lib.current_mesh(), mesh_lib.STAGE)
    if stages == 1:
      return super().__call__(tokens_bt, deterministic=deterministic)
    layout = PipelineLayout(stages=stages, microbatches=self.pipeline_microbatches)
    final_btd, aux_loss = pipelined_layers(self, tokens_bt, layout, deterministic=deterministic)
    return self._logits(final_btd), {"aux_loss": aux_loss}


def pipeline_parallelize(model: HybridLM, microbatches: int) -> PipelinedLM:
  """Makes `model` a `PipelinedLM` with `microbatches` microbatches, in place; returns it."""
  PipelineLayout(stages=1, microbatches=microbatches)  # checks the count
  if not isinstance(model, HybridLM):
    raise ValueError(f"pipeline_parallelize needs a HybridLM, got {type(model).__name__}")
  model.__class__ = PipelinedLM
  model.pipeline_microbatches = microbatches
  return model


def _stage_residual(config, layout: PipelineLayout) -> StageResidual:
  return StageResidual(config.residual, block_size=config.attnres_block_size,
                       slots=layout.boundary_slots(config),
                       blocks_per_stage=layout.blocks_per_stage(config))


def _stacked_layers(model: HybridLM, layout: PipelineLayout):
  """Per local layer j: (its graphdef, its state stacked over stages [S, ...])."""
  per_stage = layout.layers_per_stage(model.config)
  graphdefs, states = [], []
  for j in range(per_stage):
    parts = [nnx.split(model.layers[s * per_stage + j]) for s in range(layout.stages)]
    for s, (graphdef, _) in enumerate(parts):
      if graphdef != parts[0][0]:
        raise ValueError(f"layer {s * per_stage + j} differs in structure from layer {j}: "
                         "every pipeline stage must hold the same layers")
    graphdefs.append(parts[0][0])
    states.append(jax.tree.map(lambda *xs: jnp.stack(xs), *[state for _, state in parts]))
  return graphdefs, states


def pipelined_layers(model: HybridLM, tokens_bt: jax.Array, layout: PipelineLayout, *,
                     deterministic: bool) -> tuple[jax.Array, jax.Array]:
  """The embedding and the layers on the pipeline schedule.

  Args:
    model: the model (its variables, possibly traced).
    tokens_bt: [B, T] int; B divisible by the microbatches.
    layout: stages (the mesh's stage axis) and microbatches.
    deterministic: passed to the FFNs.

  Returns:
    (the final stream [B, T, D] before the head, the mean over microbatches
    of the layers' summed aux losses).
  """
  cfg = model.config
  layout.check_model(cfg)
  n_micro = layout.microbatches
  batch, length = tokens_bt.shape
  if batch % n_micro:
    raise ValueError(f"batch of {batch} sequences does not divide into "
                     f"parallel.microbatches={n_micro} microbatches")
  x_btd = _shard(jnp.take(model.embed[...], tokens_bt, axis=0).astype(cfg.compute_dtype), _BTD)
  # Microbatch m holds rows m, M + m, 2M + m, ...: a reshape that keeps each device's
  # rows (a batch split over n devices in blocks of B / n, a multiple of M) in place.
  x_mbtd = x_btd.reshape(batch // n_micro, n_micro, length, -1).swapaxes(0, 1)
  x_mbtd = _shard(x_mbtd, (None, *_BTD))
  residual = _stage_residual(cfg, layout)
  graphdefs, layer_states = _stacked_layers(model, layout)
  stacked, shared = {"layers": layer_states}, {}
  if residual.mixes:
    # Row l of the padded table is sublayer l's query (row 0: sublayer 0, which
    # has one source and no query); row 2L is the final read's.
    queries = model.residual.queries[...]
    padded = jnp.concatenate([jnp.zeros_like(queries[:1]), queries])
    stacked["queries"] = padded[:-1].reshape(layout.stages, -1, queries.shape[-1])
    shared["finish"] = padded[-1]

  def stage_fn(params, shared, buf_in, x_btd, stage):
    del x_btd  # stage 0's buffer is built by `start`
    stream = residual.enter(buf_in, stage)
    aux = jnp.zeros((), jnp.float32)
    for j, graphdef in enumerate(graphdefs):
      layer = nnx.merge(graphdef, params["layers"][j])
      for sub in (0, 1):
        local = 2 * j + sub
        query = params["queries"][local] if residual.mixes else None
        stream_btd = residual.read(stream, query)
        if sub == 0:
          out, _ = layer.mixer(layer.mixer_norm(stream_btd))
        else:
          out, ffn_aux = layer.ffn(layer.ffn_norm(stream_btd), deterministic=deterministic)
          aux = aux + jnp.asarray(ffn_aux.get("aux_loss", 0.0), jnp.float32)
        stream = residual.write(stream, local, _shard(out, _BTD))
    final = residual.finish(stream, shared.get("finish"))
    return residual.leave(stream), final, aux

  mesh = mesh_lib.current_mesh()
  final_mbtd, aux = pipeline.gpipe(stage_fn, stacked, shared, x_mbtd, start=residual.start,
                                   mesh=mesh)
  final_btd = final_mbtd.swapaxes(0, 1).reshape(batch, length, -1)
  return _shard(final_btd, _BTD), aux / n_micro
