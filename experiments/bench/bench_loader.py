r"""Packed-document loader: tokens/s and packing efficiency, on the CPU.

One core, as the issue of a training host's input pipeline asks (`taskset -c 0`):

  taskset -c 0 python experiments/bench/bench_loader.py --seq_lens=128,2048
  taskset -c 0 python experiments/bench/bench_loader.py --sources=bytes,prepared:runs/data/stdlib_bpe
  taskset -c 0 python experiments/bench/bench_loader.py ... --json=/tmp/loader.json   # rows as JSON too

Each row builds the trainer's pipeline (`k3jax.data.documents.packed_dataset`,
no background prefetch, so the figure is one thread's), takes `--warmup`
batches, then times batches for `--seconds`. tokens/s counts every position of
a row, padding included (what the model consumes); "non-padding" is the share
of positions that hold a document's token, and "docs/row" the mean documents
(pieces) per row. The ratio column divides tokens/s by `--consumption` (gpu_1b
trains at about 130k tokens/s on one H200; docs/benchmarks.md).
"""
from __future__ import annotations

import time

from absl import app, flags

from k3jax.data import ByteCorpus, Packing, PreparedDocuments, packed_dataset
from pallas_kernels.tools import bench_json

_SOURCES = flags.DEFINE_list("sources", ["bytes"], "'bytes' (the stdlib sources) or 'prepared:DIR'.")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["128", "2048"], "Row lengths T.")
_ROWS = flags.DEFINE_integer("rows", 16, "Rows per batch.")
_MAX_DOCS = flags.DEFINE_integer("max_documents_per_row", 8, "Packing: documents per row at most.")
_BINS = flags.DEFINE_integer("bins", 64, "Packing: rows first-fit fills at once.")
_SECONDS = flags.DEFINE_float("seconds", 5.0, "Timed seconds per row of the table.")
_WARMUP = flags.DEFINE_integer("warmup", 4, "Untimed batches first.")
_CONSUMPTION = flags.DEFINE_float("consumption", 130e3, "Tokens/s a training run consumes (the ratio's base).")
_JSON = flags.DEFINE_string("json", "", "Also write the table's rows, the command line, device and "
                            "commit to this JSON file (see pallas_kernels/tools/bench_json.py).")


def _documents(source: str):
  if source == "bytes":
    return ByteCorpus().documents("train")
  kind, _, path = source.partition(":")
  if kind != "prepared" or not path:
    raise app.UsageError(f"--sources: {source!r} is neither 'bytes' nor 'prepared:DIR'")
  return PreparedDocuments(path).documents("train")


def measure(documents, packing: Packing, rows: int, seconds: float, warmup: int) -> dict[str, float]:
  """Tokens/s, non-padding share and documents per row of one pipeline, timed in this thread."""
  iterator = iter(packed_dataset(documents, packing, rows=rows, seed=0))
  for _ in range(warmup):
    next(iterator)
  positions = real = docs = 0
  start = time.perf_counter()
  while time.perf_counter() - start < seconds:
    batch = next(iterator)
    positions += batch["mask"].size
    real += batch["mask"].sum()
    docs += batch["segment_ids"].max(axis=1).sum()
  elapsed = time.perf_counter() - start
  return {"tokens_per_s": positions / elapsed, "non_padding": real / positions,
          "docs_per_row": docs / (positions / packing.seq_len)}


def main(argv):
  del argv
  tables = bench_json.Tables()
  tables.start("loader", ["source", "T", "tokens/s", f"x {_CONSUMPTION.value / 1e3:.0f}k",
                          "non-padding", "docs/row"])
  for source in _SOURCES.value:
    documents = _documents(source)
    for t in map(int, _SEQ_LENS.value):
      packing = Packing(seq_len=t, max_documents_per_row=_MAX_DOCS.value, bins=_BINS.value, prefetch=0)
      m = measure(documents, packing, _ROWS.value, _SECONDS.value, _WARMUP.value)
      tables.row([source, t, f"{m['tokens_per_s'] / 1e6:.2f}M",
                  f"{m['tokens_per_s'] / _CONSUMPTION.value:.1f}", f"{m['non_padding']:.4f}",
                  f"{m['docs_per_row']:.2f}"])
  if _JSON.value:
    bench_json.write(_JSON.value, tables.tables, peer_or_base=(
        f"base: --consumption, {_CONSUMPTION.value:.0f} tokens/s a training run consumes"))


if __name__ == "__main__":
  app.run(main)
