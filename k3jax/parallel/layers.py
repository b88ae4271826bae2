"""Mesh-aware variants of the KDA and MoE layers, and `parallelize(model)`.

The variants change only where the work runs: under a mesh (`jax.set_mesh`)
whose context axis is > 1, KDA's chunked scan runs context-parallel; whose
expert axis is > 1, the MoE's routed experts run expert-parallel. Without
such a mesh they are the plain layers. Parameters and their names are the
same, so checkpoints and states are interchangeable with the plain model.
"""
from __future__ import annotations

import jax
from flax import nnx

from k3jax.layers.kda import KDA
from k3jax.layers.moe import MoE
from k3jax.parallel import context_parallel
from k3jax.parallel import expert_parallel
from k3jax.sharding import mesh as mesh_lib


def _axis(name: str) -> int:
  mesh = expert_parallel.current_mesh()
  return 1 if mesh is None else mesh_lib.axis_size(mesh, name)


def _batch_devices() -> int:
  n = 1
  for name in (mesh_lib.DATA, mesh_lib.FSDP, mesh_lib.EXPERT):
    n *= _axis(name)
  return n


class ContextParallelKDA(KDA):
  """KDA whose kernel call is mesh-aware.

  Under a mesh with context > 1 the chunked scan is context-parallel. The
  Pallas kernels also run inside `shard_map` when only the batch is split
  (the compiler would otherwise run a kernel call on the whole batch on every
  device); a batch the devices do not divide runs unsplit.
  """

  def _kernel(self, q, k, v, g, beta, initial_state=None, output_final_state=False,
              gate_bias=None):
    n_batch = _batch_devices()
    batch_split = (self.spec.implementation == "pallas" and n_batch > 1
                   and q.shape[0] % n_batch == 0)
    if _axis(mesh_lib.CONTEXT) == 1 and not batch_split:
      return super()._kernel(q, k, v, g, beta, initial_state, output_final_state, gate_bias)
    fused = {} if gate_bias is None else dict(gate_activation="bounded_sigmoid",
                                              gate_bias=gate_bias)
    return context_parallel.chunk_kda_context_parallel(
        q, k, v, g, beta, mesh=expert_parallel.current_mesh(), initial_state=initial_state,
        output_final_state=output_final_state, spec=self.spec, interpret=self.interpret,
        **fused)


class ExpertParallelMoE(MoE):
  """MoE whose routed experts are expert-parallel under a mesh with expert > 1.

  Both grouped paths ("ragged", "buffered") dispatch through
  `expert_parallel.routed_experts` then, and the layer's aux reports the
  dispatch's drops as `dispatch_drop_fraction`; "dense" stays the reference.

  `ep_capacity_factor` (instance attribute, default None = lossless) sets the
  dispatch capacity; see `expert_parallel.routed_experts`. The "buffered"
  path groups the received rows into per-local-expert buffers sized by the
  router's capacity factor (with only an expert axis, the router's cap on
  each expert's load over the batch means these buffers never overflow).
  """

  ep_capacity_factor: float | None = None

  def _experts(self, x_nd, idx_nk, w_nk):
    c = self.config
    if _axis(mesh_lib.EXPERT) == 1 or c.impl == "dense":
      return super()._experts(x_nd, idx_nk, w_nk)
    buffered = c.impl == "buffered"
    return expert_parallel.routed_experts(
        x_nd, idx_nk, w_nk, self.wi_gate[...], self.wi_up[...], self.wo[...],
        capacity_factor=self.ep_capacity_factor, dtype=c.dtype, return_dropped=True,
        local_impl="buffered" if buffered else "ragged",
        local_capacity_factor=c.router.capacity_factor if buffered else None,
        grouped_backend="auto" if buffered else c.grouped_backend)


_SWAPS = ((MoE, ExpertParallelMoE), (KDA, ContextParallelKDA))


def parallelize(model: nnx.Module, *, capacity_factor: float | None = None) -> nnx.Module:
  """Turns every KDA / MoE layer of `model` into its mesh-aware variant, in place.

  The variants subclass the layers and hold the same variables, so the
  model's state (and any checkpoint of it) is unchanged. Returns `model`.
  """
  for _, module in nnx.iter_modules(model):
    for plain, variant in _SWAPS:
      if type(module) is plain:  # pylint: disable=unidiomatic-typecheck
        module.__class__ = variant
        if variant is ExpertParallelMoE:
          module.ep_capacity_factor = capacity_factor
  return model
