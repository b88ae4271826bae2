"""Per-kernel GPU times of the peer, fla `chunk_kda`, for comparison with ours.

`tune_kda.py` prints our per-stage times; this prints the peer's kernels at
the same shape, from the PyTorch profiler over `--calls` timed calls (after
`--warmup` calls that absorb Triton's autotuning), as a table sorted by
time. Needs torch and fla (GPU machine only; see docs/benchmarks.md for the
wheels):

  python experiments/bench/peer_kernel_times.py --shape=16x2048x16x128 --modes=safe
  python experiments/bench/peer_kernel_times.py ... --json=/tmp/peer_kernels.json   # rows as JSON too

Times are CUDA kernel times averaged per call (ms); "share" is the kernel's
part of the pass's summed kernel time. Kernel names are fla's.
"""
from __future__ import annotations

import os
import sys

from absl import app
from absl import flags

import fla_peer  # this directory: the peer's inputs and kernel table

# --json: the repository root holds pallas_kernels/tools/bench_json.py.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_SHAPE = flags.DEFINE_string("shape", "16x2048x16x128", "BxTxHxD (K = V = D).")
_MODES = flags.DEFINE_list("modes", ["safe"], "fla safe_gate modes: safe, unsafe.")
_LOWER_BOUND = flags.DEFINE_float("lower_bound", -5.0, "Gate lower bound g_min.")
_WARMUP = flags.DEFINE_integer("warmup", 5, "Untimed calls first (autotuning).")
_CALLS = flags.DEFINE_integer("calls", 10, "Profiled calls.")
_JSON = flags.DEFINE_string("json", "", "Also write every table's rows, the command line, device "
                            "and commit to this JSON file (see pallas_kernels/tools/bench_json.py).")


def main(argv):
  del argv
  import torch  # pylint: disable=g-import-not-at-top
  from fla.ops.kda import chunk_kda  # pylint: disable=g-import-not-at-top
  from torch.profiler import ProfilerActivity, profile  # pylint: disable=g-import-not-at-top

  b, t, h, d = (int(x) for x in _SHAPE.value.split("x"))
  q, k, v, g, beta, do = fla_peer.inputs(b, t, h, d, _LOWER_BOUND.value)
  print(f"device: {torch.cuda.get_device_name()}; fla chunk_kda, shape {_SHAPE.value} bf16",
        flush=True)
  tables = {}  # "{mode} {pass}": the parsed kernel table, for --json
  for mode in _MODES.value:
    if mode not in ("safe", "unsafe"):
      raise ValueError(f"--modes takes safe and unsafe, got {mode!r}")
    kw = fla_peer.gate_kwargs(mode == "safe", _LOWER_BOUND.value)
    xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]

    def fwd():
      with torch.no_grad():
        chunk_kda(q, k, v, g, beta, **kw)

    def fwd_bwd():
      for x in xs:
        x.grad = None
      chunk_kda(*xs, **kw)[0].backward(do)

    for label, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
      for _ in range(_WARMUP.value):
        fn()
      torch.cuda.synchronize()
      with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(_CALLS.value):
          fn()
        torch.cuda.synchronize()
      table, total = fla_peer.cuda_kernel_table(prof.events(), _CALLS.value)
      print(f"\n{mode} {label}: {total:.3f} ms of kernel time per call\n{table}", flush=True)
      tables[f"{mode} {label}"] = _parsed(table, total)
  if _JSON.value:
    _write(_JSON.value, tables, torch.cuda.get_device_name())


def _parsed(table: str, total_ms: float) -> dict:
  """A printed kernel table as {"columns", "rows", "total ms per call"}."""
  from pallas_kernels.tools import bench_json  # pylint: disable=g-import-not-at-top
  return {**bench_json.parse_table(table), "total ms per call": total_ms}


def _write(path: str, tables: dict, gpu: str) -> None:
  """Writes the peer's kernel tables with bench_json, naming torch's GPU (JAX, which bench_json
  asks too, stays on the CPU: the GPU's memory is torch's)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from pallas_kernels.tools import bench_json  # pylint: disable=g-import-not-at-top
  bench_json.write(path, tables, gpu=gpu, platform="cuda (torch)",
                   peer_or_base="none: the peer's own kernel times (fla chunk_kda); "
                   "share: of the pass's summed kernel time")


if __name__ == "__main__":
  app.run(main)
