"""HybridLM with its layer stack pipelined over the mesh's stage axis.

    model = PipelinedLM(HybridLM(config, rngs=rngs), microbatches=8, stages=2)
    with jax.set_mesh(mesh):                  # a mesh whose stage axis is 2
      logits_btv, aux = model(tokens_bt)

`PipelinedLM` is built from a plain model's variables and stores its layers
stacked per stage (`stage_storage`): local layer j holds layers j,
L/S + j, ... with a leading dim S that the sharding rules put on the stage
axis, so each stage's devices hold only that stage's layers and their
optimizer moments. The other variables (embedding, head, residual queries)
are the plain model's. Checkpoints move between stage counts and to the plain
model (`k3jax.train.checkpoint`).

Under a mesh whose stage axis is S, `__call__` embeds the batch, cuts it
into microbatches, runs the layers on the GPipe schedule (`pipeline.gpipe`,
stage s holding layers [s L/S, (s + 1) L/S)) and applies the head. Under a
mesh without stages (or none), it runs the layers one after the other, each
read from its stack; so do `features`, `trace`, `prefill` and `decode` under
any mesh (under a stage mesh that gathers each layer from its stage: for
generation, restore the checkpoint into the plain model instead). The
embedding and the head run on every stage's devices.

Under a pipeline, `aux_loss` is the mean over microbatches of the summed layer
losses, and the per-layer statistics (`router/...`, `gate/...`) are reduced
over microbatches (`_layer_stats`: the mean, the min for a `min`). Routers
that look at the whole batch (quantile thresholds, capacities, the auxiliary
loss) see one microbatch at a time, as under gradient accumulation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers import segments as segments_lib
from k3jax.models.lm import HybridLM, ffn_stats, mixer_stats
from k3jax.parallel import pipeline, stage_storage
from k3jax.parallel.pipeline_layout import PipelineLayout
from k3jax.parallel.pipeline_residual import StageResidual
from k3jax.sharding import mesh as mesh_lib
from k3jax.sharding.rules import constrain

_BTD = ("batch", "length", "embed")


def _shard(x, axes):
  return constrain(x, axes, skip_indivisible=True)


class PipelinedLM(HybridLM):
  """HybridLM whose layers are stored stacked per stage and pipelined under a mesh with stages.

  Built from a plain `HybridLM` (`model`, whose variables it takes over: build
  the plain model for this alone) for `stages` (S) stages and `microbatches`
  (M) microbatches; `stage_layers` holds the L / S stacked layers, same values.

  Raises:
    ValueError: the counts are not positive ints, `model` is not a plain
      HybridLM, or its layers do not split into `stages` equal stages
      (`PipelineLayout.check_model` names the fix).
  """

  def __init__(self, model: HybridLM, microbatches: int, stages: int):
    layout = PipelineLayout(stages=stages, microbatches=microbatches)
    if type(model) is not HybridLM:  # pylint: disable=unidiomatic-typecheck
      raise ValueError(f"PipelinedLM needs a plain HybridLM, got {type(model).__name__}")
    layout.check_model(model.config)
    # The plain model's attributes in its order, `stage_layers` in place of `layers`.
    for name, value in vars(model).items():
      if name == "layers":
        continue
      if not name.startswith("_"):
        setattr(self, name, value)
    self.stage_layers = stage_storage.stack_layers(list(model.layers), stages)
    self.pipeline_stages = stages
    self.pipeline_microbatches = microbatches

  def _layer_modules(self):
    """The L layers in order, each read from its stack (slice s of stack j is layer s L/S + j)."""
    per_stage = len(self.stage_layers)
    layers = [None] * (per_stage * self.pipeline_stages)
    for j, stacked in enumerate(self.stage_layers):
      graphdef, state = nnx.split(stacked)
      for s in range(self.pipeline_stages):
        layers[stage_storage.layer_index(s, j, per_stage)] = nnx.merge(
            graphdef, stage_storage.stage_slice(state, s))
    return layers

  def __call__(self, tokens_bt: jax.Array, *, segment_ids: jax.Array | None = None,
               max_segments: int | None = None, deterministic: bool = False):
    """tokens_bt: [B, T] int -> (logits [B, T, V] float32, aux dict).

    `segment_ids` and `max_segments` as in `HybridLM.__call__`: the documents
    are cut into microbatches with the tokens and reach every stage's layers.
    """
    stages = mesh_lib.axis_size(mesh_lib.current_mesh(), mesh_lib.STAGE)
    if stages == 1:
      return super().__call__(tokens_bt, segment_ids=segment_ids, max_segments=max_segments,
                              deterministic=deterministic)
    if stages != self.pipeline_stages:
      raise ValueError(
          f"the model stores its layers for {self.pipeline_stages} pipeline stages and the mesh "
          f"has {stages}: build it with PipelinedLM(..., stages={stages}) (a checkpoint "
          "restores under any stage count)")
    layout = PipelineLayout(stages=stages, microbatches=self.pipeline_microbatches)
    segments = segments_lib.for_tokens(tokens_bt, segment_ids, max_segments)
    final_btd, aux = pipelined_layers(self, tokens_bt, layout, deterministic=deterministic,
                                      segments=segments)
    return self._logits(final_btd), aux


def _stage_residual(config, layout: PipelineLayout) -> StageResidual:
  return StageResidual(config.residual, block_size=config.attnres_block_size,
                       slots=layout.boundary_slots(config),
                       blocks_per_stage=layout.blocks_per_stage(config))


def _microbatches(x_b, n_micro: int):
  """[B, ...] -> [M, B / M, ...]: microbatch m holds rows m, M + m, 2M + m, ..."""
  return x_b.reshape(x_b.shape[0] // n_micro, n_micro, *x_b.shape[1:]).swapaxes(0, 1)


def pipelined_layers(model: PipelinedLM, tokens_bt: jax.Array, layout: PipelineLayout, *,
                     deterministic: bool, segments: segments_lib.Segments | None = None
                     ) -> tuple[jax.Array, dict]:
  """The embedding and the layers on the pipeline schedule.

  Args:
    model: the model (its variables, possibly traced), whose layers
      `PipelinedLM` checked and stacked for `layout.stages` stages.
    tokens_bt: [B, T] int; B divisible by the microbatches.
    layout: stages (the mesh's stage axis) and microbatches.
    deterministic: passed to the FFNs.
    segments: the rows' documents (`k3jax.layers.segments`) or None; cut into
      microbatches like the tokens, each stage's layers get their microbatch's.

  Returns:
    (the final stream [B, T, D] before the head, HybridLM's aux dict: the mean
    over microbatches of the layers' summed aux losses, and the per-layer
    `router/...` and `gate/...` statistics over microbatches, `_layer_stats`;
    with segments, `segments/overflow_rows` of the whole batch).
  """
  cfg = model.config
  n_micro = layout.microbatches
  batch, length = tokens_bt.shape
  if batch % n_micro:
    raise ValueError(f"batch of {batch} sequences does not divide into "
                     f"parallel.microbatches={n_micro} microbatches")
  x_btd = _shard(jnp.take(model.embed[...], tokens_bt, axis=0).astype(cfg.compute_dtype), _BTD)
  # Microbatch m holds rows m, M + m, 2M + m, ...: a reshape that keeps each device's
  # rows (a batch split over n devices in blocks of B / n, a multiple of M) in place.
  x_mbtd = _shard(_microbatches(x_btd, n_micro), (None, *_BTD))
  segments_m = jax.tree.map(lambda a: _microbatches(a, n_micro), segments)
  residual = _stage_residual(cfg, layout)
  graphdefs, layer_states = zip(*(nnx.split(stack) for stack in model.stage_layers))
  stacked, shared = {"layers": list(layer_states)}, {}
  if residual.mixes:
    # Row l of the padded table is sublayer l's query (row 0: sublayer 0, which
    # has one source and no query); row 2L is the final read's.
    queries = model.residual.queries[...]
    padded = jnp.concatenate([jnp.zeros_like(queries[:1]), queries])
    stacked["queries"] = padded[:-1].reshape(layout.stages, -1, queries.shape[-1])
    shared["finish"] = padded[-1]

  def stage_fn(block, shared, buf_in, x_btd, stage, segments):
    del x_btd  # stage 0's buffer is built by `start`
    stream = residual.enter(buf_in, stage)
    # Keyed by the local layer j; `_layer_stats` renames them by the global layer.
    stats = {"aux_loss": jnp.zeros((), jnp.float32)}
    for j, graphdef in enumerate(graphdefs):
      layer = nnx.merge(graphdef, stage_storage.stage_slice(block["layers"][j], 0))
      for sub in (0, 1):
        local = 2 * j + sub
        query = block["queries"][0, local] if residual.mixes else None
        stream_btd = residual.read(stream, query)
        if sub == 0:
          out, mixer_aux = layer.mixer(layer.mixer_norm(stream_btd), segments)
          stats.update(mixer_stats(j, layer.kind, mixer_aux))
        else:
          out, ffn_aux = layer.ffn(layer.ffn_norm(stream_btd), deterministic=deterministic,
                                   segments=segments)
          stats["aux_loss"] += jnp.asarray(ffn_aux.get("aux_loss", 0.0), jnp.float32)
          stats.update(ffn_stats(j, ffn_aux))
        stream = residual.write(stream, local, _shard(out, _BTD))
    final = residual.finish(stream, shared.get("finish"))
    return residual.leave(stream), final, stats

  mesh = mesh_lib.current_mesh()
  final_mbtd, stats_sm = pipeline.gpipe(stage_fn, stacked, shared, x_mbtd,
                                        start=residual.start, mesh=mesh, side_m=segments_m)
  final_btd = final_mbtd.swapaxes(0, 1).reshape(batch, length, -1)
  aux = _layer_stats(stats_sm, len(graphdefs))
  aux.update(segments_lib.overflow_aux(segments))
  return _shard(final_btd, _BTD), aux


def _layer_stats(stats_sm: dict, per_stage: int) -> dict:
  """The [S, M] statistics of `gpipe` as HybridLM's aux: per global layer, over microbatches.

  `aux_loss` is the sum over stages, mean over microbatches. A per-layer entry
  `<kind>/<j>/<name>` of stage s becomes `<kind>/<s L/S + j>/<name>`: the min
  over microbatches for a `min`, else the mean (exact for the means and
  fractions; a spread such as `max_vio` is the mean of the microbatches').
  """
  aux = {"aux_loss": jnp.mean(jnp.sum(stats_sm["aux_loss"], axis=0))}
  for key, value_sm in stats_sm.items():
    if key == "aux_loss":
      continue
    kind, j, name = key.split("/", 2)
    reduced_s = jnp.min(value_sm, axis=1) if name == "min" else jnp.mean(value_sm, axis=1)
    for s in range(value_sm.shape[0]):
      aux[f"{kind}/{stage_storage.layer_index(s, int(j), per_stage)}/{name}"] = reduced_s[s]
  return aux
