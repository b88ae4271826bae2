"""The model built for its mesh: which KDA layer, which attention documents path, how many
pipeline stages.

    layout = ModelLayout.for_mesh(sizes, config.kda.implementation, microbatches=8)
    model = layout.build_lm(config, rngs=rngs)   # HybridLM or PipelinedLM

The choices are made here, once, from the mesh's axis sizes, and the model is
constructed with them; every layout holds the same parameters under the same
names (`PipelinedLM` stacks the layers per stage), so checkpoints move between
layouts.
"""
from __future__ import annotations

import dataclasses
import math

from flax import nnx

from k3jax.layers.attention import CausalSelfAttention
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
    attention_documents: the attention layers' `documents` path: None for
      the layer's default (cuDNN's packed layout on GPU where it compiles),
      "mask" on a mesh of more than one device, where the packed layout's
      split over devices waits for its two-GPU twin
      (tests/test_attention.py::test_gpu_packed_layout_with_the_batch_split).
    stages: pipeline stages; > 1 builds a `PipelinedLM`.
    microbatches: the pipeline's microbatches (1 without stages).
  """
  mesh_aware_kda: bool = False
  attention_documents: str | None = None
  stages: int = 1
  microbatches: int = 1

  @classmethod
  def for_mesh(cls, sizes: dict, kda_implementation: str, microbatches: int) -> ModelLayout:
    """The layout for a mesh of axis `sizes` ({"stage", "data", "fsdp", "expert", "context"})."""
    batch_devices = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    splits_kernel_calls = kda_implementation == "pallas" and batch_devices > 1
    stages = sizes["stage"]
    one_device = math.prod(sizes.values()) == 1
    return cls(mesh_aware_kda=sizes["context"] > 1 or splits_kernel_calls,
               attention_documents=None if one_device else "mask", stages=stages,
               microbatches=microbatches if stages > 1 else 1)

  @property
  def kda_class(self) -> type[KDA]:
    return ContextParallelKDA if self.mesh_aware_kda else KDA

  def build_lm(self, config: ModelConfig, *, rngs: nnx.Rngs, moe_impl: str | None = None,
               expert_parallel: ExpertParallel | None = None) -> HybridLM:
    """`HybridLM(config, ...)` built for this layout (a `PipelinedLM` under stages)."""
    return self.pipelined(HybridLM(config, rngs=rngs, moe_impl=moe_impl,
                                   expert_parallel=expert_parallel, kda_class=self.kda_class,
                                   attention_documents=self.attention_documents))

  def pipelined(self, model: nnx.Module) -> nnx.Module:
    """`model` (a plain HybridLM under stages) as this layout's pipeline; itself without stages.

    Raises:
      ValueError: stages > 1 and `model` is not a plain HybridLM whose layers
        split into the stages.
    """
    return PipelinedLM(model, self.microbatches, self.stages) if self.stages > 1 else model

  def check_built_for(self, model: nnx.Module) -> None:
    """Raises ValueError when `model`, built elsewhere, holds a KDA layer that this layout
    needs mesh-aware, or an attention layer on another documents path than the layout's
    (the layout cannot be changed after construction)."""
    for path, module in nnx.iter_modules(model):
      where = "/".join(map(str, path))
      if self.mesh_aware_kda and type(module) is KDA:  # pylint: disable=unidiomatic-typecheck
        raise ValueError(f"the KDA layer at {where} must be a "
                         "k3jax.parallel.layers.ContextParallelKDA on this mesh (context > 1, or "
                         "a Pallas kernel on a batch split over devices): build it with that class")
      if (self.attention_documents is not None and isinstance(module, CausalSelfAttention)
          and module.documents != self.attention_documents):
        raise ValueError(f"the attention layer at {where} keeps documents apart with "
                         f"{module.documents!r}, but this mesh needs "
                         f"{self.attention_documents!r}: build it with "
                         f"documents={self.attention_documents!r}")
