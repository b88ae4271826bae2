"""A trained model back from its run directory: `config.json`, the checkpoints and the tokenizer."""
from __future__ import annotations

import os

from flax import nnx

from k3jax.data.prepared import PreparedData
from k3jax.data.tokenizer import BYTES_SPEC, SUFFIXES, Tokenizer, load_tokenizer
from k3jax.models import lm
from k3jax.models.config import ModelConfig
from k3jax.train.checkpoint import Checkpointer
from k3jax.train.config_schema import model_config_from
from k3jax.train.optimizer import make_optimizer
from k3jax.train.run_config import CONFIG_FILE, load_run_config
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


def run_tokenizer(config, workdir: str | None = None) -> Tokenizer | None:
  """The tokenizer of a trainer config's data, or None where the data are ids only.

  data.kind "bytes": the byte tokenizer. "prepared": the copy the trainer keeps
  in `workdir` (the file whose sha256 is data.tokenizer_sha256), or without a
  workdir the prepared directory's own. Token files and MQAR: None.
  ValueError when the run's tokenizer file is missing.
  """
  kind = config.data.kind
  if kind == BYTES_SPEC:
    return load_tokenizer(BYTES_SPEC)
  if kind != "prepared":
    return None
  if workdir is None:
    return PreparedData(config.data.path).tokenizer()
  want = config.data.get("tokenizer_sha256", "")
  names = sorted(n for n in os.listdir(workdir)
                 if os.path.splitext(n)[1] in SUFFIXES and n != CONFIG_FILE)
  for name in names:
    tok = load_tokenizer(os.path.join(workdir, name))
    if not want or tok.sha256 == want:
      return tok
  raise ValueError(f"the run in {workdir} was trained on prepared data, but none of its files "
                   f"{names or '(none)'} is its tokenizer (sha256 {want[:12] or '?'}...); copy the "
                   f"tokenizer {config.data.path} was prepared with into {workdir}")
