"""Ablation sweeps of the three techniques: definitions, run-or-load, evaluations, summaries, plots.

    from k3jax import ablations
    sweep = ablations.make_sweep("decay", "quick")
    records = ablations.run_sweep(sweep, "runs/ablations_quick")
"""
from k3jax.ablations.record import run_or_load, run_sweep
from k3jax.ablations.runs import Series, load_metrics, per_layer, tail_mean, workdir_of
from k3jax.ablations.summary import (make_summary, read_summary, records_of, render_tables,
                                     update_results_page, write_summary)
from k3jax.ablations.sweeps import (SETTINGS, SWEEPS, RunSpec, Sweep, Task, Variant, make_sweep)

__all__ = [
    "RunSpec", "SETTINGS", "SWEEPS", "Series", "Sweep", "Task", "Variant", "load_metrics",
    "make_summary", "make_sweep", "per_layer", "read_summary", "records_of", "render_tables",
    "run_or_load", "run_sweep", "tail_mean", "update_results_page", "workdir_of", "write_summary",
]
