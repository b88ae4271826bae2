"""A run's record: trained (or resumed, or loaded), then evaluated once and cached.

The top of the ablations package: it calls the trainer (`runs.train_run`),
the evaluations (`evaluate`, `long_context`) and nothing calls it back.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from k3jax.ablations import document_eval
from k3jax.ablations import evaluate as evaluate_lib
from k3jax.ablations import long_context
from k3jax.ablations import runs as runs_lib
from k3jax.ablations.sweeps import RunSpec, Sweep, make_sweep
from pallas_kernels.tools.bench_json import finite_or_none


def run_sweep(sweep: Sweep, out_dir: str, *, log: Callable[[str], None] | None = print) -> list[dict]:
  """Trains (or resumes, or loads) every run of `sweep` in this process; returns their records."""
  records = []
  for spec in sweep.runs():
    if log:
      log(f"[{sweep.name}] {spec.key}")
    records.append(run_or_load(spec, out_dir))
  return records


def run_or_load(spec: RunSpec, out_dir: str, *, evaluate: bool = True, force_eval: bool = False) -> dict:
  """Trains (or resumes, or skips) `spec` and returns its summary record.

  The record (see `summarize_run`) is cached as
  `<workdir>/ablation_summary.json`; it is recomputed when missing, when the run
  trained further since, or with `force_eval`.
  """
  workdir = runs_lib.train_run(spec, out_dir)
  cached = runs_lib.load_run_summary(workdir)
  step = runs_lib.finished_step(workdir)
  if cached is not None and cached.get("step") == step and not force_eval:
    return cached
  if not evaluate:
    return {"key": spec.key, "step": step}
  record = summarize_run(spec, workdir, out_dir)
  with open(os.path.join(workdir, runs_lib.SUMMARY_FILE), "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1, sort_keys=True)
  return record


def summarize_run(spec: RunSpec, workdir: str, out_dir: str | None = None) -> dict[str, Any]:
  """The record of one finished run: identity, final metrics and the sweep's evaluations.

  Keys: key, sweep, setting, variant, task, seed, tags, step, num_params,
  first_eval, final_eval, final_train_loss, and per sweep:
  decay `lengths` {multiplier: eval_at_length record}; router `router`
  (tail means per layer of max_vio, max_vio_routed, drop_fraction) and
  `leak` (routing_leak); residual `depth` (depth_profile); long `long`
  (`long_context.evaluate_run`); documents `positions` (`document_eval.loss_by_position`).
  """
  sweep = sweep_of(spec)
  evals = runs_lib.load_metrics(workdir, "eval")
  train = runs_lib.load_metrics(workdir, "train")
  model, _, config, step = evaluate_lib.restore(workdir)

  def at(metrics, i):
    return {k: float(s.values[i]) for k, s in metrics.items() if np.isfinite(s.values[i])}

  record: dict[str, Any] = {
      "key": spec.key, "sweep": spec.sweep, "setting": spec.setting, "variant": spec.variant.name,
      "task": spec.task.name, "seed": spec.seed, "tags": dict(spec.variant.tags), "step": step,
      "workdir": os.path.relpath(workdir, out_dir) if out_dir else workdir,
      "num_params": int(sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
      "first_eval": at(evals, 0), "final_eval": at(evals, -1),
      "final_train_loss": runs_lib.tail_mean(train["ce_loss"], 0.2) if "ce_loss" in train else None,
  }
  if spec.sweep == "decay":
    record["lengths"] = {str(m): evaluate_lib.eval_at_length(model, config, m)
                         for m in sweep.length_multipliers}
  if spec.sweep == "router":
    record["router"] = evaluate_lib.router_stats(train)
    batch = evaluate_lib.heldout_batch(config)
    position = int(sweep.probe_position * (config.seq_len - 1))
    record["leak"] = evaluate_lib.routing_leak(model, batch, position=position, seed=spec.seed)
  if spec.sweep == "residual":
    record["depth"] = evaluate_lib.depth_profile(model, evaluate_lib.heldout_batch(config))
  if spec.sweep == "documents":
    record["positions"] = document_eval.loss_by_position(model, config)
  if spec.sweep == "long":
    record["long"] = long_context.evaluate_run(workdir, **long_eval_args(sweep))
    record["long"]["workdir"] = record["workdir"]
  return finite_or_none(record)


def long_eval_args(sweep) -> dict[str, Any]:
  """`long_context.evaluate_run` keyword arguments of a "long" sweep."""
  full = sweep.setting == "full"
  return {"multipliers": sweep.length_multipliers, "gap_multipliers": sweep.gap_multipliers,
          "decode_prefill_x": sweep.decode_prefill_x, "decode_new": 256 if full else 16,
          "num_sequences": 4, "mqar_sequences": 32 if full else 16}


def sweep_of(spec: RunSpec) -> Sweep:
  """The one-seed sweep a run belongs to (its evaluation settings)."""
  return make_sweep(spec.sweep, spec.setting, (spec.seed,))
