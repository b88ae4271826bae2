"""The peer, fla `chunk_kda`, as the benchmark scripts run it.

Its inputs and gate options, drawn the same way for every script that times
it (`bench_kernels.py --mode=fla`, `peer_kernel_times.py`), and the table of
its per-kernel profiler times. The peer runs in processes of its own: this
module imports no JAX, and torch only inside the functions that need it.
"""
from __future__ import annotations

import collections


def inputs(b: int, t: int, h: int, d: int, lower_bound: float):
  """q, k (unit-norm), v, beta in bf16, g = lower_bound * sigmoid(N(0, 1)) f32
  ([B, T, H, D]; beta [B, T, H]) and a cotangent dO, on the GPU, seed 0."""
  import torch  # pylint: disable=g-import-not-at-top
  import torch.nn.functional as F  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  q = F.normalize(torch.randn(b, t, h, d, device="cuda"), dim=-1).bfloat16()
  k = F.normalize(torch.randn(b, t, h, d, device="cuda"), dim=-1).bfloat16()
  v = torch.randn(b, t, h, d, device="cuda").bfloat16()
  g = (lower_bound * torch.sigmoid(torch.randn(b, t, h, d, device="cuda"))).float()
  beta = torch.sigmoid(torch.randn(b, t, h, device="cuda")).bfloat16()
  do = torch.randn_like(v)
  return q, k, v, g, beta, do


def gate_kwargs(safe: bool, lower_bound: float) -> dict:
  """`chunk_kda` options of its safe_gate=True (bounded) or False mode."""
  return dict(safe_gate=True, lower_bound=lower_bound) if safe else dict(safe_gate=False)


def cuda_kernel_table(events, calls: int) -> tuple[str, float]:
  """Per-kernel times from PyTorch profiler events.

  Args:
    events: profiler events (`prof.events()`); only CUDA ones count.
    calls: how many profiled calls the events cover.

  Returns:
    (markdown table of kernels by total time: ms and launches per call and
    share of the summed kernel time, summed kernel ms per call).
  """
  per_kernel = collections.defaultdict(lambda: [0.0, 0])
  for evt in events:
    if str(evt.device_type).split(".")[-1] != "CUDA":
      continue
    # The attribute's name differs across torch versions; both are in us.
    us = getattr(evt, "device_time", None)
    if us is None:
      us = evt.cuda_time
    entry = per_kernel[evt.name]
    entry[0] += us / 1e3
    entry[1] += 1
  total = sum(t for t, _ in per_kernel.values()) / calls
  lines = ["| kernel | ms per call | launches per call | share |", "|---|---|---|---|"]
  for name, (t, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0]):
    lines.append(f"| {name[:70]} | {t / calls:.3f} | {n / calls:g} | {t / calls / total:.0%} |")
  return "\n".join(lines), total
