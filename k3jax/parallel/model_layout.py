"""The model built for its mesh: which KDA layer, how many pipeline stages.

    layout = ModelLayout.for_mesh(sizes, config.kda.implementation, microbatches=8)
    model = layout.build_lm(config, rngs=rngs)   # HybridLM or PipelinedLM

Both choices are made here, once, from the mesh's axis sizes, and the model is
constructed with them; every layout holds the same parameters under the same
names (`PipelinedLM` stacks the layers per stage), so checkpoints move between
layouts.
"""
from __future__ import annotations

import dataclasses

from flax import nnx

from k3jax.layers.kda import KDA
from k3jax.layers.moe_path import ExpertParallel
from k3jax.models.config import ModelConfig
from k3jax.models.lm import HybridLM
from k3jax.parallel.layers import ContextParallelKDA
from k3jax.parallel.pipelined_lm import PipelinedLM


@dataclasses.dataclass(frozen=True)
class ModelLayout:
  """How a model is built for a mesh.

  Attributes:
    mesh_aware_kda: the KDA layers are `ContextParallelKDA`, which calls the
      kernel through the mesh: needed when the mesh splits the sequence
      (context > 1), or splits the batch while the kernel is Pallas (the
      compiler cannot split a kernel call over the batch).
    stages: pipeline stages; > 1 builds a `PipelinedLM`.
    microbatches: the pipeline's microbatches (1 without stages).
  """
  mesh_aware_kda: bool = False
  stages: int = 1
  microbatches: int = 1

  @classmethod
  def for_mesh(cls, sizes: dict, kda_implementation: str, microbatches: int) -> ModelLayout:
    """The layout for a mesh of axis `sizes` ({"stage", "data", "fsdp", "expert", "context"})."""
    batch_devices = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    splits_kernel_calls = kda_implementation == "pallas" and batch_devices > 1
    stages = sizes["stage"]
    return cls(mesh_aware_kda=sizes["context"] > 1 or splits_kernel_calls, stages=stages,
               microbatches=microbatches if stages > 1 else 1)

  @property
  def kda_class(self) -> type[KDA]:
    return ContextParallelKDA if self.mesh_aware_kda else KDA

  def build_lm(self, config: ModelConfig, *, rngs: nnx.Rngs, moe_impl: str | None = None,
               expert_parallel: ExpertParallel | None = None) -> HybridLM:
    """`HybridLM(config, ...)` built for this layout (a `PipelinedLM` under stages)."""
    return self.pipelined(HybridLM(config, rngs=rngs, moe_impl=moe_impl,
                                   expert_parallel=expert_parallel, kda_class=self.kda_class))

  def pipelined(self, model: nnx.Module) -> nnx.Module:
    """`model` (a plain HybridLM under stages) as this layout's pipeline; itself without stages.

    Raises:
      ValueError: stages > 1 and `model` is not a plain HybridLM whose layers
        split into the stages.
    """
    return PipelinedLM(model, self.microbatches, self.stages) if self.stages > 1 else model

  def check_built_for(self, model: nnx.Module) -> None:
    """Raises ValueError when `model`, built elsewhere, holds a KDA layer that this layout
    needs mesh-aware (the layout cannot be changed after construction)."""
    if not self.mesh_aware_kda:
      return
    for path, module in nnx.iter_modules(model):
      if type(module) is KDA:  # pylint: disable=unidiomatic-typecheck
        raise ValueError(f"the KDA layer at {'/'.join(map(str, path))} must be a "
                         "k3jax.parallel.layers.ContextParallelKDA on this mesh (context > 1, or "
                         "a Pallas kernel on a batch split over devices): build it with that class")
