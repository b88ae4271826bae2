"""Renders the figures of the results and benchmark pages from the committed data.

  python experiments/render_docs.py                    # docs/figures/*.png and the pages' data tables
  python experiments/render_docs.py --out=/tmp/figs    # the figures elsewhere (the CI test compares the two)
  python experiments/render_docs.py --notebooks=docs/notebooks   # also the executed ablation notebooks + HTML
  python experiments/render_docs.py --html=docs/notebooks         # the HTML copies of the executed ones only

Inputs, all in the repository: the ablation summaries under docs/results/
(their per-step curves from docs/results/ablation_runs.tar.gz) and the
benchmark tables in docs/data/*.json. Nothing is measured here. A page's
`<!-- data:NAME -->` block is the table of docs/data/NAME.json (PAGE_TABLES),
rewritten when the figures go to docs/figures.
The output is byte-reproducible for one matplotlib version (fixed style; the
PNG's only metadata names that version).
"""
import argparse
import base64
import contextlib
import glob
import io
import json
import os
import re
import sys
import tarfile
import tempfile
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.figure  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from k3jax.ablations import plots, runs as runs_lib  # noqa: E402
from k3jax.ablations.summary import group, mean_std, ordered, read_summary, records_of  # noqa: E402

RESULTS = os.path.join(ROOT, "docs", "results")
DATA = os.path.join(ROOT, "docs", "data")
DPI = 100

# {PNG file name: function drawing the figure from the committed data}, filled by @figure.
FIGURES: dict[str, Callable[[], matplotlib.figure.Figure]] = {}


def figure(name: str):
  """Registers a figure function under its PNG file name."""
  def register(fn):
    FIGURES[name] = fn
    return fn
  return register


def _style() -> None:
  """One fixed style, so that a user's matplotlibrc does not change the bytes."""
  matplotlib.rcdefaults()
  matplotlib.rcParams.update({"font.size": 8, "axes.titlesize": 9, "legend.fontsize": 7,
                              "axes.grid": True, "grid.alpha": 0.3, "figure.dpi": DPI})


def _save(fig, path: str) -> None:
  # The PNG's only text chunk is "Software", naming the matplotlib version (no date): equal data and
  # equal version, equal bytes; the CI test compares bytes when the versions match.
  fig.savefig(path, dpi=DPI)
  plt.close(fig)


def _read_json(name: str) -> dict:
  with open(os.path.join(DATA, name), encoding="utf-8") as f:
    return json.load(f)


def _summary(name: str) -> list[dict]:
  return read_summary(os.path.join(RESULTS, name))["runs"]


@contextlib.contextmanager
def _ablation_runs():
  """The committed archive of the ablation run directories, extracted into a temporary directory."""
  with tempfile.TemporaryDirectory() as tmp:
    with tarfile.open(os.path.join(RESULTS, "ablation_runs.tar.gz")) as tar:
      members = [m for m in tar.getmembers() if m.name.endswith("metrics.jsonl")]
      tar.extractall(tmp, members=members, filter="data")
    yield tmp


def _column(rows: list[dict], key: str) -> list[float]:
  """The rows' values of `key`, NaN where a row has none (its bar is left out)."""
  return [np.nan if r.get(key) is None else r[key] for r in rows]


def _grouped_bars(ax, values: dict[str, list], errors: dict[str, list] | None = None) -> dict:
  """Side by side bars: a group per x position, a bar per label in it; {label: its bars}."""
  width = 0.8 / len(values)
  out = {}
  for i, (label, heights) in enumerate(values.items()):
    x = np.arange(len(heights)) + (i - (len(values) - 1) / 2) * width
    out[label] = ax.bar(x, heights, width, label=label, yerr=(errors or {}).get(label), capsize=3)
  return out


# -- ablations ---------------------------------------------------------------------------


def _by_length_with_seeds(ax, records: list[dict], field: str, offsets: dict[str, float]):
  """Mean ± std over seeds of `lengths.<m>.<field>` against m, each seed a small dot."""
  for (variant, _), rs in group(records).items():
    ms = sorted(int(m) for m in rs[0]["lengths"])
    x = np.array(ms, float) * offsets[variant]
    per_seed = np.array([[r["lengths"][str(m)][field] for m in ms] for r in rs])
    stats = [mean_std(col) for col in per_seed.T]
    bar = ax.errorbar(x, [s[0] for s in stats], yerr=[s[1] for s in stats], marker="o", ms=4, capsize=3,
                      label=f"{variant} (n={len(rs)})")
    for row in per_seed:
      ax.plot(x, row, ".", ms=3, alpha=0.5, color=bar[0].get_color())
  ax.set_xscale("log", base=2)
  ax.set_xticks([1, 4, 16], ["1x", "4x", "16x"])
  ax.set_xlabel("evaluation length (training lengths; training length 128 tokens)")


@figure("decay.png")
def decay_figure():
  """Held-out bits/byte and MQAR accuracy at 1x, 4x and 16x the training length, by gate."""
  records = records_of(read_summary(os.path.join(RESULTS, "ablations_summary.json")), "decay")
  variants = list(dict.fromkeys(r["variant"] for r in records))
  offsets = {v: 2 ** (0.06 * (i - (len(variants) - 1) / 2)) for i, v in enumerate(variants)}
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
  _by_length_with_seeds(axes[0], [r for r in records if r["task"] == "bytes"], "bpb", offsets)
  axes[0].set(title="byte-level Python: held-out bits/byte (lower is better)", ylabel="bits/byte")
  _by_length_with_seeds(axes[1], [r for r in records if r["task"] == "mqar"], "accuracy", offsets)
  axes[1].set(title="MQAR: recall accuracy (dots: seeds)", ylabel="accuracy", ylim=(-0.05, 1.05))
  axes[0].legend(title="gate (g_min, tile)")
  fig.tight_layout()
  return fig


def _layer_mean_max_vio(metrics: dict) -> runs_lib.Series:
  """MaxVio of kept assignments averaged over the MoE layers, per logged step."""
  layers = runs_lib.per_layer(metrics["train"], "max_vio")
  first = next(iter(layers.values()))
  return runs_lib.Series(first.steps, np.mean([s.values for s in layers.values()], 0))


def _max_vio_by_layer(ax, records: list[dict]):
  """Each router's MaxVio per MoE layer (last quarter of training), mean ± std over seeds."""
  for (router,), rs in group(records, ("variant",)).items():
    layers = sorted(int(k) for k in rs[0]["router"]["max_vio"])
    stats = [mean_std(r["router"]["max_vio"][str(layer)] for r in rs) for layer in layers]
    ax.errorbar(layers, [s[0] for s in stats], yerr=[s[1] for s in stats], marker="o", capsize=3,
                label=f"{router} (n={len(rs)})")
  ax.set(xticks=[1, 2, 3], xlabel="MoE layer", ylabel="MaxVio", yscale="log",
         title="MaxVio by layer, last quarter of training")


@figure("routers.png")
def router_figure():
  """MaxVio over training by router, and each router's final MaxVio per MoE layer."""
  records = records_of(read_summary(os.path.join(RESULTS, "ablations_summary.json")), "router")
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [3, 2]})
  with _ablation_runs() as out_dir:
    plots.curves(axes[0], records, out_dir, _layer_mean_max_vio, title="MaxVio during training (mean of layers 1-3)",
                 ylabel="MaxVio (max load / mean load - 1)", logy=True)
  _max_vio_by_layer(axes[1], records)
  fig.tight_layout()
  return fig


def _residual_label(record: dict) -> str:
  return f"{record['tags']['residual']}, {record['tags']['depth']} layers"


def _smoothed_train_loss(metrics: dict) -> runs_lib.Series | None:
  """Training cross-entropy, moving mean over 5 logged steps (the curves of single batches are noisy)."""
  s = metrics["train"].get("ce_loss") or metrics["train"].get("loss")
  if s is None or s.values.size < 5:
    return s
  kernel = np.ones(5) / 5
  return runs_lib.Series(s.steps[4:], np.convolve(s.values, kernel, mode="valid"))


def _restyle_by_depth(ax, strategies: list[str]):
  """Colour by strategy, dashed for 4 layers: six curves read as three pairs."""
  for line, band in zip(ax.get_lines(), ax.collections):
    strategy = line.get_label().split(",")[0]
    color = f"C{strategies.index(strategy)}"
    line.set(color=color, linestyle="--" if ", 4 layers" in line.get_label() else "-")
    band.set(color=color, alpha=0.1, linewidth=0)
  ax.legend()


def _final_loss_by_depth(ax, records: list[dict], strategies: list[str]):
  """Held-out loss after training against depth, one line per strategy, mean ± std over seeds."""
  for i, strategy in enumerate(strategies):
    rs = [r for r in records if r["tags"]["residual"] == strategy]
    depths = sorted({r["tags"]["depth"] for r in rs})
    stats = [mean_std(r["final_eval"]["loss"] for r in rs if r["tags"]["depth"] == d) for d in depths]
    ax.errorbar(np.array(depths) + 0.15 * (i - 1), [s[0] for s in stats], yerr=[s[1] for s in stats],
                marker="o", capsize=3, color=f"C{i}", label=f"{strategy} (n={stats[0][2]})")
  ax.set(title="held-out loss after 250 steps", xlabel="layers", ylabel="loss (nats/byte)", xticks=[4, 8])
  ax.legend()


@figure("residuals.png")
def residual_figure():
  """Training loss against step by residual strategy and depth, and the final held-out loss."""
  records = records_of(read_summary(os.path.join(RESULTS, "ablations_summary.json")), "residual")
  strategies = list(dict.fromkeys(r["tags"]["residual"] for r in ordered(records)))
  fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.2))
  with _ablation_runs() as out_dir:
    plots.curves(axes[0], records, out_dir, _smoothed_train_loss, label=_residual_label,
                 title="training loss (moving mean of 5 logs; dashed: 4 layers)", ylabel="loss (nats/byte)")
  axes[0].set(xlim=(100, 250), ylim=(1.15, 1.55))
  _restyle_by_depth(axes[0], strategies)
  _final_loss_by_depth(axes[1], records, strategies)
  fig.tight_layout()
  return fig


@figure("long_context.png")
def long_context_figure():
  """Loss by position bucket and MQAR recall against gap, tiny CPU setting."""
  records = _summary("long_context_quick.json")
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
  plots.loss_by_position(axes[0], records, title="held-out loss by position, 4096-token windows")
  plots.recall_by_gap(axes[1], records, title="MQAR recall, pairs far back (chance 1/128)")
  axes[1].set_ylabel("recall accuracy")
  fig.tight_layout()
  return fig


@figure("documents.png")
def documents_figure():
  """Held-out loss on each document's first 64 tokens and on the rest, by data arm."""
  records = _summary("documents_summary.json")
  parts = [("first", "first 64 tokens"), ("rest", "the rest"), ("all", "all positions")]
  stats = {f"{arm} (n={len(rs)})": [mean_std(r["positions"][p] for r in rs) for p, _ in parts]
           for (arm,), rs in group(records, ("variant",)).items()}
  fig, ax = plt.subplots(figsize=(6, 3.2))
  _grouped_bars(ax, {k: [s[0] for s in v] for k, v in stats.items()},
                {k: [s[1] for s in v] for k, v in stats.items()})
  ax.set_xticks(range(len(parts)), [label for _, label in parts])
  ax.set(title="held-out loss by position in the document", ylabel="loss (nats/byte)", ylim=(2.0, 2.7))
  ax.legend(title="training data")
  fig.tight_layout()
  return fig


# -- benchmarks --------------------------------------------------------------------------


def _times_vs_tokens(ax, rows: list[dict], suffix: str, series: list[tuple[str, str]]):
  """Bars per shape of the `<key>_<suffix>` times, plus the roofline floor as a marker."""
  x = np.arange(len(rows))
  _grouped_bars(ax, {label: _column(rows, f"{key}_{suffix}") for key, label in series})
  ax.hlines([r[f"floor_{suffix}"] for r in rows], x - 0.4, x + 0.4, colors="k", lw=2, label="roofline floor")
  ax.set_xticks(x, [f"B{r['B']} T{r['T']}" for r in rows])
  ax.set_yscale("log")


@figure("kda_kernel.png")
def kda_kernel_figure():
  """Forward and forward+backward time of our KDA kernel beside fla, cuDNN attention and the floor."""
  data = _read_json("kda_kernel.json")
  series = [("ours", "ours (pallas, dense)"), ("fla_safe", "fla safe_gate"), ("fla_unsafe", "fla unbounded"),
            ("cudnn", "cuDNN causal attention")]
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
  _times_vs_tokens(axes[0], data["rows"], "fwd_ms", series)
  _times_vs_tokens(axes[1], data["rows"], "fwdbwd_ms", series)
  axes[0].set(title="forward", ylabel="time (ms, log scale)")
  axes[1].set(title="forward + backward")
  axes[0].legend(loc="upper left")
  for ax in axes:
    ax.set_xlabel(f"shape (H{data['rows'][0]['H']}, K = V = {data['rows'][0]['D']}, bf16)")
  fig.tight_layout()
  return fig


@figure("kda_pairwise.png")
def kda_pairwise_figure():
  """The pairwise diagonal (any gate) against the dense one (bounded gate), with fla's unbounded forward."""
  rows = _read_json("kda_pairwise.json")["rows"]
  fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
  for ax, suffix, title in ((axes[0], "fwd_ms", "forward"), (axes[1], "fwdbwd_ms", "forward + backward")):
    series = [("dense", "dense diagonal"), ("pairwise", "pairwise diagonal")]
    if suffix == "fwd_ms":
      series.append(("fla_unsafe", "fla unbounded"))
    bars = _grouped_bars(ax, {label: _column(rows, f"{key}_{suffix}") for key, label in series})
    ratios = [r[f"pairwise_{suffix}"] / r[f"dense_{suffix}"] for r in rows]
    ax.bar_label(bars["pairwise diagonal"], [f"{q:.2f}x" for q in ratios], fontsize=7)
    ax.set_xticks(range(len(rows)), [f"B{r['B']} T{r['T']}" for r in rows])
    ax.set(title=title, ylabel="time (ms)", xlabel="shape (H16, K = V = 128, bf16)")
    ax.legend(loc="lower right")
  fig.tight_layout()
  return fig


@figure("moe_layer.png")
def moe_layer_figure():
  """Where an MoE layer's forward+backward goes against the dense SwiGLU, and the layer by shape."""
  data = _read_json("moe_layer.json")
  fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.4), gridspec_kw={"width_ratios": [2, 3]})
  profile = data["profile"]
  bottom = np.zeros(len(profile["rows"]))
  for part in profile["parts"]:
    values = np.array([r[part] for r in profile["rows"]])
    axes[0].bar(range(len(values)), values, 0.6, bottom=bottom, label=part)
    bottom += values
  dense_total = profile["rows"][0]["total"]
  for i, r in enumerate(profile["rows"]):
    axes[0].annotate(f"{r['total']:.3f} ms, {r['total'] / dense_total:.2f}x", (i, r["total"]), ha="center",
                     va="bottom", fontsize=7)
  axes[0].set_xticks(range(len(bottom)), [r["path"].replace(" (", "\n(") for r in profile["rows"]])
  axes[0].set(title="gpu_1b: device time by kernel, fwd+bwd", ylabel="time (ms)", ylim=(0, 6.5))
  axes[0].legend(loc="upper left")
  _layer_by_shape(axes[1], data["layer"]["rows"])
  fig.tight_layout()
  return fig


def _layer_by_shape(ax, rows: list[dict]):
  """Forward+backward ms per shape and path, each bar labelled with its ratio to the dense SwiGLU."""
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  labels = {"dense": "dense SwiGLU (active width)", "buffered": "MoE buffered (capacity 1.25)",
            "dropless": "MoE dropless (our grouped matmuls)"}
  times = {path: [next(r["fwdbwd_ms"] for r in rows if r["shape"] == s and r["path"].startswith(path))
                  for s in shapes] for path in labels}
  bars = _grouped_bars(ax, {labels[path]: t for path, t in times.items()})
  for path, t in times.items():
    ax.bar_label(bars[labels[path]], [f"{a / d:.2f}x" for a, d in zip(t, times["dense"])], fontsize=6)
  ax.set_xticks(range(len(shapes)), shapes)
  ax.set(title="MoE layer fwd+bwd by shape (label: ratio to dense)", ylabel="time (ms)", xlabel="shape")
  ax.legend(loc="upper left")


@figure("kda_head_widths.png")
def head_widths_figure():
  """K = V = 96 against 128 in the same call, unpadded now and padded to 128 before."""
  data = _read_json("kda_head_widths.json")
  narrow, base = (next(r for r in data["rows"] if r["K"] == k) for k in (96, 128))
  parts = [("fwd_ms", "forward"), ("fwdbwd_ms", "forward + backward")]
  ratios = {"96 without padding (now)": [narrow[p] / base[p] for p, _ in parts],
            "96 padded to 128 (before)": [narrow[f"before_{p}"] / base[f"before_{p}"] for p, _ in parts]}
  fig, ax = plt.subplots(figsize=(6, 3.2))
  bars = _grouped_bars(ax, ratios)
  for label, prefix in (("96 without padding (now)", ""), ("96 padded to 128 (before)", "before_")):
    ax.bar_label(bars[label], [f"{q:.2f}x" for q in ratios[label]], fontsize=7)
    ax.bar_label(bars[label], [f"{narrow[prefix + p]:.3f} ms\nagainst\n{base[prefix + p]:.3f}"
                               for p, _ in parts], label_type="center", fontsize=7, color="w")
  ax.axhline(1, color="k", lw=1, label="K = V = 128 (same call)")
  ax.axhline(0.85, color="k", lw=1, ls="--", label="target: 0.85x")
  ax.set_xticks(range(len(parts)), [label for _, label in parts])
  ax.set(title=f"K = V = 96 against 128 ({data['shape'].split(',')[0]}, bf16)",
         ylabel="time relative to K = V = 128", ylim=(0, 1.75))
  ax.legend(loc="upper center", ncols=2)
  fig.tight_layout()
  return fig


@figure("kda_long_sequences.png")
def long_sequences_figure():
  """Forward+backward time and compiled memory against T, segmented (default) and as one call."""
  rows = _read_json("kda_long_sequences.json")["rows"]
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
  t = np.array([r["T"] for r in rows], float)
  for key, label, marker in (("default", "default (segments above 8 GiB of residuals)", "o"),
                             ("whole", "whole sequence as one call", "s")):
    ms = [r[key]["ms"] if r[key] and "ms" in r[key] else np.nan for r in rows]
    gib = [r[key]["gib"] if r[key] and "gib" in r[key] else np.nan for r in rows]
    axes[0].plot(t, ms, marker=marker, label=label)
    axes[1].plot(t, gib, marker=marker, label=label)
  first = rows[0]["default"]["ms"]
  axes[0].plot(t, first * t / t[0], "k:", lw=1, label="linear in T from 32k")
  for r in rows:
    if r["segments"] > 1:
      axes[0].annotate(f"{r['segments']} segments", (r["T"], r["default"]["ms"]), textcoords="offset points",
                       xytext=(-8, 2), ha="right", va="bottom", fontsize=7)
    if r["whole"] and "out_of_memory_gib_asked" in r["whole"]:
      axes[1].annotate(f"whole: out of memory\n({r['whole']['out_of_memory_gib_asked']} GiB asked)",
                       (r["T"], r["default"]["gib"]), textcoords="offset points", xytext=(-6, -28),
                       ha="right", fontsize=7)
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xticks(t, [f"{int(x) // 1024}k" for x in t])
    ax.set_xlabel("sequence length T (tokens; B1 H16 K = V = 128, bf16)")
  axes[0].set(yscale="log", ylabel="forward + backward time (ms, log scale)", title="forward + backward time",
              ylim=(None, 2 * max(r["default"]["ms"] for r in rows)))
  axes[1].set(ylabel="compiled memory (GiB)", title="memory (XLA memory_analysis)")
  axes[0].legend(loc="lower right")
  fig.tight_layout()
  return fig


@figure("kda_decode.png")
def decode_figure():
  """Microseconds per decode step against the tokens a step decodes, by implementation and batch."""
  data = _read_json("kda_decode.json")
  rows = data["rows"]
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
  for ax, b in zip(axes, sorted({r["B"] for r in rows})):
    mine = [r for r in rows if r["B"] == b]
    t_new = [r["T_new"] for r in mine]
    for key, label in data["impls"].items():
      ax.plot(t_new, _column(mine, key), marker="o", label=label)
    ax.plot([4], [data["roofline_4_tokens_us"][str(b)]], "k_", ms=14, mew=2,
            label="state roofline (4 tokens)")
    for r in mine:
      for i, key in enumerate(data["impls"]):
        if r[key] is None:
          ax.annotate(f"{data['impls'][key]}: timed out", (r["T_new"], r["fused"]),
                      textcoords="offset points", xytext=(-4, -14), ha="right", fontsize=7, color=f"C{i}")
    ax.set(xscale="log", yscale="log", title=f"B = {b}", xlabel="tokens decoded per step (T_new)")
    ax.set_xticks(t_new, [str(t) for t in t_new])
  axes[0].set_ylabel("time per step (us, log scale)")
  axes[0].legend(loc="upper left")
  fig.tight_layout()
  return fig


@figure("trainer.png")
def trainer_figure():
  """Training tokens/s of the GPU presets, buffered against dropless MoE, with the MFU."""
  rows = _read_json("trainer.json")["rows"]
  configs = list(dict.fromkeys(r["config"] for r in rows))
  fig, axes = plt.subplots(1, len(configs), figsize=(8, 3.2))
  for ax, config in zip(axes, configs):
    mine = [r for r in rows if r["config"] == config]
    means = [np.mean(r["ktokens_per_s"]) for r in mine]
    bars = ax.bar(range(len(mine)), means, 0.6, color=[f"C{i}" for i in range(len(mine))])
    for i, r in enumerate(mine):
      ax.plot([i, i], r["ktokens_per_s"], "k.", ms=5, label="steps 11-20, 21-30" if i == 0 else None)
    ax.bar_label(bars, [" / ".join(f"{x:.1f}k" for x in r["ktokens_per_s"]) + "\nMFU "
                        + " / ".join(f"{x:.1f}%" for x in r["mfu_pct"]) for r in mine], fontsize=7)
    names = {"buffered": "buffered\n(capacity 1.25)", "dropless": "dropless\n(our grouped matmuls)"}
    ax.set_xticks(range(len(mine)), [names[r["path"]] for r in mine])
    ax.set(title=f"{config} ({mine[0]['params']})", ylabel="training tokens/s (thousands)",
           ylim=(0, max(means) * 1.25))
    ax.legend(loc="lower right")
  fig.tight_layout()
  return fig


def render(out_dir: str, names: list[str] | None = None) -> list[str]:
  """Writes the figures (all, or `names`) into `out_dir`; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for name in names or FIGURES:
    path = os.path.join(out_dir, name)
    with matplotlib.rc_context():  # the caller's settings come back afterwards
      _style()
      _save(FIGURES[name](), path)
    paths.append(path)
  return paths


@figure("pipeline_bytes.png")
def pipeline_bytes_figure():
  """Bytes crossing one pipeline boundary per microbatch, by residual strategy and stage count."""
  data = _read_json("pipeline_bytes.json")
  rows = data["rows"]
  strategies = list(dict.fromkeys(r["residual"] for r in rows))
  stages = sorted({r["S"] for r in rows})
  fig, ax = plt.subplots(figsize=(6.5, 3.2))
  cell = {(r["residual"], r["S"]): r for r in rows}
  measured = {f"S = {s}": [cell[name, s]["measured_mib"] if (name, s) in cell else None
                           for name in strategies] for s in stages}
  bars = _grouped_bars(ax, {label: [np.nan if v is None else v for v in mib]
                            for label, mib in measured.items()})
  for s in stages:
    # A count N labels each bar; a layout the model refuses (blocks across a boundary) says so.
    labels = [f"{cell[name, s]['N']} x" if (name, s) in cell and "refused" not in cell[name, s]
              else "" for name in strategies]
    ax.bar_label(bars[f"S = {s}"], labels, fontsize=7)
    for bar, name in zip(bars[f"S = {s}"], strategies):
      if "refused" in cell.get((name, s), {}):
        ax.annotate("refused", (bar.get_x() + bar.get_width() / 2, 1), ha="center", va="bottom",
                    fontsize=7, rotation=90)
  ax.set_xticks(range(len(strategies)), strategies)
  ax.set(title="bytes sent across a stage boundary (label: tensors of the residual stream)",
         ylabel="MiB per microbatch, forward", xlabel="residual strategy (8 layers, d 1024, 2048 tokens, f32)")
  ax.legend(loc="upper left")
  fig.tight_layout()
  return fig


# -- page tables ---------------------------------------------------------------------------

# {data file stem: function writing its markdown table}, filled by @page_table; the table stands on
# the page between `<!-- data:NAME -->` and `<!-- /data -->`.
PAGE_TABLES: dict[str, Callable[[dict], str]] = {}
PAGES = ("docs/benchmarks.md",)
_DATA_MARK = re.compile(r"(<!-- data:(?P<name>[a-z0-9_]+) -->\n)(.*?)(<!-- /data -->)", re.S)


def page_table(name: str):
  """Registers the function rendering docs/data/<name>.json as a page table."""
  def register(fn):
    PAGE_TABLES[name] = fn
    return fn
  return register


def _table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


@page_table("kda_head_widths")
def head_widths_table(data: dict) -> str:
  base = next(r for r in data["rows"] if r["K"] == 128)
  rows = []
  for r in data["rows"]:
    now = f"{r['fwd_ms']:.3f} / {r['fwdbwd_ms']:.3f}"
    before = f"{r['before_fwd_ms']:.3f} / {r['before_fwdbwd_ms']:.3f}"
    if r is base:
      rows.append([str(r["K"]), now, "1", before])
    else:
      ratio = lambda prefix: " / ".join(f"{r[prefix + p] / base[prefix + p]:.2f}x"
                                        for p in ("fwd_ms", "fwdbwd_ms"))
      rows.append([str(r["K"]), now, ratio(""), f"{before} ({ratio('before_')})"])
  return _table(["K = V", "fwd / fwd+bwd ms", "against 128", "before (pad to 128)"], rows)


@page_table("kda_long_sequences")
def long_sequences_table(data: dict) -> str:
  def cell(entry):
    if not entry:
      return ""
    if "out_of_memory_gib_asked" in entry:
      return f"out of memory ({entry['out_of_memory_gib_asked']} GiB asked, call {entry['call']})"
    return f"{entry['ms']:.2f} / {entry['gib']:.2f} (call {entry['call']})"
  rows = []
  for r in data["rows"]:
    default = cell(r["default"])
    if r.get("default_again"):
      default += f", {r['default_again']['ms']:.2f} (call {r['default_again']['call']})"
    rows.append([str(r["T"]), f"{r['residuals_gib']:.2f}", str(r["segments"]), default, cell(r["whole"]),
                 "yes" if r["finite"] else "**no**"])
  return _table(["T", "residuals GiB", "default segments", "default ms / compiled GiB",
                 "whole ms / compiled GiB", "outputs finite"], rows)


@page_table("kda_decode")
def decode_table(data: dict) -> str:
  """Microseconds per step, the fastest of each row in bold."""
  def us(x):
    return "" if x is None else f"{x:.1f}" if x < 100 else f"{x:.0f}"
  rows = []
  for r in data["rows"]:
    fastest = min((r[k] for k in data["impls"] if r[k] is not None))
    rows.append([str(r["B"]), str(r["T_new"])] + [f"**{us(r[k])}**" if r[k] == fastest else us(r[k])
                                                  for k in data["impls"]])
  return _table(["B", "T_new", *data["impls"].values()], rows)


@page_table("trainer")
def trainer_table(data: dict) -> str:
  rows, seen = [], set()
  for r in data["rows"]:
    name = (f"`{r['config']}` ({r['params']}), buffered (capacity 1.25)" if r["config"] not in seen
            else "the same, dropless through our kernels")
    seen.add(r["config"])
    rows.append([name, ", ".join(f"{x:.1f}k" for x in r["ktokens_per_s"]),
                 ", ".join(f"{x:.1f}%" for x in r["mfu_pct"]),
                 "" if r["loss_step30"] is None else f"{r['loss_step30']:.3f}"])
  return _table(["config", "tokens/s", "MFU", "loss at step 30"], rows)


def render_page_tables(markdown: str) -> str:
  """`markdown` with every `<!-- data:NAME -->...<!-- /data -->` block rendered from docs/data/NAME.json."""
  def table_for(m):
    name = m.group("name")
    if name not in PAGE_TABLES:
      raise ValueError(f"no page table {name!r}; known: {sorted(PAGE_TABLES)}")
    return m.group(1) + PAGE_TABLES[name](_read_json(f"{name}.json")) + "\n" + m.group(4)
  return _DATA_MARK.sub(table_for, markdown)


def render_pages() -> list[str]:
  """Rewrites the data tables of PAGES in place; returns the pages that changed."""
  changed = []
  for page in PAGES:
    path = os.path.join(ROOT, page)
    with open(path, encoding="utf-8") as f:
      text = f.read()
    new = render_page_tables(text)
    if new != text:
      with open(path, "w", encoding="utf-8") as f:
        f.write(new)
      changed.append(path)
  return changed


NOTEBOOKS = ("decay_ablation", "router_ablation", "residual_ablation")


def execute_notebook(name: str, runs_dir: str):
  """The notebook executed in its "full" setting on the committed summary and runs (nothing trains)."""
  import nbclient  # optional: the `notebooks` extra
  import nbformat  # optional: the `notebooks` extra
  book = nbformat.read(os.path.join(ROOT, "notebooks", f"{name}.ipynb"), as_version=4)
  for cell in book.cells:
    cell.source = cell.source.replace('SETTING = "quick"', 'SETTING = "full"')
  # The kernel imports this checkout's k3jax, whatever else is installed.
  env = {"ABLATION_RUNS": runs_dir, "ABLATION_OUT": os.path.join(runs_dir, "must_not_train"),
         "JAX_PLATFORMS": "cpu", "ABLATION_SUMMARY": os.path.join(RESULTS, "ablations_summary.json"),
         "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
  saved = {k: os.environ.get(k) for k in [*env, "MPLBACKEND"]}
  os.environ.update(env)
  os.environ.pop("MPLBACKEND", None)  # the kernel draws inline PNGs
  try:
    # No timing records: an executed copy changes only when its inputs do.
    nbclient.NotebookClient(book, timeout=600, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}}).execute()
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  return _portable(book)


def _small_png(data: str) -> str:
  """A base64 PNG re-encoded with a 256-colour palette (a third of the size for line plots)."""
  import PIL.Image  # comes with matplotlib
  image = PIL.Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB").quantize(colors=256)
  buffer = io.BytesIO()
  image.save(buffer, format="PNG", optimize=True)
  return base64.b64encode(buffer.getvalue()).decode("ascii")


def _portable(book):
  """Drops stderr (library warnings), writes paths relative to the checkout, shrinks the images."""
  for cell in book.cells:
    if cell.cell_type != "code":
      continue
    cell.outputs = [o for o in cell.outputs if o.get("name") != "stderr"]
    for output in cell.outputs:
      if output.output_type == "stream":
        output.text = output.text.replace(ROOT + os.sep, "")
      if "image/png" in output.get("data", {}):
        output.data["image/png"] = _small_png(output.data["image/png"])
  return book


# The HTML copies' own style (nbconvert's "basic" template writes no CSS; its "lab" one adds 290 KB).
_HTML_CSS = """
body { font-family: sans-serif; max-width: 1000px; margin: 2em auto; padding: 0 1em; line-height: 1.4; }
.input_area { background: #f7f7f7; border: 1px solid #ddd; padding: 0.3em 0.6em; overflow-x: auto; }
.prompt, .anchor-link { display: none; }
pre { margin: 0; white-space: pre-wrap; }
.output_area { margin: 0.4em 0 1.2em; }
table { border-collapse: collapse; font-size: 90%; }
th, td { border: 1px solid #ccc; padding: 2px 6px; }
img { max-width: 100%; }
"""


def html_generator() -> str:
  """The versions the HTML depends on, written into each copy (the test compares bytes when they match)."""
  import mistune  # pylint: disable=import-outside-toplevel  (nbconvert's dependencies)
  import nbconvert  # pylint: disable=import-outside-toplevel
  import pygments  # pylint: disable=import-outside-toplevel
  return f"nbconvert {nbconvert.__version__}, mistune {mistune.__version__}, pygments {pygments.__version__}"


def notebook_html(book, title: str) -> str:
  """A standalone HTML page of an executed notebook: its cells and outputs (PNGs inline), small CSS."""
  import nbconvert  # optional: the `notebooks` and `test` extras
  from pygments.formatters import HtmlFormatter  # pylint: disable=import-outside-toplevel
  body, _ = nbconvert.HTMLExporter(template_name="basic").from_notebook_node(book)
  css = HtmlFormatter().get_style_defs(".highlight") + _HTML_CSS
  return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
          f'<meta name="generator" content="{html_generator()}">\n<title>{title}</title>\n'
          f"<style>\n{css}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n")


def write_html(ipynb_path: str) -> str:
  """Writes the HTML copy of an executed notebook beside it; returns its path."""
  import nbformat  # optional: the `notebooks` extra
  path = os.path.splitext(ipynb_path)[0] + ".html"
  name = os.path.basename(os.path.splitext(ipynb_path)[0])
  with open(path, "w", encoding="utf-8") as f:
    f.write(notebook_html(nbformat.read(ipynb_path, as_version=4), f"{name} (executed on docs/results)"))
  return path


def render_notebooks(out_dir: str) -> list[str]:
  """Executed copies of the ablation notebooks (GitHub shows their tables and figures) in `out_dir`,
  each with an HTML copy beside it."""
  import nbformat  # optional: the `notebooks` extra
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  with _ablation_runs() as runs_dir:
    with tarfile.open(os.path.join(RESULTS, "ablation_runs.tar.gz")) as tar:
      tar.extractall(runs_dir, filter="data")  # the notebooks read the runs' summaries too
    for name in NOTEBOOKS:
      path = os.path.join(out_dir, f"{name}.ipynb")
      nbformat.write(execute_notebook(name, runs_dir), path)
      paths += [path, write_html(path)]
  return paths


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(ROOT, "docs", "figures"), help="output directory")
  parser.add_argument("--only", default="", help="comma-separated figure file names (default: all)")
  parser.add_argument("--notebooks", default="", metavar="DIR",
                      help="also write the ablation notebooks, executed on the committed results, into DIR "
                           "(docs/notebooks; needs the `notebooks` extra), each with an HTML copy")
  parser.add_argument("--html", default="", metavar="DIR",
                      help="only write the HTML copies of the executed notebooks already in DIR")
  args = parser.parse_args(argv)
  paths = render(args.out, [n for n in args.only.split(",") if n] or None)
  if not args.only and args.out == parser.get_default("out"):
    paths += render_pages()
  if args.notebooks:
    paths += render_notebooks(args.notebooks)
  elif args.html:
    paths += [write_html(p) for p in sorted(glob.glob(os.path.join(args.html, "*.ipynb")))]
  for path in paths:
    print(f"{path}  {os.path.getsize(path) / 1024:.0f} KB")


if __name__ == "__main__":
  main()
