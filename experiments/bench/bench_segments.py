r"""What document segments cost: KDA with the state restarted per document, and attention
masked by document, against the same calls without segments.

GPU (one H200 or H100; bf16, H16, K = V = 128):

  python experiments/bench/bench_segments.py --shapes=16x2048,4x8192
  python experiments/bench/bench_segments.py ... --json=/tmp/segments.json   # the rows as JSON too

Rows, each forward and forward+backward (pipelined timer, ms per call):
* `kda`: `chunk_kda` on the Pallas path, no segments;
* `kda, segment masks, 1 doc`: `chunk_kda(segment_ids=...)` with one document
  per row, the cost of the masks alone;
* `kda, segment masks, D docs`: D documents of random lengths per row (what
  the layers run);
* `kda rows, D docs`: the former per-row packed layout, for comparison: each
  row one packed sequence (`cu_seqlens` = its run starts, M = `--max_segments`
  of them, the trainer's bound data.max_documents_per_row + 1) under
  `jax.vmap`, a grid of ceil(T / C) + M chunks;
* `attention causal`: `jax.nn.dot_product_attention(is_causal=True)` (cuDNN on
  the GPU);
* `attention by document (mask)`: the same with the [B, 1, T, T] document mask
  of the D-document rows (`Segments.attention_mask_b1tt`);
* `attention by document (packed)`: the same rows through cuDNN's packed layout
  (`k3jax.layers.packed_attention`, `documents="packed"`), on the GPU only.
On a CPU the Pallas rows run interpreted: use tiny shapes (`--shapes=2x64 --heads=2
--head_dim=32 --iters=2`), whose times say nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags

from k3jax.layers import packed_attention
from k3jax.layers.segments import Segments
from pallas_kernels import platform
from pallas_kernels.kda import api
from pallas_kernels.tools import bench
from pallas_kernels.tools import bench_json

_SHAPES = flags.DEFINE_list("shapes", ["16x2048", "4x8192"], "BxT shapes.")
_HEADS = flags.DEFINE_integer("heads", 16, "Heads H.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "K = V.")
_DOCS = flags.DEFINE_integer("docs_per_row", 3, "Documents per row of the segmented rows.")
_MAX_SEGMENTS = flags.DEFINE_integer("max_segments", 9, "Static runs per row M.")
_ITERS = flags.DEFINE_integer("iters", 10, "Calls per pipelined round.")
_JSON = flags.DEFINE_string("json", "", "Also write the table's rows, the command line, device "
                            "and commit to this JSON file (see pallas_kernels/tools/bench_json.py).")

_LOWER = -5.0


def _timed(fn, args, backward: bool) -> float:
  if backward:
    def fwd_bwd(*xs):
      out, vjp = jax.vjp(fn, *xs)
      return vjp(jnp.ones_like(out))
    call = jax.jit(fwd_bwd)
  else:
    call = jax.jit(fn)
  return bench.pipelined_ms(call, *args, iters=_ITERS.value, rounds=3, warmup=2)


def packed_rows(q, k, v, g, beta, offsets_bm, **kw):
  """Each row as one packed sequence (cu_seqlens = its run starts), vmapped over the rows."""
  def row(q, k, v, g, beta, cu):
    return api.chunk_kda(q[None], k[None], v[None], g[None], beta[None], cu_seqlens=cu,
                         **kw)[0][0]
  return jax.vmap(row)(q, k, v, g, beta, offsets_bm)


def kda_rows(b, t, h, d, interpret):
  """(name, function of (q, k, v, g, beta)) of the KDA rows."""
  kw = dict(lower_bound=_LOWER, implementation="pallas", interpret=interpret)
  ids_bt = bench.document_ids(b, t, _DOCS.value)
  docs = Segments.from_ids(jnp.asarray(ids_bt), _MAX_SEGMENTS.value)
  one = jnp.zeros((b, t), jnp.int32)
  masks = lambda ids: lambda q, k, v, g, beta: api.chunk_kda(q, k, v, g, beta, segment_ids=ids,
                                                             **kw)[0]
  return [
      ("kda", lambda q, k, v, g, beta: api.chunk_kda(q, k, v, g, beta, **kw)[0]),
      ("kda, segment masks, 1 doc", masks(one)),
      (f"kda, segment masks, {_DOCS.value} docs", masks(docs.run_bt)),
      (f"kda rows, {_DOCS.value} docs (M {_MAX_SEGMENTS.value})",
       lambda q, k, v, g, beta: packed_rows(q, k, v, g, beta, docs.offsets_bm, **kw)),
  ]


def attention_rows(b, t):
  """(name, function of (q, k, v)) of the attention rows."""
  impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
  ids_bt = bench.document_ids(b, t, _DOCS.value)
  segments = Segments.from_ids(jnp.asarray(ids_bt), _MAX_SEGMENTS.value)
  mask = segments.attention_mask_b1tt()
  attend = lambda q, k, v, **kw: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                             implementation=impl, **kw)
  rows = [(f"attention causal ({impl})", attend),
          (f"attention by document ({impl}, mask)", lambda q, k, v: attend(q, k, v, mask=mask))]
  if impl == "cudnn":
    layout = packed_attention.cudnn_layout(segments)
    rows.append(("attention by document (cudnn, packed)",
                 lambda q, k, v: packed_attention.attend(q, k, v, *layout)))
  return rows


def main(argv):
  del argv
  interpret = platform.interprets("kda")
  h, d = _HEADS.value, _HEAD_DIM.value
  print(f"device: {jax.devices()[0].device_kind}; bf16, H{h}, K = V = {d}; pipelined ms per call")
  tables = bench_json.Tables()
  tables.start("segments", ["B x T", "path", "fwd ms", "fwd+bwd ms"])
  for shape in _SHAPES.value:
    b, t = map(int, shape.split("x"))
    q, k, v, g, beta = bench.make_inputs(jax.random.key(0), b, t, h, d, lower_bound=_LOWER)
    rows = [(name, fn, (q, k, v, g, beta)) for name, fn in kda_rows(b, t, h, d, interpret)]
    rows += [(name, fn, (q, k, v)) for name, fn in attention_rows(b, t)]
    for name, fn, args in rows:
      fwd, both = (_timed(fn, args, backward) for backward in (False, True))
      tables.row([f"{b} x {t}", name, f"{fwd:.3f}", f"{both:.3f}"])
  if _JSON.value:
    bench_json.write(_JSON.value, tables.tables, peer_or_base=(
        "base: the same call without segments in the same run (kda for the kda rows, "
        "attention causal for attention by document)"))


if __name__ == "__main__":
  app.run(main)
