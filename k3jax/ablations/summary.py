"""Sweep-level collection, summary.json, mean ± std aggregation and the results page tables."""
from __future__ import annotations

import datetime
import json
import math
import os
import re
from typing import Any, Callable, Iterable

import numpy as np

from k3jax.ablations.kernel_times import KERNEL_TIMES, KERNEL_TIMES_SOURCE
from k3jax.ablations.sweeps import make_sweep

SUMMARY_VERSION = 1


def make_summary(records: Iterable[dict], *, setting: str) -> dict:
  """The summary.json object: {"version", "setting", "created", "runs": [records]}."""
  return {"version": SUMMARY_VERSION, "setting": setting,
          "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
          "runs": sorted(records, key=lambda r: r["key"])}


def write_summary(summary: dict, path: str) -> None:
  """Writes summary.json (NaN-free JSON)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1, sort_keys=True, allow_nan=False)


def combine_summaries(summaries: Iterable[dict]) -> dict:
  """One summary from several calls' summaries of the same setting (e.g. a sweep finished in parts).

  A run present in a later summary replaces the earlier record; `missing`
  keeps only keys no summary holds; wall times add up; `parts` records each
  call's creation time, wall time and concurrency.
  """
  summaries = list(summaries)
  if not summaries:
    raise ValueError("combine_summaries needs at least one summary")
  settings = {s["setting"] for s in summaries}
  if len(settings) != 1:
    raise ValueError(f"cannot combine summaries of different settings: {sorted(settings)}")
  runs = {}
  for summary in summaries:
    runs.update({r["key"]: r for r in summary["runs"]})
  missing = sorted({k for s in summaries for k in s.get("missing", ())} - set(runs))
  out = make_summary(runs.values(), setting=settings.pop())
  walls = [s["wall_s"] for s in summaries if s.get("wall_s") is not None]
  out.update(missing=missing, wall_s=sum(walls) if walls else None,
             jobs=max((s.get("jobs") or 0) for s in summaries) or None,
             parts=[{k: s.get(k) for k in ("created", "wall_s", "jobs", "num_gpus")} for s in summaries])
  return out


def read_summary(path: str) -> dict:
  """Reads a summary.json written by `write_summary`; raises ValueError if it is not one."""
  if not os.path.isfile(path):
    raise ValueError(f"summary file {path!r} does not exist; run experiments/run_ablations.py first")
  with open(path, encoding="utf-8") as f:
    summary = json.load(f)
  if not isinstance(summary, dict) or summary.get("version") != SUMMARY_VERSION or "runs" not in summary:
    raise ValueError(f"{path!r} is not an ablation summary (version {SUMMARY_VERSION})")
  return summary


def records_of(summary: dict, sweep: str) -> list[dict]:
  """The run records of one sweep."""
  return [r for r in summary["runs"] if r["sweep"] == sweep]


# -- aggregation -------------------------------------------------------------------------


def get(record: dict, path: str) -> Any:
  """A value by dotted path (`"lengths.16.loss"`), None if any part is missing."""
  node: Any = record
  for part in path.split("."):
    if not isinstance(node, dict) or part not in node:
      return None
    node = node[part]
  return node


def ordered(records: Iterable[dict]) -> list[dict]:
  """Records in the order of their sweep's definition (variant, then task, then seed)."""
  records = list(records)
  position = {}
  for r in records:
    if (r["sweep"], r["setting"]) not in position:
      sweep = make_sweep(r["sweep"], r["setting"], (0,))
      position[(r["sweep"], r["setting"])] = ({v.name: i for i, v in enumerate(sweep.variants)},
                                              {t.name: i for i, t in enumerate(sweep.tasks)})
  def rank(r):
    variants, tasks = position[(r["sweep"], r["setting"])]
    return (r["sweep"], variants.get(r["variant"], len(variants)), r["variant"],
            tasks.get(r["task"], len(tasks)), r["seed"])
  return sorted(records, key=rank)


def group(records: Iterable[dict], keys: tuple[str, ...] = ("variant", "task")) -> dict[tuple, list[dict]]:
  """Records grouped by the given top-level keys, in sweep-definition order."""
  out: dict[tuple, list[dict]] = {}
  for r in ordered(records):
    out.setdefault(tuple(r[k] for k in keys), []).append(r)
  return out


def mean_std(values: Iterable[Any]) -> tuple[float, float, int]:
  """(mean, sample std (0 for one value), count) over the finite numbers in `values`."""
  v = np.array([float(x) for x in values if x is not None and math.isfinite(float(x))], np.float64)
  if v.size == 0:
    return float("nan"), float("nan"), 0
  return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0, int(v.size)


def fmt(values: Iterable[Any], digits: int = 3, scale: float = 1.0) -> str:
  """`mean ± std` (std over seeds) or `mean` for one seed; `n/a` without data."""
  m, s, n = mean_std(values)
  if n == 0:
    return "n/a"
  m, s = m * scale, s * scale
  return f"{m:.{digits}f} ± {s:.{digits}f}" if n > 1 else f"{m:.{digits}f}"


# -- results page tables -------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


def decay_table(records: list[dict]) -> str:
  """Per (variant, task): held-out loss and accuracy at 1x / 4x / 16x the training length."""
  rows = []
  for (variant, task), rs in group(records).items():
    mults = sorted({int(m) for r in rs for m in (r.get("lengths") or {})})
    row = [variant, task, str(len(rs))]
    metric = "accuracy" if task == "mqar" else "bpb"
    for m in (1, 4, 16):
      row.append(fmt(get(r, f"lengths.{m}.{metric}") for r in rs) if m in mults else "n/a")
    row.append(fmt(get(r, "lengths.16.loss") for r in rs))
    row.append("yes" if all(get(r, f"lengths.{m}.finite") == 1.0 for r in rs for m in mults) else "**no**")
    row.append(fmt((get(r, f"lengths.{max(mults)}.max_abs_logit") for r in rs), 1) if mults else "n/a")
    rows.append(row)
  return table(["variant", "task", "seeds", "accuracy (mqar) or bits/byte @1x", "@4x", "@16x", "loss @16x (nats)",
                 "all logits finite", "max abs logit @16x"], rows)


def decay_arm_table(records: list[dict]) -> str:
  """Per gate, both tasks on one row: the numbers at 1x and 16x (the figure draws 4x too), and
  whether every logit of every length and seed was finite."""
  rows = []
  for (variant,), rs in group(records, ("variant",)).items():
    mqar = [r for r in rs if r["task"] == "mqar"]
    text = [r for r in rs if r["task"] != "mqar"]
    mults = sorted({int(m) for r in rs for m in (r.get("lengths") or {})})
    rows.append([variant, str(len(text) or len(mqar)),
                 fmt(get(r, "lengths.1.accuracy") for r in mqar),
                 fmt(get(r, "lengths.16.accuracy") for r in mqar),
                 fmt(get(r, "lengths.1.bpb") for r in text), fmt(get(r, "lengths.16.bpb") for r in text),
                 "yes" if all(get(r, f"lengths.{m}.finite") == 1.0 for r in rs for m in mults) else "**no**",
                 f"{max(get(r, f'lengths.{max(mults)}.max_abs_logit') for r in rs):.1f}" if mults else "n/a"])
  return table(["gate", "seeds", "MQAR accuracy @1x", "@16x", "bits/byte @1x", "@16x",
                "all logits finite", "max abs logit"], rows)


def kernel_table() -> str:
  """Kernel time per decay variant from `kernel_times.KERNEL_TIMES`, with the source."""
  rows = []
  for name, entry in KERNEL_TIMES.items():
    fwd, both = entry["fwd_ms"], entry["fwd_bwd_ms"]
    rows.append([name, entry["path"], "n/a" if fwd is None else f"{fwd:.2f}",
                 "n/a" if both is None else f"{both:.2f}", entry["note"]])
  return table(["variant", "kernel path", "fwd ms", "fwd+bwd ms", "note"], rows) + "\n\n" + KERNEL_TIMES_SOURCE


def router_table(records: list[dict]) -> str:
  """Per router: held-out loss, MaxVio and drops (tail means), causality leak."""
  rows = []
  for (variant, _), rs in group(records).items():
    rows.append([variant, str(len(rs)),
                 fmt(get(r, "final_eval.loss") for r in rs),
                 fmt(get(r, "final_eval.bpb") for r in rs),
                 fmt(get(r, "router.max_vio_mean") for r in rs),
                 fmt(get(r, "router.max_vio_routed_mean") for r in rs),
                 fmt((get(r, "router.drop_fraction_mean") for r in rs), 4),
                 fmt((get(r, "leak.changed_fraction") for r in rs), 4),
                 fmt((get(r, "leak.max_logit_change") for r in rs), 4)])
  return table(["router", "seeds", "held-out loss (nats)", "bits/byte", "MaxVio (kept)",
                 "MaxVio (preferred)", "drop fraction", "leak: earlier outputs changed",
                 "leak: max logit change"], rows)


def router_layer_table(records: list[dict]) -> str:
  """MaxVio per MoE layer (tail mean over the last quarter of training)."""
  layers = sorted({int(k) for r in records for k in (get(r, "router.max_vio") or {})})
  rows = []
  for (variant, _), rs in group(records).items():
    rows.append([variant] + [fmt(get(r, f"router.max_vio.{layer}") for r in rs) for layer in layers])
  return table(["router"] + [f"MaxVio layer {layer}" for layer in layers], rows)


def residual_table(records: list[dict]) -> str:
  """Per (strategy, depth): held-out loss, stream norm and similarity at the last layer, memory."""
  rows = []
  for (variant, _), rs in group(records).items():
    tags = rs[0]["tags"]
    last = lambda r, key: (get(r, f"depth.{key}") or [None])[-1]
    rows.append([tags.get("residual", variant), str(tags.get("depth", "")), str(len(rs)),
                 fmt(get(r, "final_eval.loss") for r in rs),
                 fmt(get(r, "final_eval.bpb") for r in rs),
                 fmt((last(r, "stream_rms") for r in rs), 2),
                 fmt((np.mean(get(r, "depth.cos_next") or [np.nan]) for r in rs), 3),
                 fmt((last(r, "cos_next") for r in rs), 3),
                 fmt((get(r, "depth.param_bytes") for r in rs), 2, 1e-6),
                 fmt((get(r, "depth.residual_bytes_per_token") for r in rs), 0),
                 fmt((get(r, "depth.forward_temp_bytes") for r in rs), 2, 1e-6)])
  return table(["residual", "layers", "seeds", "held-out loss (nats)", "bits/byte",
                 "final stream RMS", "mean cos(l, l+1)", "last-layer cos", "param MB",
                 "residual bytes/token", "forward temp MB"], rows)


def documents_table(records: list[dict]) -> str:
  """Per way of feeding the model: held-out nats/token over each document's opening and the rest."""
  rows = []
  for (variant, _), rs in group(records).items():
    rows.append([variant, str(len(rs)), fmt(get(r, "positions.first") for r in rs),
                 fmt(get(r, "positions.rest") for r in rs), fmt(get(r, "positions.all") for r in rs),
                 fmt(get(r, "final_eval.loss") for r in rs)])
  return table(["data", "seeds", "first 64 tokens (nats)", "the rest (nats)", "all (nats)",
                "trainer's held-out loss (nats)"], rows)


TABLES: dict[str, Callable[[list[dict]], str]] = {
    "decay": decay_table, "decay_arms": decay_arm_table, "router": router_table,
    "router_layers": router_layer_table, "residual": residual_table, "documents": documents_table,
}
# Every column of a summary's runs (`tables_text` prints them); the results page shows the findings' tables.
FULL_TABLES = ("decay", "router", "router_layers", "residual", "documents")
_MARK = re.compile(r"(<!-- table:(?P<name>[a-z_]+) -->\n)(.*?)(<!-- /table -->)", re.S)


def render_tables(markdown: str, summary: dict) -> str:
  """Replaces every `<!-- table:NAME -->...<!-- /table -->` block with the table from `summary`.

  NAME is a key of TABLES (its records are the sweep's), "kernels", or "meta"
  (setting, run count, date). Unknown names raise ValueError.
  """
  def table_for(name: str) -> str:
    if name == "kernels":
      return kernel_table()
    if name == "meta":
      sweeps = sorted({r["sweep"] for r in summary["runs"]})
      seeds = sorted({r["seed"] for r in summary["runs"]})
      text = (f"Setting `{summary['setting']}`, {len(summary['runs'])} runs ({', '.join(sweeps)}), "
              f"seeds {seeds}, summary created {summary['created']}")
      if summary.get("wall_s") is not None:
        text += f"; sweep wall time {summary['wall_s']:.0f} s with {summary.get('jobs')} concurrent runs"
        if len(summary.get("parts", ())) > 1:
          text += f" (in {len(summary['parts'])} calls)"
      text += "."
      if summary.get("missing"):
        text += f" **Missing runs** (not in the tables): {', '.join(summary['missing'])}."
      return text
    if name not in TABLES:
      raise ValueError(f"unknown table {name!r} in the results page; allowed: "
                       f"{sorted(TABLES) + ['kernels', 'meta']}")
    sweep = _sweep_of(name)
    records = records_of(summary, sweep)
    return TABLES[name](records) if records else f"_No {sweep} runs in the summary._"

  return _MARK.sub(lambda m: m.group(1) + table_for(m.group("name")) + "\n" + m.group(4), markdown)


def _sweep_of(table_name: str) -> str:
  return table_name.split("_")[0]


def tables_text(summary: dict) -> str:
  """Every full table of the sweeps in `summary`, as markdown (what the results page leaves out)."""
  sweeps = {r["sweep"] for r in summary["runs"]}
  page = "\n\n".join(f"### {name}\n<!-- table:{name} -->\n<!-- /table -->"
                      for name in ("meta", *FULL_TABLES) if name == "meta" or _sweep_of(name) in sweeps)
  return re.sub(r"<!-- /?table(:[a-z_]+)? -->\n?", "", render_tables(page, summary))


def update_results_page(page: str, summary_path: str) -> str:
  """Rewrites the tables of the markdown file `page` from `summary_path`; returns the new text."""
  summary = read_summary(summary_path)
  with open(page, encoding="utf-8") as f:
    text = f.read()
  new = render_tables(text, summary)
  with open(page, "w", encoding="utf-8") as f:
    f.write(new)
  return new
