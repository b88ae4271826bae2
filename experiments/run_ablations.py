"""Runs the ablation sweeps (decay, router, residual) as concurrent processes and writes summary.json.

Full setting, 3 seeds, on one H200 (repository root; GPU wheels installed as in configs/gpu_150m.py):

  python3 experiments/run_ablations.py --out=/tmp/ablations --setting=full --seeds=0,1,2 --jobs=8 \
      --max_wall_s=380 --stop_after_s=500 --summary=$OUT/ablations_summary.json \
      --archive=$OUT/ablation_runs.tar.gz

Each run is a separate process (`XLA_PYTHON_CLIENT_PREALLOCATE=false`), at most
`--jobs` at a time, assigned round-robin to `--num_gpus` GPUs through
`CUDA_VISIBLE_DEVICES`; processes share a persistent compilation cache under
`--out`, and one run of every distinct program is launched first, so the other
seeds and tasks of a variant load its compiled programs. Finished runs are
skipped and unfinished ones resume, so the same command continues a cut-off
sweep. Every run directory lands under `--out/<sweep>/<variant>/<task>/seed<k>`,
its log under `--out/logs/`. The exit status is 1 if any run is missing.

Then, in the checkout: copy the summary to docs/results/ablations_summary.json and render the page

  python experiments/run_ablations.py --render_only --summary=docs/results/ablations_summary.json \
      --results_page=docs/results.md

(the page shows the findings' tables; `--render_only --summary=...` without `--results_page`
prints every table of the summary, every column and task; extract the archive into
runs/ablations_full for the notebooks' curves in the "full" setting).
If a call was cut off (the summary lists `missing` runs), a second call on a fresh machine with
`--merge_summary=<first summary>` runs only the missing ones and writes one combined summary.
"""
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time

from absl import app
from absl import flags

# The launcher itself never computes; should anything in it touch a GPU, it must not reserve memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Run from a checkout without installing: the repository root holds the k3jax package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3jax.ablations import record  # noqa: E402
from k3jax.ablations import runs as runs_lib  # noqa: E402
from k3jax.ablations import summary as summary_lib  # noqa: E402
from k3jax.ablations.sweeps import ALL_SWEEPS, SETTINGS, SWEEPS, make_sweep  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory for every run directory, logs and summary.json.")
flags.DEFINE_enum("setting", "full", SETTINGS, "Sweep size: quick (CPU) or full (GPU).")
flags.DEFINE_list("sweeps", list(SWEEPS), f"Sweeps to run (any of {ALL_SWEEPS}).")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds; one run per seed, variant and task.")
flags.DEFINE_integer("jobs", 8, "Runs at a time (separate processes).")
flags.DEFINE_integer("num_gpus", -1, "GPUs to spread runs over round-robin; -1 counts them with "
                     "nvidia-smi, 0 runs on the CPU.")
flags.DEFINE_list("gpu_ids", [], "Physical GPU ids to spread runs over instead of the first "
                  "--num_gpus (e.g. 1 keeps GPU 0 free for another job).")
flags.DEFINE_integer("max_wall_s", 0, "Launch no new run after this many seconds (0: no limit); "
                     "the summary then lists the runs left out, and a rerun continues.")
flags.DEFINE_integer("stop_after_s", 0, "Send SIGTERM to runs still going after this many seconds "
                     "(0: never); they save a checkpoint and exit, the summary lists them as missing, and "
                     "a rerun resumes them.")
flags.DEFINE_string("archive", None, "Also write a .tar.gz of every run's config.json, metrics.jsonl and "
                    "ablation_summary.json (no checkpoints) here, for the notebooks' curves elsewhere.")
flags.DEFINE_string("merge_summary", None, "An earlier summary.json (e.g. from a cut-off call on another "
                    "machine): its runs count as done and are neither launched again nor missing.")
flags.DEFINE_string("summary", None, "Where to write summary.json (default: <out>/summary.json).")
flags.DEFINE_string("results_page", None, "Markdown page whose tables are rendered from the summary "
                    "(e.g. docs/results.md).")
flags.DEFINE_bool("render_only", False, "Only render --results_page from --summary (without "
                  "--results_page: print every full table of --summary).")
flags.DEFINE_list("combine", [], "Summaries of earlier calls (e.g. a sweep finished in parts) to "
                  "combine into --summary (later files win per run); then render --results_page.")
flags.DEFINE_list("set", [], "Config overrides added to every run's base overrides (a variant's "
                  "own overrides still win), as dotted=value (e.g. model.moe_impl=buffered); recorded "
                  "in each run's config.json. Use a fresh --out: run keys do not change.")
flags.DEFINE_bool("deterministic", True, "Bitwise-repeatable GPU ops for the router sweep, whose "
                  "causality probe compares two forwards exactly. The other sweeps never ask for them: "
                  "with them, XLA (jax 0.11.2, H200) fails to compile the 8-layer residual models "
                  "(IndexError from raw_hash_map::at).")
flags.DEFINE_string("worker", None, "Internal: run the one run with this key and exit.")


def parse_set(items) -> tuple:
  """`--set` items -> ((dotted name, value), ...); values are bools, ints, floats or strings."""
  out = []
  for item in items:
    name, sep, raw = item.partition("=")
    if not sep or not name:
      raise app.UsageError(f"--set item {item!r} is not dotted.name=value")
    value = raw
    if raw.lower() in ("true", "false"):
      value = raw.lower() == "true"
    else:
      for cast in (int, float):
        try:
          value = cast(raw)
          break
        except ValueError:
          pass
    out.append((name, value))
  return tuple(out)


def _with_set(spec):
  extra = parse_set(FLAGS.set)
  return dataclasses.replace(spec, base=spec.base + extra) if extra else spec


def _specs():
  seeds = tuple(int(s) for s in FLAGS.seeds)
  specs = []
  for name in FLAGS.sweeps:
    specs += [_with_set(s) for s in make_sweep(name, FLAGS.setting, seeds).runs()]
  return specs


def _gpu_ids() -> list[int]:
  """Physical GPU ids the runs are spread over ([] = CPU)."""
  if FLAGS.gpu_ids:
    return [int(g) for g in FLAGS.gpu_ids]
  return list(range(_gpu_count()))


def _gpu_count() -> int:
  if FLAGS.gpu_ids:
    return len(FLAGS.gpu_ids)
  if FLAGS.num_gpus >= 0:
    return FLAGS.num_gpus
  if shutil.which("nvidia-smi") is None:
    return 0
  out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
  return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _order(specs):
  """One run of every distinct program first (first seed, first task: they fill the shared
  compilation cache), deeper models first within a wave; then the runs that hit the cache."""
  seeds = sorted({s.seed for s in specs})
  def rank(spec):
    task_index = [t.name for t in make_sweep(spec.sweep, FLAGS.setting, (spec.seed,)).tasks].index(spec.task.name)
    wave = 0 if (spec.seed == seeds[0] and task_index == 0) else 1
    return (wave, spec.seed, task_index, -spec.config().model.num_layers, spec.key)
  return sorted(specs, key=rank)


def _env(gpu: int | None, cache_dir: str, deterministic: bool = False) -> dict:
  env = dict(os.environ)
  env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="1",
             JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1")
  if gpu is None:
    env["JAX_PLATFORMS"] = "cpu"
  else:
    env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    if deterministic:
      # Bitwise-repeatable GPU reductions: the causality probe compares two forwards exactly.
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
  return env


def _launch_all(specs, out: str):
  """Runs every spec in its own process; returns {key: return code} of the launched ones."""
  gpus = _gpu_ids()
  ngpu = len(gpus)
  cache_dir = os.path.join(out, "jax_cache")
  log_dir = os.path.join(out, "logs")
  os.makedirs(log_dir, exist_ok=True)
  pending = list(_order(specs))
  running: dict[str, tuple[subprocess.Popen, float, object]] = {}
  codes: dict[str, int] = {}
  start = time.time()
  launched = 0
  stopped: set[str] = set()
  print(f"{len(pending)} runs, {FLAGS.jobs} at a time, "
        f"{'CPU' if ngpu == 0 else f'GPU(s) {gpus}'}; logs in {log_dir}", flush=True)
  while pending or running:
    while pending and len(running) < FLAGS.jobs:
      if FLAGS.max_wall_s and time.time() - start > FLAGS.max_wall_s:
        print(f"--max_wall_s={FLAGS.max_wall_s} reached: {len(pending)} runs not launched", flush=True)
        pending = []
        break
      spec = pending.pop(0)
      gpu = None if ngpu == 0 else gpus[launched % ngpu]
      launched += 1
      log = open(os.path.join(log_dir, spec.key.replace("/", "__") + ".log"), "w", encoding="utf-8")
      cmd = [sys.executable, os.path.abspath(__file__), f"--worker={spec.key}", f"--out={out}",
             f"--setting={FLAGS.setting}", "--set=" + ",".join(FLAGS.set)]
      env = _env(gpu, cache_dir, FLAGS.deterministic and spec.sweep == "router")
      running[spec.key] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
                           time.time(), log)
    time.sleep(0.5)
    if FLAGS.stop_after_s and time.time() - start > FLAGS.stop_after_s:
      for key, (proc, _, _) in running.items():
        if proc.poll() is None and key not in stopped:
          print(f"--stop_after_s={FLAGS.stop_after_s} reached: stopping {key}", flush=True)
          proc.send_signal(signal.SIGTERM)
          stopped.add(key)
      pending = []
    for key, (proc, t0, log) in list(running.items()):
      if proc.poll() is not None:
        log.close()
        codes[key] = proc.returncode
        del running[key]
        status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}, see logs/)"
        print(f"[{time.time() - start:7.1f}s] {key}: {status} in {time.time() - t0:.1f}s; "
              f"{len(pending)} waiting, {len(running)} running", flush=True)
  return codes


def _worker(key: str, out: str):
  sweep_name = key.split("/")[0]
  seed = int(key.rsplit("seed", 1)[1])
  for spec in make_sweep(sweep_name, FLAGS.setting, (seed,)).runs():
    spec = _with_set(spec)
    if spec.key == key:
      import jax  # pylint: disable=g-import-not-at-top
      jax.config.update("jax_compilation_cache_dir", os.environ.get("JAX_COMPILATION_CACHE_DIR", ""))
      t0 = time.time()
      summary = record.run_or_load(spec, out)
      print(f"{key}: done in {time.time() - t0:.1f}s on {jax.devices()[0].device_kind}; "
            f"final eval {summary.get('final_eval')}", flush=True)
      return
  raise app.UsageError(f"--worker={key!r} is no run of the {FLAGS.setting} setting")


def _archive(specs, out: str, path: str) -> None:
  """tar.gz of each run's small files, named as under --out (extract into ABLATION_RUNS)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with tarfile.open(path, "w:gz") as tar:
    for spec in specs:
      for name in ("config.json", "metrics.jsonl", runs_lib.SUMMARY_FILE):
        full = os.path.join(runs_lib.workdir_of(spec, out), name)
        if os.path.isfile(full):
          tar.add(full, arcname=os.path.join(spec.key, name))


def main(argv):
  del argv
  summary_path = FLAGS.summary
  if FLAGS.combine:
    if not summary_path:
      raise app.UsageError("--combine needs --summary (the combined file to write)")
    combined = summary_lib.combine_summaries(summary_lib.read_summary(p) for p in FLAGS.combine)
    summary_lib.write_summary(combined, summary_path)
    print(f"{len(combined['runs'])} runs from {len(FLAGS.combine)} summaries in {summary_path}; "
          f"missing: {combined['missing'] or 'none'}")
    if FLAGS.results_page:
      summary_lib.update_results_page(FLAGS.results_page, summary_path)
      print(f"rendered {FLAGS.results_page}")
    return
  if FLAGS.render_only:
    if not summary_path:
      raise app.UsageError("--render_only needs --summary")
    if not FLAGS.results_page:
      print(summary_lib.tables_text(summary_lib.read_summary(summary_path)))
      return
    summary_lib.update_results_page(FLAGS.results_page, summary_path)
    print(f"rendered {FLAGS.results_page} from {summary_path}")
    return
  if not FLAGS.out:
    raise app.UsageError("--out is required")
  out = os.path.abspath(FLAGS.out)
  if FLAGS.worker:
    _worker(FLAGS.worker, out)
    return
  for name in FLAGS.sweeps:
    if name not in ALL_SWEEPS:
      raise app.UsageError(f"--sweeps: unknown sweep {name!r}; allowed: {ALL_SWEEPS}")
  specs = _specs()
  earlier = {}
  if FLAGS.merge_summary:
    earlier = {r["key"]: r for r in summary_lib.read_summary(FLAGS.merge_summary)["runs"]
               if r.get("setting") == FLAGS.setting}
  t0 = time.time()
  codes = _launch_all([s for s in specs if s.key not in earlier], out)
  wall = time.time() - t0
  records, missing = [], []
  for spec in specs:
    rec = runs_lib.load_run_summary(runs_lib.workdir_of(spec, out)) or earlier.get(spec.key)
    (records if rec is not None else missing).append(rec if rec is not None else spec.key)
  summary = summary_lib.make_summary(records, setting=FLAGS.setting)
  summary.update(wall_s=round(wall, 1), jobs=FLAGS.jobs, num_gpus=_gpu_count(), missing=missing,
                 failed=sorted(k for k, c in codes.items() if c != 0))
  summary_path = summary_path or os.path.join(out, "summary.json")
  summary_lib.write_summary(summary, summary_path)
  print(f"{len(records)} runs summarised in {summary_path} ({wall:.0f}s wall); "
        f"missing: {missing or 'none'}", flush=True)
  if FLAGS.archive:
    _archive(specs, out, FLAGS.archive)
    print(f"run metrics archived in {FLAGS.archive}")
  if FLAGS.results_page:
    summary_lib.update_results_page(FLAGS.results_page, summary_path)
    print(f"rendered {FLAGS.results_page}")
  if missing:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
