"""Evaluates a training run with lm-eval: `python experiments/evaluate.py --workdir=runs/tiny
--tasks=k3jax_python_next_line,k3jax_python_snippets`.

Needs the `eval` extra (`pip install -e ".[eval]"`). `--tasks` names lm-eval tasks or
groups: the bundled ones (k3jax/eval/tasks, offline), those of `--include_path`
directories, or lm-eval's own (their datasets download only with `--nooffline`). The run's
model (newest checkpoint, or `--step`) reads text through the run's tokenizer, in rows of
the run's seq_len (`--seq_len`). Writes `<workdir>/eval/<tasks>-step<N>.json` (or `--out`)
and prints lm-eval's table.

Exit status: 0 done, 2 an input error (one `error:` paragraph; `--traceback` or
K3JAX_TRACEBACK=1 adds the traceback), 1 anything unexpected.
"""
import json
import os
import sys

from absl import app
from absl import flags
from absl import logging

# Run from a checkout without installing: the repository root holds the k3jax package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3jax.train import cli_errors  # noqa: E402
from k3jax.train.checkpoint import CheckpointError  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Training run directory (config.json + checkpoints/).")
flags.DEFINE_list("tasks", None, "Comma-separated lm-eval task or group names.")
flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
flags.DEFINE_integer("limit", None, "Documents per task (default: all).")
flags.DEFINE_integer("num_fewshot", None, "Few-shot examples (default: the task's).")
flags.DEFINE_integer("seq_len", None, "Positions per scored row (default: the run's seq_len).")
flags.DEFINE_integer("batch_rows", 8, "Rows per model call.")
flags.DEFINE_enum("packing", "auto", ["auto", "shared", "alone"],
                  "Requests sharing rows and batches: auto where the model routes each token on its "
                  "own (exact), shared always (faster; with a same-batch router or an expert "
                  "capacity a score then depends on its batch), alone never.")
flags.DEFINE_multi_string("include_path", [], "Further directories of lm-eval task YAMLs.")
flags.DEFINE_string("out", None, "Summary JSON path (default: <workdir>/eval/<tasks>-step<N>.json).")
flags.DEFINE_bool("offline", True, "Keep Hugging Face datasets and hub offline (the bundled "
                  "tasks need no network; lm-eval's own tasks download their data).")
flags.DEFINE_bool("traceback", False, "Print the traceback of an input error too (or set "
                  f"{cli_errors.TRACEBACK_ENV}=1).")
flags.mark_flags_as_required(["workdir", "tasks"])


def _check_flags():
  if not os.path.isfile(os.path.join(FLAGS.workdir, "config.json")):
    cli_errors.fail_input(f"--workdir={FLAGS.workdir!r} holds no config.json; give a training run "
                          "directory (experiments/train.py --workdir=...)")
  for name in ("limit", "seq_len", "batch_rows"):
    if FLAGS[name].value is not None and FLAGS[name].value < 1:
      cli_errors.fail_input(f"--{name}={FLAGS[name].value} must be >= 1")
  if FLAGS.num_fewshot is not None and FLAGS.num_fewshot < 0:
    cli_errors.fail_input(f"--num_fewshot={FLAGS.num_fewshot} must be >= 0")
  if not [t for t in FLAGS.tasks if t.strip()]:
    cli_errors.fail_input("--tasks is empty; name lm-eval tasks, e.g. "
                          "--tasks=k3jax_python_next_line")


def summary(results: dict, lm, tasks) -> dict:
  """The JSON written for a run: what was evaluated, how, and lm-eval's metrics."""
  return {"workdir": os.path.abspath(FLAGS.workdir), "step": lm.step, "tasks": list(tasks),
          "seq_len": lm.seq_len, "packing": FLAGS.packing, "limit": FLAGS.limit, "num_fewshot": FLAGS.num_fewshot,
          "tokenizer": lm.tokenizer_name, "lm_eval_version": results.get("lm_eval_version"),
          "results": results["results"], "groups": results.get("groups", {}),
          "versions": results.get("versions", {}), "n-shot": results.get("n-shot", {}),
          "n-samples": results.get("n-samples", {})}


def main(argv):
  if len(argv) > 1:
    cli_errors.fail_input(f"unexpected arguments {argv[1:]}: every setting is a flag, "
                          "e.g. --tasks=NAME")
  _check_flags()
  if FLAGS.offline:
    # Read when `datasets` and `huggingface_hub` are first imported, below.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  try:
    from k3jax.eval import harness  # lm-eval is the optional `eval` extra
    from lm_eval.utils import make_table  # the same extra
  except ImportError as e:
    cli_errors.fail_input(f"{e}: experiments/evaluate.py needs lm-eval: "
                          "pip install -e \".[eval]\"")
  tasks = [t.strip() for t in FLAGS.tasks if t.strip()]
  try:
    share_rows = {"auto": None, "shared": True, "alone": False}[FLAGS.packing]
    lm = harness.HarnessLM.from_run(FLAGS.workdir, FLAGS.step, seq_len=FLAGS.seq_len,
                                    batch_rows=FLAGS.batch_rows, share_rows=share_rows)
    results = harness.evaluate(lm, tasks, include_paths=FLAGS.include_path, limit=FLAGS.limit,
                               num_fewshot=FLAGS.num_fewshot)
  except (ValueError, CheckpointError) as e:
    cli_errors.fail_input(str(e))
  out = FLAGS.out or os.path.join(FLAGS.workdir, "eval", f"{'+'.join(tasks)}-step{lm.step}.json")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(summary(results, lm, tasks), f, indent=2, sort_keys=True, default=str)
  print(make_table(results))
  print(f"step {lm.step} of {FLAGS.workdir}; wrote {out}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli_errors.parse_flags)
