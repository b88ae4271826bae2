"""Run-or-load of sweep runs keyed by run directory, and metrics.jsonl readers."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np

from k3jax.ablations.sweeps import RunSpec
from k3jax.train import trainer
from k3jax.train.metrics import read_jsonl
from k3jax.train.run_config import read_saved_config

SUMMARY_FILE = "ablation_summary.json"


def workdir_of(spec: RunSpec, out_dir: str) -> str:
  """The run directory of `spec` under the sweep output directory."""
  return os.path.join(out_dir, spec.key)


def finished_step(workdir: str) -> int:
  """The last step with an eval record in `<workdir>/metrics.jsonl` (-1 if none or no file)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    return -1
  evals = read_jsonl(path, split="eval")
  return int(evals[-1]["step"]) if evals else -1


def is_finished(workdir: str, num_steps: int) -> bool:
  """Whether the run in `workdir` trained `num_steps` steps and evaluated at the end."""
  return finished_step(workdir) >= num_steps and os.path.isdir(os.path.join(workdir, "checkpoints"))


def train_run(spec: RunSpec, out_dir: str) -> str:
  """Trains `spec` unless its directory already holds the finished run; returns the run directory.

  An unfinished run resumes from its latest checkpoint (the trainer does that).
  A run directory whose config differs from `spec`'s raises ValueError rather
  than mixing two experiments.
  """
  workdir = workdir_of(spec, out_dir)
  config = spec.config()
  _check_same_config(workdir, config)
  if not is_finished(workdir, config.num_steps):
    result = trainer.train_and_evaluate(config, workdir)
    if result["interrupted"]:
      raise RuntimeError(f"run {spec.key} was interrupted at step {result['step']}; run again to resume")
  return workdir


def _check_same_config(workdir: str, config) -> None:
  old = read_saved_config(workdir)
  if old is None:
    return
  new = json.loads(config.to_json_best_effort())
  if _normalise(old) != _normalise(new):
    diff = sorted(k for k in set(_flat(old)) | set(_flat(new)) if _flat(old).get(k) != _flat(new).get(k))
    raise ValueError(f"{workdir} holds a run with a different config (fields {diff}); "
                     "use another output directory or delete it")


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = list(v) if isinstance(v, (list, tuple)) else v
  return out


def _normalise(d: dict) -> dict:
  # The trainer fills in the tokenizer's digest; a spec leaves it empty.
  return {k: v for k, v in _flat(d).items() if k != "data.tokenizer_sha256"}


def load_run_summary(workdir: str) -> dict | None:
  """The cached summary record of a run directory, or None."""
  path = os.path.join(workdir, SUMMARY_FILE)
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


# -- metrics.jsonl readers -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Series:
  """One metric over steps: steps [N] int, values [N] float (NaN where a record lacks it)."""
  steps: np.ndarray
  values: np.ndarray


def load_metrics(workdir: str, split: str) -> dict[str, Series]:
  """Reads `<workdir>/metrics.jsonl` into {metric name: Series} for one split ("train" or "eval")."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise ValueError(f"{path} does not exist; is {workdir!r} a training run directory?")
  records = read_jsonl(path, split=split)
  steps = np.array([r["step"] for r in records], np.int64)
  names = sorted({k for r in records for k in r if k not in ("step", "split")})
  return {name: Series(steps, np.array([np.nan if r.get(name) is None else r[name] for r in records],
                                       np.float64))
          for name in names}


def per_layer(metrics: dict[str, Series], stat: str, prefix: str = "router") -> dict[int, Series]:
  """{layer: Series} of `<prefix>/<layer>/<stat>` entries (e.g. router/1/max_vio)."""
  pattern = re.compile(rf"^{re.escape(prefix)}/(\d+)/{re.escape(stat)}$")
  out = {}
  for name, series in metrics.items():
    m = pattern.match(name)
    if m:
      out[int(m.group(1))] = series
  return dict(sorted(out.items()))


def tail_mean(series: Series, fraction: float = 0.25) -> float:
  """Mean of the last `fraction` of the records (at least one); NaN for an empty series."""
  if not 0 < fraction <= 1:
    raise ValueError(f"fraction must be in (0, 1], got {fraction}")
  v = series.values[np.isfinite(series.values)]
  if v.size == 0:
    return float("nan")
  n = max(1, int(round(fraction * v.size)))
  return float(np.mean(v[-n:]))
