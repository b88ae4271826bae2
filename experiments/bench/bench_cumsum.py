"""Benchmarks the KDA gate-cumsum kernels against the copy rate of the same bytes.

Prints one table per shape: the pipelined time (ms, median of 5 rounds of
--iters calls) of each pass over the [B, T, H*K] float32 gate, its rate in
TB/s of bytes read and written, and its ratio to an XLA elementwise pass over
the same array (read once, written once: the floor for a pass that must read
g and write G).

Passes (`pallas_kernels.tools.bench.cumsum_passes`):

* cumsum / reverse: `kernel_cumsum.chunk_cumsum` (G from g; dg from dG);
* clamped / clamped+record / clamped_bwd: `chunk_kda`'s path for a traced
  gate on the dense diagonal (inference forward, training forward with the
  clamp's record, backward);
* gate / gate_bwd: the fused bounded-sigmoid gate (`kernel_gate_cumsum`,
  bf16 pre-activation in, draw in bf16 out);
* cumsum_xla: XLA's `lax.cumsum` form (the TPU path), for scale.

On the GPU machine, from the repository root:

  python experiments/bench/bench_cumsum.py --shapes=16x2048x16x128,1x32768x16x128
  python experiments/bench/bench_cumsum.py --block_f=128 --warps=8   # a block / warp variant
  python experiments/bench/bench_cumsum.py ... --json=/tmp/cumsum.json   # the rows as JSON too

Every pass runs on in-range gates, as in training: the clamp's mask is then
neither written nor read.
"""
from __future__ import annotations

import os
import sys

from absl import app
from absl import flags

# Run from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_SHAPES = flags.DEFINE_list("shapes", ["16x2048x16x128", "1x32768x16x128"],
                            "BxTxHxK shapes (the gate is [B, T, H*K] float32).")
_CHUNK = flags.DEFINE_integer("chunk_size", 64, "Chunk length C.")
_BLOCK_F = flags.DEFINE_integer("block_f", None, "Columns per program (default: "
                                "kernel_cumsum.default_block_f).")
_WARPS = flags.DEFINE_integer("warps", None, "Triton warps of the cumsum stage (default: "
                              "the KernelConfig's).")
_ITERS = flags.DEFINE_integer("iters", 20, "Calls per timing round.")
_LOWER_BOUND = flags.DEFINE_float("lower_bound", -5.0, "g_min of the clamp and the fused gate.")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Emulate the kernels at a tiny shape (CPU "
                               "smoke run; the times mean nothing).")
_JSON = flags.DEFINE_string("json", "", "Also write every table's rows, the command line, device "
                            "and commit to this JSON file (see pallas_kernels/tools/bench_json.py).")


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  from pallas_kernels import timing  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tools import bench  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tools import bench_json  # pylint: disable=g-import-not-at-top
  from pallas_kernels.kda import kernel_config  # pylint: disable=g-import-not-at-top
  from pallas_kernels.kda import platform_lowering  # pylint: disable=g-import-not-at-top

  shapes = [tuple(int(x) for x in s.split("x")) for s in _SHAPES.value]
  if _INTERPRET.value:
    shapes = [(1, 128, 2, 64)]
  overrides = {"num_warps": (("cumsum", _WARPS.value),)} if _WARPS.value else None
  print(f"device: {jax.devices()[0].device_kind}; block_f={_BLOCK_F.value or 'default'}, "
        f"warps={_WARPS.value or 'default'}")
  tables = bench_json.Tables()  # one per shape
  for b, t, h, k in shapes:
    backend = platform_lowering.host_backend(_INTERPRET.value)
    if backend is None:
      raise app.UsageError("no GPU or TPU here: pass --interpret for a CPU smoke run")
    cfg = kernel_config.make_config(backend=backend,
                                    dtype="bfloat16", head_k=k, head_v=k,
                                    chunk_size=_CHUNK.value, sub_chunk=16, state_programs=b * h,
                                    overrides=overrides)
    table = bench.cumsum_passes(b, t, h * k, chunk_size=_CHUNK.value, lower_bound=_LOWER_BOUND.value,
                   cfg=cfg, block_f=_BLOCK_F.value)
    times = {}
    for name, (fn, args, _) in table.items():
      times[name] = timing.pipelined_ms(lambda: fn(*args), jax.block_until_ready,
                                        iters=_ITERS.value, rounds=5, warmup=3)
    print(f"\nB{b} T{t} H{h} K{k} (gate [B, T, H*K] f32, {4 * b * t * h * k / 1e6:.0f} MB)")
    tables.start(f"B{b} T{t} H{h} K{k}", ["pass", "ms", "TB/s", "x xla_copy"])
    for name, (_, _, nbytes) in table.items():
      ms = times[name]
      tables.row([name, f"{ms:.4f}", f"{nbytes / ms / 1e9:.2f}", f"{ms / times['xla_copy']:.2f}"])
  if _JSON.value:
    bench_json.write(_JSON.value, tables.tables, peer_or_base=(
        "base: xla_copy, an XLA elementwise pass over the same array in the same call"))


if __name__ == "__main__":
  app.run(main)
