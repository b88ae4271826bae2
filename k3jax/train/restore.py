"""A trained model back from its run directory: `config.json` plus the checkpoints."""
from __future__ import annotations

import os

from flax import nnx

from k3jax.models import lm
from k3jax.models.config import ModelConfig
from k3jax.train.checkpoint import Checkpointer
from k3jax.train.config_schema import model_config_from
from k3jax.train.optimizer import make_optimizer
from k3jax.train.run_config import load_run_config
from k3jax.train.state import create_train_state


def restore_model(workdir: str, step: int | None = None) -> tuple[lm.HybridLM, ModelConfig, int]:
  """Rebuilds the HybridLM of a training run directory from its checkpoint.

  Reads `<workdir>/config.json` (written by the trainer), builds the model and
  an optimizer-state template from it, and restores `<workdir>/checkpoints`
  at `step` (default: latest).

  Returns:
    (model, model_config, restored step).
  """
  config = load_run_config(workdir)
  model_cfg = model_config_from(config.model)
  tx, _ = make_optimizer(config.optim, config.num_steps)
  graphdef, template = create_train_state(lambda rngs: lm.HybridLM(model_cfg, rngs=rngs), tx,
                                          config.seed)
  ckpt = Checkpointer(os.path.join(os.path.abspath(workdir), "checkpoints"), async_save=False)
  try:
    restored = ckpt.restore(template, step)
  finally:
    ckpt.close()
  if restored is None:
    raise ValueError(f"no checkpoint under {workdir}/checkpoints")
  state, _ = restored
  return nnx.merge(graphdef, state.params, state.model_state), model_cfg, int(state.step)
