"""Training: `trainer.train_and_evaluate(config, workdir)` and its parts.

Modules: `defaults` (every config field, commented), `config_schema` (validation
before compute), `config_files` (loading `configs/*.py`), `optimizer`, `state`,
`step` (jitted train/eval steps), `checkpoint` (orbax with per-step checksums +
save on signal), `run_config` (the saved `config.json` checked on resume),
`metrics` (JSONL + TensorBoard; superseded records moved aside on resume),
`report` (log lines and the closing summary), `workdir_lock` (one trainer per
run directory), `cli_errors` (the binary's exit codes and one-paragraph
errors), `trainer`. Nothing is imported here, so light users (checkpoint readers) do not
pay for the whole stack.
"""
