"""Matplotlib helpers for the ablation notebooks: curves with seed bands, bars, per-layer profiles.

Every function draws on a given Axes and returns it; records are summary.json
run records (see `k3jax.ablations.evaluate.summarize_run`).
"""
from __future__ import annotations

import os
from typing import Callable, Iterable

import matplotlib.ticker
import numpy as np

from k3jax.ablations import runs as runs_lib
from k3jax.ablations.summary import get, group, mean_std, ordered


def _finish(ax, *, title: str, xlabel: str, ylabel: str, logy: bool, legend: bool):
  """Titles, optional log y axis and a small legend; returns `ax`."""
  ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
  if logy:
    ax.set_yscale("log")
  if legend:
    ax.legend(fontsize=7)
  return ax


def run_dir(record: dict, out_dir: str | None) -> str | None:
  """The record's run directory under `out_dir`, or None if it is not on this machine."""
  if out_dir is None:
    return None
  path = os.path.join(out_dir, record["workdir"])
  return path if os.path.isfile(os.path.join(path, "metrics.jsonl")) else None


def _mean_band(series_list: list[runs_lib.Series]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Mean and std over seeds at the steps every seed logged."""
  common = set(series_list[0].steps.tolist())
  for s in series_list[1:]:
    common &= set(s.steps.tolist())
  steps = np.array(sorted(common), np.int64)
  vals = np.stack([s.values[np.isin(s.steps, steps)] for s in series_list])
  return steps, np.nanmean(vals, 0), (np.nanstd(vals, 0, ddof=1) if len(series_list) > 1 else 0 * vals[0])


def curves(ax, records: Iterable[dict], out_dir: str | None, pick: Callable[[dict], runs_lib.Series | None],
           *, label: Callable[[dict], str] = lambda r: r["variant"], title: str = "", ylabel: str = "",
           logy: bool = False):
  """One line per label (mean over seeds, band = ±1 std) of a metric over steps.

  Args:
    ax: matplotlib Axes.
    records: run records.
    out_dir: sweep output directory holding the run directories (None: nothing to draw).
    pick: maps a run's {"train": metrics, "eval": metrics} dict to one Series (or None).
    label: legend label of a record; records with the same label are seeds of one line.
  """
  by_label: dict[str, list] = {}
  for r in ordered(records):
    path = run_dir(r, out_dir)
    if path is None:
      continue
    s = pick({"train": runs_lib.load_metrics(path, "train"), "eval": runs_lib.load_metrics(path, "eval")})
    if s is not None and s.steps.size:
      by_label.setdefault(label(r), []).append(s)
  if not by_label:
    ax.text(0.5, 0.5, "run directories not found", ha="center", va="center", transform=ax.transAxes)
  for name, series in by_label.items():
    steps, mean, std = _mean_band(series)
    line, = ax.plot(steps, mean, label=f"{name} (n={len(series)})")
    ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2)
  return _finish(ax, title=title, xlabel="step", ylabel=ylabel, logy=logy, legend=bool(by_label))


def metric(split: str, name: str) -> Callable[[dict], runs_lib.Series | None]:
  """A `pick` for `curves`: metric `name` of `split`."""
  return lambda m: m[split].get(name)


def layer_metric(stat: str, layer: int) -> Callable[[dict], runs_lib.Series | None]:
  """A `pick` for `curves`: router statistic `stat` of MoE layer `layer` (train split)."""
  return lambda m: runs_lib.per_layer(m["train"], stat).get(layer)


def bars(ax, records: Iterable[dict], path: str, *, keys: tuple[str, ...] = ("variant",),
         title: str = "", ylabel: str = "", scale: float = 1.0):
  """Bar per group (mean over seeds) with ±1 std error bars of the value at dotted `path`."""
  groups = group(records, keys)
  names = [" / ".join(str(k) for k in g) for g in groups]
  stats = [mean_std(get(r, path) for r in rs) for rs in groups.values()]
  means = [s[0] * scale for s in stats]
  stds = [s[1] * scale for s in stats]
  ax.bar(range(len(names)), means, yerr=stds, capsize=3, color="C0")
  ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
  ax.set(title=title, ylabel=ylabel)
  return ax


def profile(ax, records: Iterable[dict], path: str, *, label: Callable[[dict], str] = lambda r: r["variant"],
            title: str = "", xlabel: str = "layer", ylabel: str = "", x_offset: int = 0,
            logy: bool = False):
  """Line per label of a per-layer list at dotted `path` (mean over seeds, band = ±1 std)."""
  by_label: dict[str, list] = {}
  for r in ordered(records):
    values = get(r, path)
    if values:
      by_label.setdefault(label(r), []).append(np.array([np.nan if v is None else v for v in values], float))
  for name, arrays in by_label.items():
    arr = np.stack(arrays)
    x = np.arange(arr.shape[1]) + x_offset
    mean = np.nanmean(arr, 0)
    std = np.nanstd(arr, 0, ddof=1) if len(arrays) > 1 else np.zeros_like(mean)
    line, = ax.plot(x, mean, marker="o", ms=3, label=f"{name} (n={len(arrays)})")
    ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
  ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  return _finish(ax, title=title, xlabel=xlabel, ylabel=ylabel, logy=logy, legend=bool(by_label))


def versus_length(ax, records: Iterable[dict], field: str, *, title: str = "", ylabel: str = "",
                  logy: bool = False, label: Callable[[dict], str] = lambda r: r["variant"]):
  """Line per label (mean ± std over seeds) of `lengths.<m>.<field>` against the length multiplier m."""
  by_variant: dict[str, dict[int, list]] = {}
  for r in ordered(records):
    for m, rec in (r.get("lengths") or {}).items():
      by_variant.setdefault(label(r), {}).setdefault(int(m), []).append(rec.get(field))
  for name, per_m in by_variant.items():
    ms = sorted(per_m)
    stats = [mean_std(per_m[m]) for m in ms]
    ax.errorbar(ms, [s[0] for s in stats], yerr=[s[1] for s in stats], marker="o", capsize=3, label=name)
  ax.set_xscale("log", base=2)
  return _finish(ax, title=title, xlabel="eval length / train length", ylabel=ylabel, logy=logy,
                 legend=bool(by_variant))


def loss_by_position(ax, records: list[dict], *, title: str = "held-out loss by position"):
  """Loss (nats) per position bucket at each run's longest evaluation, mean ± std over seeds.

  records: run records with a "long" entry (`long_context.evaluate_run`); text runs only are drawn.
  x: the bucket's upper edge in training lengths (log2 axis).
  """
  for (variant, _), rs in group([r for r in records if r.get("long", {}).get("lengths")]).items():
    longest = [max(r["long"]["lengths"], key=lambda e: e["seq_len"]) for r in rs]
    edges = [b["hi_x"] for b in longest[0]["buckets"]]
    stats = [mean_std(e["buckets"][i]["loss"] for e in longest) for i in range(len(edges))]
    mean, std = np.array([s[0] for s in stats]), np.array([s[1] for s in stats])
    line, = ax.plot(edges, mean, marker="o", label=f"{variant} (n={len(rs)})")
    ax.fill_between(edges, mean - std, mean + std, color=line.get_color(), alpha=0.2)
  ax.axvline(1.0, color="gray", ls=":", label="training length")
  ax.set_xscale("log", base=2)
  ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
  return _finish(ax, title=title, xlabel="bucket end (training lengths)", ylabel="loss (nats)",
                 logy=False, legend=True)


def recall_by_gap(ax, records: list[dict], *, title: str = "MQAR recall, pairs far back"):
  """MQAR recall against the gap between pairs and queries (training lengths), mean ± std over seeds."""
  for (variant, _), rs in group([r for r in records if r.get("long", {}).get("mqar")]).items():
    gaps = [e["gap_x"] for e in rs[0]["long"]["mqar"]]
    stats = [mean_std(r["long"]["mqar"][i]["accuracy"] for r in rs) for i in range(len(gaps))]
    x = [max(g, 0.5) for g in gaps]  # gap 0 drawn at 0.5x on the log axis
    ax.errorbar(x, [s[0] for s in stats], yerr=[s[1] for s in stats], marker="o", capsize=3,
                label=f"{variant} (n={len(rs)})")
  ax.set_xscale("log", base=2)
  ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: "0" if v < 1 else f"{v:g}x"))
  return _finish(ax, title=title, xlabel="gap (training lengths)", ylabel="recall", logy=False, legend=True)
