"""Device-mesh parallelism: parallel config and context-parallel layers
(see docs/sharding.md).

Modules: `config` (ParallelConfig), `context_parallel`, `layers`
(mesh-aware KDA), `model_layout` (the model built for its mesh: which
KDA layer, how many stages); pipeline stages: `pipeline_layout` (the
checks and the boundary formula), `pipeline` (the GPipe schedule),
`pipeline_residual` (a stage's residual stream), `pipelined_lm`
(`PipelinedLM`), `stage_storage` (the layers stacked per stage, and
checkpoints between layouts), `pipeline_bytes` (boundary bytes, predicted and
measured). Expert parallelism is part of the MoE
layer's execution path, `k3jax.layers.moe_path`. The mesh and the
logical-axis rules live one level down, in `k3jax.sharding`; the sharded
train state is `k3jax.train.sharded_state`.
"""
