"""Long-context evaluation of the bounded vs softplus gate hybrids and the attention reference.

Trains (or loads) every run of the "long" sweep (`k3jax/ablations/sweeps.py::long_sweep`),
evaluates each far past its training length (`k3jax/ablations/long_context.py`), writes a
summary JSON and prints the tables.

CPU, tiny models trained at 64 tokens, evaluated to 64x (18 runs, about 10 minutes on 2 shared cores):

  python experiments/long_context.py --out=runs/long_quick --setting=quick --seeds=0,1,2 \
      --summary=docs/results/long_context_quick.json --results_page=docs/results.md

GPU (H200), models trained at 2048 tokens, evaluated at 2k/8k/32k/128k tokens, MQAR gaps of
8x-64x, and a decode check after a 128k-token prefill. Train the runs concurrently first,
then evaluate (GPU wheels installed as in configs/gpu_150m.py):

  python3 experiments/run_ablations.py --out=/tmp/long --setting=full --sweeps=long --seeds=0,1,2 \
      --jobs=6 --max_wall_s=400 --stop_after_s=540 --summary=$OUT/long_train.json
  python3 experiments/long_context.py --out=/tmp/long --setting=full --seeds=0,1,2 --notrain \
      --summary=$OUT/long_context_full.json

(`run_ablations.py` already evaluates each run; repeat the first command until its summary lists no
missing runs; the second command only collects the cached records and prints the tables, and with
--notrain stops with an error rather than training a missing run inside the call.) Then, in the
checkout, render the results page from the copied summary:

  python experiments/long_context.py --render_only --summary=docs/results/long_context_full.json \
      --results_page=docs/results.md

Run directories trained elsewhere (e.g. `configs/ablations/long_context.py` at the gpu_150m scale) are
evaluated with `--runs=DIR1,DIR2 --names=bounded,softplus`. A run directory lives only as long as the
call that trained it, so each call evaluates its own runs into a summary of its own, and the summaries
come together here:

  python experiments/long_context.py --combine=long_bounded.json,long_softplus.json,long_attention.json \
      --summary=docs/results/long_context_full.json --results_page=docs/results.md
"""
import json
import os
import sys

from absl import app
from absl import flags
from absl import logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3jax.ablations import long_context as lc  # noqa: E402
from k3jax.ablations import record  # noqa: E402
from k3jax.ablations import runs as runs_lib  # noqa: E402
from k3jax.ablations import summary as summary_lib  # noqa: E402
from k3jax.ablations.sweeps import SETTINGS, make_sweep  # noqa: E402
from k3jax.train.run_config import load_run_config  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory of the sweep's run directories (trained here if missing).")
flags.DEFINE_enum("setting", "quick", SETTINGS, "Sweep size: quick (CPU) or full (GPU).")
flags.DEFINE_list("seeds", ["0"], "Seeds of the sweep.")
flags.DEFINE_list("variants", [], "Only these variants (default: bounded, softplus, attention).")
flags.DEFINE_list("tasks", [], "Only these tasks (default: bytes, mqar).")
flags.DEFINE_bool("train", True, "Train missing runs in this process; with --notrain a missing run "
                  "is an error.")
flags.DEFINE_bool("force_eval", False, "Evaluate again even where a run's cached record is current.")
flags.DEFINE_list("runs", [], "Evaluate these run directories instead of the sweep's.")
flags.DEFINE_list("names", [], "Variant names of --runs (default: the directory names).")
flags.DEFINE_list("multipliers", ["1", "4", "16", "64"], "--runs: evaluation lengths in training lengths.")
flags.DEFINE_list("gaps", ["8", "16", "32", "64"], "--runs: MQAR gaps in training lengths.")
flags.DEFINE_integer("decode_prefill_x", 0, "--runs: prefill this many training lengths, then decode "
                     "--decode_new tokens against the full forward (0: no decode check).")
flags.DEFINE_integer("decode_new", 256, "--runs: tokens decoded after the prefill.")
flags.DEFINE_string("summary", None, "Summary JSON to write (default: <out>/long_context_summary.json).")
flags.DEFINE_string("results_page", None, "Markdown page whose `<!-- long:NAME -->` tables are rendered.")
flags.DEFINE_bool("render_only", False, "Only print the tables of --summary (every one, every column) "
                  "and render --results_page if given.")
flags.DEFINE_list("combine", [], "Summaries of earlier calls (e.g. one per arm, each evaluated with "
                  "--runs in the call that trained it) to combine into --summary (later files win per "
                  "run); then print the tables and render --results_page.")


def _ints(values, name):
  try:
    return tuple(int(v) for v in values)
  except ValueError as e:
    raise app.UsageError(f"--{name} must be integers, got {values}") from e


def _sweep_records():
  sweep = make_sweep("long", FLAGS.setting, _ints(FLAGS.seeds, "seeds"))
  specs = sweep.runs()
  for flag, names in (("variants", {v.name for v in sweep.variants}), ("tasks", {t.name for t in sweep.tasks})):
    unknown = set(getattr(FLAGS, flag)) - names
    if unknown:
      raise app.UsageError(f"--{flag}: unknown {sorted(unknown)}; allowed: {sorted(names)}")
  specs = [s for s in specs if (not FLAGS.variants or s.variant.name in FLAGS.variants)
           and (not FLAGS.tasks or s.task.name in FLAGS.tasks)]
  records = []
  for spec in specs:
    workdir = runs_lib.workdir_of(spec, FLAGS.out)
    if not FLAGS.train and not runs_lib.is_finished(workdir, spec.config().num_steps):
      raise app.UsageError(f"run {spec.key} is not trained under {FLAGS.out} (drop --notrain to train it)")
    print(f"[long] {spec.key}", flush=True)
    records.append(record.run_or_load(spec, FLAGS.out, force_eval=FLAGS.force_eval))
  return records


def _dir_records():
  names = FLAGS.names or [os.path.basename(os.path.normpath(d)) for d in FLAGS.runs]
  if len(names) != len(FLAGS.runs):
    raise app.UsageError(f"--names has {len(names)} entries for {len(FLAGS.runs)} --runs")
  records = []
  for name, workdir in zip(names, FLAGS.runs):
    print(f"[long] {workdir}", flush=True)
    rec = lc.evaluate_run(workdir, multipliers=_ints(FLAGS.multipliers, "multipliers"),
                          gap_multipliers=_ints(FLAGS.gaps, "gaps"), decode_prefill_x=FLAGS.decode_prefill_x,
                          decode_new=FLAGS.decode_new)
    task = "mqar" if rec["data"] == "mqar" else "bytes"
    seed = int(_seed_of(workdir))
    records.append({"key": f"long/{name}/{task}/seed{seed}", "sweep": "long", "setting": FLAGS.setting,
                    "variant": name, "task": task, "seed": seed, "step": rec["step"], "long": rec})
  return records


def _seed_of(workdir):
  return load_run_config(workdir).seed


def _print_tables(summary):
  page = "\n\n".join(f"<!-- long:{name} -->\n<!-- /long -->" for name in ("meta", *lc.LONG_TABLES))
  print(lc.render_long_tables(page, summary).replace("<!-- /long -->", "").replace("<!-- long:", "\n<!-- long:"))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # no per-step trainer lines unless asked for
  if FLAGS.render_only:
    if not FLAGS.summary:
      raise app.UsageError("--render_only needs --summary")
    summary = summary_lib.read_summary(FLAGS.summary)
  elif FLAGS.combine:
    if not FLAGS.summary or FLAGS.runs or FLAGS.out:
      raise app.UsageError("--combine needs --summary (the combined file to write), and no --runs or --out")
    try:
      summary = summary_lib.combine_summaries(summary_lib.read_summary(p) for p in FLAGS.combine)
    except ValueError as e:
      raise app.UsageError(f"--combine: {e}") from e
    summary_lib.write_summary(summary, FLAGS.summary)
    print(f"wrote {FLAGS.summary}: {len(summary['runs'])} runs from {len(FLAGS.combine)} summaries")
  else:
    if FLAGS.runs:
      records = _dir_records()
    elif FLAGS.out:
      records = _sweep_records()
    else:
      raise app.UsageError("give --out (the long sweep) or --runs (run directories)")
    summary = summary_lib.make_summary(records, setting=FLAGS.setting)
    path = FLAGS.summary or os.path.join(FLAGS.out or ".", "long_context_summary.json")
    summary_lib.write_summary(_json_safe(summary), path)
    print(f"wrote {path}")
  _print_tables(summary)
  if FLAGS.results_page:
    with open(FLAGS.results_page, encoding="utf-8") as f:
      text = f.read()
    with open(FLAGS.results_page, "w", encoding="utf-8") as f:
      f.write(lc.render_long_tables(text, summary))
    print(f"rendered {FLAGS.results_page}")


def _json_safe(summary):
  """NaN/inf (e.g. an empty bucket's loss) become None: the summary is strict JSON."""
  return json.loads(json.dumps(record.finite_or_none(summary)))


if __name__ == "__main__":
  app.run(main)
