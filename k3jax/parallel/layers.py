"""The mesh-aware variant of the KDA layer.

The variant changes only where the work runs: under a mesh (`jax.set_mesh`)
whose context axis is > 1, KDA's chunked scan runs context-parallel. Without
such a mesh it is the plain layer. Parameters and their names are the same,
so checkpoints and states are interchangeable with the plain model. A model
is built with it: `HybridLM(config, rngs=rngs, kda_class=ContextParallelKDA)`.

The MoE layers need no variant: their execution path, expert-parallel
included, is chosen when they are built (`k3jax.layers.moe_path`).
"""
from __future__ import annotations

from k3jax.layers.kda import KDA
from k3jax.parallel import context_parallel
from k3jax.sharding import mesh as mesh_lib


def _axis(name: str) -> int:
  return mesh_lib.axis_size(mesh_lib.current_mesh(), name)


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
  device); a batch the devices do not divide runs unsplit. Documents packed
  in a row (`segments`) run on either path with a context axis of 1 (their
  run indices split like the batch); a context axis > 1 raises.
  """

  def _kernel(self, q, k, v, g, beta, initial_state=None, output_final_state=False,
              gate_bias=None, segment_ids=None):
    n_batch = _batch_devices()
    batch_split = (self.spec.implementation == "pallas" and n_batch > 1
                   and q.shape[0] % n_batch == 0)
    if _axis(mesh_lib.CONTEXT) == 1 and not batch_split:
      return super()._kernel(q, k, v, g, beta, initial_state, output_final_state, gate_bias,
                             segment_ids)
    fused = {} if gate_bias is None else dict(gate_activation="bounded_sigmoid",
                                              gate_bias=gate_bias)
    # Documents (segment_ids) travel with the batch split; a context axis > 1 refuses them.
    return context_parallel.chunk_kda_context_parallel(
        q, k, v, g, beta, mesh=mesh_lib.current_mesh(), initial_state=initial_state,
        output_final_state=output_final_state, spec=self.spec, interpret=self.interpret,
        segment_ids=segment_ids, **fused)
