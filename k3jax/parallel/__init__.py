"""Device-mesh parallelism: mesh from config, logical-axis rules, expert- and
context-parallel layers (see docs/sharding.md).

Modules: `mesh` (MeshConfig, make_mesh), `config` (ParallelConfig), `rules`
(logical names -> mesh axes), `expert_parallel`, `context_parallel`, `layers`
(mesh-aware KDA / MoE, `parallelize`), `training` (sharded train state, batches).
"""
