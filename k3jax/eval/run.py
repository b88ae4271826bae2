"""A run directory's model with the tokenizer it was trained with."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from k3jax.data.tokenizer import SUFFIXES, ByteTokenizer, Tokenizer, load_tokenizer
from k3jax.models import lm
from k3jax.train.restore import restore_model
from k3jax.train.run_config import load_run_config


@dataclasses.dataclass
class TrainedRun:
  """A restored run: `model`, its trainer `config`, checkpoint `step` and `tokenizer`."""
  workdir: str
  model: lm.HybridLM
  config: Any
  step: int
  tokenizer: Tokenizer


def run_tokenizer(workdir: str, digest: str) -> Tokenizer:
  """The tokenizer whose sha256 is `digest`: the byte tokenizer, or the copy of its file the
  trainer keeps in `workdir`.

  Raises:
    ValueError: no digest (the run trained on token ids) or no file in `workdir` with it.
  """
  if not digest:
    raise ValueError(f"the run in {workdir} has no tokenizer (config.json data.tokenizer_sha256 is "
                     "empty: it trained on token ids or synthetic data), so it cannot read text")
  if digest == ByteTokenizer().sha256:
    return ByteTokenizer()
  for name in sorted(os.listdir(workdir)):
    path = os.path.join(workdir, name)
    if name != "config.json" and os.path.splitext(name)[1] in SUFFIXES and os.path.isfile(path):
      tokenizer = load_tokenizer(path)
      if tokenizer.sha256 == digest:
        return tokenizer
  raise ValueError(f"no tokenizer file in {workdir} has the digest {digest[:12]}... that "
                   "config.json names (data.tokenizer_sha256); copy the run's tokenizer file there")


def load_run(workdir: str, step: int | None = None) -> TrainedRun:
  """The model of `workdir` at `step` (default: the newest checkpoint) and its tokenizer."""
  config = load_run_config(workdir)
  tokenizer = run_tokenizer(workdir, config.data.tokenizer_sha256)
  model, _, restored = restore_model(workdir, step)
  return TrainedRun(workdir=workdir, model=model, config=config, step=restored, tokenizer=tokenizer)
