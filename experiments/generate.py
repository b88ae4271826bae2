"""Samples continuations from a trained HybridLM.

  python experiments/generate.py --workdir=runs/tiny --prompt="def main(" \
      --max_new_tokens=200 --temperature=0.8 --top_k=40

Byte-level runs (vocab 256) take a text prompt and print text; other
vocabularies take `--prompt_ids=1,2,3` and print ids. Without --workdir,
`--config` (a configs/*.py file) builds a randomly initialised model, which is
useful to check the decoding path end to end.
"""
import os
import sys

from absl import app
from absl import flags
from absl import logging

# Run from a checkout without installing: the repository root holds the k3jax package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax.models import generate as gen  # noqa: E402
from k3jax.models import lm  # noqa: E402
from k3jax.train.checkpoint import CheckpointError  # noqa: E402
from k3jax.train.config_files import load_config_file  # noqa: E402
from k3jax.train.config_schema import model_config_from  # noqa: E402
from k3jax.train.restore import restore_model  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Training run directory (config.json + checkpoints/).")
flags.DEFINE_string("config", None, "Config file for a randomly initialised model (no --workdir).")
flags.DEFINE_integer("step", None, "Checkpoint step to restore (default: the newest intact one).")
flags.DEFINE_string("prompt", "\n", "Text prompt (byte-level models).")
flags.DEFINE_string("prompt_ids", None, "Comma-separated token ids (overrides --prompt).")
flags.DEFINE_integer("num_samples", 1, "Continuations per prompt.")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate.")
flags.DEFINE_float("temperature", 1.0, "Softmax temperature; 0 is greedy.")
flags.DEFINE_integer("top_k", None, "Keep only the k most likely tokens.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_string("kda_decode", None, "KDA decode step: auto | pallas | fused | naive "
                    "(default: the model config's kda_decode).")


def _load():
  if FLAGS.workdir:
    try:
      model, cfg, step = restore_model(FLAGS.workdir, FLAGS.step)
    except (CheckpointError, ValueError) as e:  # a missing step lists the saved ones
      sys.exit(f"error: {e}")
    print(f"restored step {step} from {FLAGS.workdir}")
    return model, cfg
  if not FLAGS.config:
    raise app.UsageError("pass --workdir (trained run) or --config (random model)")
  cfg = model_config_from(load_config_file(FLAGS.config).model)
  print(f"random model from {FLAGS.config} (no checkpoint)")
  return lm.HybridLM(cfg, rngs=nnx.Rngs(FLAGS.seed)), cfg


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    # Library INFO lines (orbax's restore steps, backend probing) hide the samples.
    logging.set_verbosity(logging.WARNING)
  model, cfg = _load()
  if FLAGS.kda_decode:
    try:
      gen.set_kda_decode(model, FLAGS.kda_decode)
    except ValueError as e:
      raise app.UsageError(f"--kda_decode: {e}") from None
  byte_level = cfg.vocab_size == 256
  if FLAGS.prompt_ids:
    ids = [int(s) for s in FLAGS.prompt_ids.split(",") if s.strip()]
  elif byte_level:
    ids = list(FLAGS.prompt.encode("utf-8"))
  else:
    raise app.UsageError(f"vocab_size={cfg.vocab_size} is not byte-level; pass --prompt_ids")
  if not ids or max(ids) >= cfg.vocab_size or min(ids) < 0:
    raise app.UsageError(f"prompt ids must be non-empty and in [0, {cfg.vocab_size})")
  prompt = np.tile(np.asarray(ids, np.int32)[None], (FLAGS.num_samples, 1))
  out = gen.generate(model, prompt, max_new_tokens=FLAGS.max_new_tokens,
                     key=jax.random.key(FLAGS.seed), temperature=FLAGS.temperature,
                     top_k=FLAGS.top_k)
  for i, row in enumerate(np.asarray(out)):
    print(f"--- sample {i}")
    if byte_level:
      print(bytes(row.astype(np.uint8).tolist()).decode("utf-8", errors="replace"))
    else:
      print(",".join(str(int(t)) for t in row))


if __name__ == "__main__":
  app.run(main)
