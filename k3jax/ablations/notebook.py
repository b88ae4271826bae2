"""What the ablation notebooks call first: run the quick sweep here, or load the full sweep's results.

* `quick`: trains the sweep's tiny runs in this process under `ABLATION_OUT`
  (default `<repo>/runs/ablations_quick`), skipping finished ones.
* `full`: reads `ABLATION_SUMMARY` (default `<repo>/docs/results/ablations_summary.json`,
  written by `experiments/run_ablations.py`); curves need the run directories,
  looked up under `ABLATION_RUNS` (default `<repo>/runs/ablations_full`).
"""
from __future__ import annotations

import os

from k3jax.ablations import record
from k3jax.ablations import summary as summary_lib
from k3jax.ablations.sweeps import SETTINGS, make_sweep


def repo_root() -> str:
  """The checkout holding this package (the parent of `k3jax/`)."""
  return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def default_summary_path() -> str:
  """Where the repository keeps the full sweep's summary.json."""
  return os.environ.get("ABLATION_SUMMARY",
                        os.path.join(repo_root(), "docs", "results", "ablations_summary.json"))


def load_or_run(sweep_name: str, setting: str) -> tuple[list[dict], str | None]:
  """(run records, directory holding the run directories or None) for one sweep.

  Raises ValueError for an unknown setting, or when the full setting's summary is missing.
  """
  if setting not in SETTINGS:
    raise ValueError(f"SETTING={setting!r}; allowed: {SETTINGS}")
  if setting == "quick":
    out_dir = os.environ.get("ABLATION_OUT", os.path.join(repo_root(), "runs", "ablations_quick"))
    records = record.run_sweep(make_sweep(sweep_name, "quick"), out_dir, log=None)
    return records, out_dir
  summary = summary_lib.read_summary(default_summary_path())
  records = summary_lib.records_of(summary, sweep_name)
  if not records:
    raise ValueError(f"{default_summary_path()} holds no {sweep_name} runs")
  out_dir = os.environ.get("ABLATION_RUNS", os.path.join(repo_root(), "runs", "ablations_full"))
  return records, (out_dir if os.path.isdir(out_dir) else None)
