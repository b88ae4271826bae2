"""Device-mesh parallelism: parallel config, expert- and context-parallel
layers (see docs/sharding.md).

Modules: `config` (ParallelConfig), `expert_parallel`, `context_parallel`,
`layers` (mesh-aware KDA / MoE, `parallelize`). The mesh and the logical-axis
rules live one level down, in `k3jax.sharding`; the sharded train state is
`k3jax.train.sharded_state`.
"""
