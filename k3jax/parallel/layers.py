"""The mesh-aware variant of the KDA layer.

The variant changes only where the work runs: its kernel call goes through
the current mesh (`jax.set_mesh`), where a context axis > 1 runs KDA's
chunked scan context-parallel and a context axis of 1 runs the Pallas
kernels inside `shard_map` on each device's rows. Parameters and their names
are the same, so checkpoints and states are interchangeable with the plain
model. Whether a model needs it is decided once, when the model is built for
its mesh (`k3jax.parallel.model_layout.ModelLayout.for_mesh`), which passes
`HybridLM(config, rngs=rngs, kda_class=ContextParallelKDA)`.

The MoE layers need no variant: their execution path, expert-parallel
included, is chosen when they are built (`k3jax.layers.moe_path`).
"""
from __future__ import annotations

from k3jax.layers.kda import KDA
from k3jax.parallel import context_parallel
from k3jax.sharding import mesh as mesh_lib

NO_MESH_MESSAGE = (
    "ContextParallelKDA calls its kernel through the device mesh it was built for: call the "
    "model under jax.set_mesh(mesh), or build it for no mesh (the plain KDA layer, "
    "ModelLayout()) to run it on one device")


class ContextParallelKDA(KDA):
  """KDA whose kernel call is `chunk_kda_context_parallel` on the current mesh.

  Under a mesh with context > 1 the chunked scan is context-parallel; with
  context 1 the Pallas kernels run inside `shard_map` on each device's rows
  (the compiler would otherwise run a kernel call on the whole batch on every
  device). Called under its mesh (else a ValueError, `NO_MESH_MESSAGE`), on a
  batch the mesh's batch axes divide and a sequence its context axis divides
  (else a ValueError from `chunk_kda_context_parallel`). Documents packed in a
  row (`segments`) run with a context axis of 1 (their run indices split like
  the batch); a context axis > 1 raises.
  """

  def _kernel(self, q, k, v, g, beta, initial_state=None, output_final_state=False,
              gate_bias=None, segment_ids=None):
    mesh = mesh_lib.current_mesh()
    if mesh is None:
      raise ValueError(NO_MESH_MESSAGE)
    fused = {} if gate_bias is None else dict(gate_activation="bounded_sigmoid",
                                              gate_bias=gate_bias)
    return context_parallel.chunk_kda_context_parallel(
        q, k, v, g, beta, mesh=mesh, initial_state=initial_state,
        output_final_state=output_final_state, spec=self.spec, interpret=self.interpret,
        segment_ids=segment_ids, **fused)
