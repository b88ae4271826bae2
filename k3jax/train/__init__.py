"""Training: `trainer.train_and_evaluate(config, workdir)` and its parts.

Modules: `defaults` (every config field, commented), `config_schema` (validation
before compute), `config_files` (loading `configs/*.py`), `optimizer`, `state`,
`step` (jitted train/eval steps), `checkpoint` (orbax + save on signal),
`metrics` (JSONL + TensorBoard), `trainer`. Nothing is imported here, so light
users (checkpoint readers) do not pay for the whole stack.
"""
