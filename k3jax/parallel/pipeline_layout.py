"""Where a model's layers split into pipeline stages, and what crosses a stage boundary.

    layout = PipelineLayout(stages=2, microbatches=8)
    layout.check_model(model_config)               # ValueError naming the fix
    layout.check_batch(batch_size, batch_devices)
    layout.boundary_slots(model_config)            # [mb, T, D] tensors sent per microbatch

Stage s holds layers [s L/S, (s + 1) L/S). Every stage runs the same program
on its own slice of the stacked layer parameters, so every stage must hold
the same layer kinds in the same order. With block attention residuals a
stage boundary must fall on a block boundary: then the running partial sum
is empty there and only the embedding and the completed block summaries
cross (docs/sharding.md, "Pipeline parallelism").
"""
from __future__ import annotations

import dataclasses

from k3jax.models.config import ModelConfig


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
  """Pipeline stages (the mesh's stage axis) and the microbatches a step's batch is cut into."""

  stages: int
  microbatches: int

  def __post_init__(self):
    for name in ("stages", "microbatches"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"parallel.{name}={value!r}; must be a positive int")

  def layers_per_stage(self, config: ModelConfig) -> int:
    return config.num_layers // self.stages

  def stage_layers(self, config: ModelConfig, stage: int) -> range:
    """The layer indices of `stage`."""
    n = self.layers_per_stage(config)
    return range(stage * n, (stage + 1) * n)

  def check_model(self, config: ModelConfig) -> None:
    """Raises ValueError unless `config`'s layers split into `stages` equal stages."""
    s, layers = self.stages, config.num_layers
    if s == 1:
      return
    if layers % s:
      options = [d for d in _divisors(layers) if d > 1]
      raise ValueError(
          f"parallel.stages={s} does not divide model.num_layers={layers}: every stage holds "
          f"the same number of layers. Stage counts that divide it: {options or 'none above 1'}")
    kinds = [self._stage_kinds(config, i) for i in range(s)]
    for i, k in enumerate(kinds):
      if k != kinds[0]:
        raise ValueError(
            f"parallel.stages={s}: stage {i} holds layers {self._show(k)}, stage 0 "
            f"{self._show(kinds[0])}; every stage runs the same program, so every stage must "
            "hold the same layer kinds. Use a model.layer_pattern whose length divides "
            f"model.num_layers / stages = {layers // s}"
            + (" and model.first_layer_dense=False" if config.first_layer_dense
               and config.num_experts else ""))
    if config.residual == "block_attnres":
      per_stage = 2 * layers // s
      block = config.attnres_block_size
      if per_stage % block:
        stage_options = [d for d in _divisors(layers) if d > 1 and (2 * layers // d) % block == 0]
        block_options = _divisors(per_stage)
        raise ValueError(
            f"parallel.stages={s}: a stage holds {per_stage} sublayers, which is not a whole "
            f"number of attention-residual blocks (model.attnres_block_size={block}), so a "
            "stage boundary would cut a block. Boundaries on block boundaries: "
            f"parallel.stages in {stage_options or 'none above 1'}, or "
            f"model.attnres_block_size in {block_options}")
    if config.num_experts and config.router.stateful:
      raise ValueError(
          f"parallel.stages={s} with model.router.name={config.router.name!r}: a stateful "
          "router updates its bias once per batch, and a pipeline runs every layer once per "
          "microbatch. Use a stateless router (quantile, topk, aux_loss, expert_choice)")

  def check_batch(self, batch_size: int, batch_devices: int) -> None:
    """Raises ValueError unless `batch_size` sequences split into whole microbatches whose
    sequences the `batch_devices` devices of one stage divide."""
    if self.stages == 1 and self.microbatches == 1:
      return
    per = self.microbatches * batch_devices
    if batch_size % per:
      options = (_divisors(batch_size // batch_devices) if batch_size % batch_devices == 0
                 else [])
      raise ValueError(
          f"batch_size={batch_size} does not divide into parallel.microbatches="
          f"{self.microbatches} microbatches of a multiple of the {batch_devices} devices that "
          f"split the batch (microbatches x devices = {per}). Use a batch_size that is a "
          f"multiple of {per}" + (f", or parallel.microbatches in {options}" if options else ""))

  def boundary_slots(self, config: ModelConfig) -> int:
    """[mb, T, D] tensors one stage sends the next per microbatch.

    Every boundary sends the same shape (one program on every stage), so this
    is the largest boundary's count, the last one's: the running sum for the
    pre-norm residual; the embedding plus every completed block summary before
    the last stage for block AttnRes (sublayer outputs for full AttnRes).
    """
    if config.residual == "prenorm":
      return 1
    return 1 + (self.stages - 1) * self.blocks_per_stage(config)

  def blocks_per_stage(self, config: ModelConfig) -> int:
    """Attention-residual blocks one stage completes (a full-AttnRes block is one sublayer)."""
    per_block = 1 if config.residual == "full_attnres" else config.attnres_block_size
    return 2 * self.layers_per_stage(config) // per_block

  def bubble_fraction(self) -> float:
    """Idle share of each stage under the GPipe schedule: (S - 1) / (M + S - 1)."""
    return (self.stages - 1) / (self.microbatches + self.stages - 1)

  def _stage_kinds(self, config: ModelConfig, stage: int) -> tuple:
    """(mixer kind, MoE FFN?) of each layer of `stage`."""
    return tuple((config.layer_types[i], config.is_moe_layer(i))
                 for i in self.stage_layers(config, stage))

  @staticmethod
  def _show(kinds: tuple) -> str:
    return "".join(kind + ("(moe)" if moe else "(dense ffn)") for kind, moe in kinds)
