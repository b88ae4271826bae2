"""Sweeps KernelConfig choices of the Pallas KDA kernels and prints per-stage times.

One row per combination of the grid's values, with every kernel's median
time (ms) and the forward / backward sums of the stages that the default
(saved-residual) path runs; the best value of each column is starred. On the
GPU machine, from the repository root:

  python experiments/bench/tune_kda.py --shape=16x2048x16x128 \\
      --grid="block_v=32,64,128;warps.state_fwd=4,8;warps.state_bwd=4,8"
  python experiments/bench/tune_kda.py --grid="inverse=substitution,blocked;intra_bwd=split,tiles"
  python experiments/bench/tune_kda.py --stages=state_rec,output_fwd \\
      --grid="rec_block_v=32,64;warps.state_rec=2,4;num_stages=1,2,3"
  python experiments/bench/tune_kda.py ... --json=/tmp/tune.json   # the rows as JSON too

Grid syntax: `;` separates fields, `,` separates a field's values; fields
are KernelConfig names or `warps.<stage>` (as
`bench_kernels.py --overrides`). A combination that fails (an invalid tile, a compiler error)
prints an error row and the sweep goes on. Timings only: correctness of a
new choice is the job of the `gpu` tests.
"""
from __future__ import annotations

import os
import sys

from absl import app
from absl import flags

# Run from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_SHAPE = flags.DEFINE_string("shape", "16x2048x16x128", "BxTxHxD (K = V = D).")
_GRID = flags.DEFINE_string("grid", "block_v=32,64;warps.state_fwd=4,8",
                            "Fields and values to sweep: name=v1,v2;name2=...")
_DIAGONAL = flags.DEFINE_enum("diagonal", "dense", ["dense", "pairwise"], "Diagonal strategy.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls per stage (median).")
_CHUNK = flags.DEFINE_integer("chunk_size", 64, "Chunk length C.")
_SUB = flags.DEFINE_integer("sub_chunk", 16, "Diagonal tile length L.")
_LOWER_BOUND = flags.DEFINE_float("lower_bound", -5.0, "Gate lower bound g_min.")
_STAGES = flags.DEFINE_list("stages", [], "Time only these stages (names as in the table; "
                            "empty: all). Kernels producing their inputs still run once.")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Emulate the kernels (CPU smoke run; the "
                               "times mean nothing).")
_JSON = flags.DEFINE_string("json", "", "Also write the table's rows (without the stars), the "
                            "command line, device and commit to this JSON file (see "
                            "pallas_kernels/tools/bench_json.py).")

def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tools import bench  # pylint: disable=g-import-not-at-top

  combos = bench.parse_grid(_GRID.value)
  b, t, h, d = (int(x) for x in _SHAPE.value.split("x"))
  dtype = jnp.float32 if _INTERPRET.value else jnp.bfloat16
  args = bench.make_inputs(jax.random.PRNGKey(0), b, t, h, d, dtype, _LOWER_BOUND.value)
  print(f"device: {jax.devices()[0].device_kind}; shape {_SHAPE.value} {jnp.dtype(dtype).name}, "
        f"C={_CHUNK.value} L={_SUB.value} {_DIAGONAL.value}; {len(combos)} configurations; "
        f"fwd sum = {' + '.join(bench.FWD_STAGES)}, bwd sum = {' + '.join(bench.BWD_STAGES)}",
        flush=True)
  rows = []
  for items in combos:
    label = ", ".join(items)
    try:
      times = bench.stage_times_ms(*args, diagonal=_DIAGONAL.value, chunk_size=_CHUNK.value,
                                   sub_chunk=_SUB.value, iters=_ITERS.value,
                                   config_overrides=bench.parse_overrides(items),
                                   interpret=_INTERPRET.value,
                                   stages=_STAGES.value or None,
                                   lower_bound=_LOWER_BOUND.value)
      rows.append((label, times))
      print(f"{label}: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()), flush=True)
    except Exception as e:  # pylint: disable=broad-except
      # One configuration that does not compile must not lose the others.
      first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
      rows.append((label, f"{type(e).__name__}: {first}"))
      print(f"{label}: failed: {type(e).__name__}: {first}", flush=True)
  text = bench.stage_table(rows)
  print("\n" + text, flush=True)
  if _JSON.value:
    from pallas_kernels.tools import bench_json  # pylint: disable=g-import-not-at-top
    bench_json.write(_JSON.value, {"stages": bench_json.parse_table(text.replace("*", ""))},
                     peer_or_base="none: absolute per-stage times, configurations side by side")


if __name__ == "__main__":
  app.run(main)
