"""Device time per kernel of a jitted call, from a JAX profiler trace.

`kernel_ms(fn, *args, calls=5)` runs `fn(*args)` `calls` times under
`jax.profiler.trace` (after one untimed call) and sums the duration of every
event on the device's streams by kernel name: Pallas kernels keep their
`name=` ("gmm", "tgmm"), XLA's carry their fusion names
("loop_multiply_fusion", "input_reduce_fusion", "gemm_fusion_dot", ...). On a
machine without device streams in the trace (the CPU) the result is empty.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile

import jax


def summarize_trace(events, calls: int) -> list[tuple[str, float, float]]:
  """[(kernel name, ms per call, launches per call)] of the device-stream
  events of a Chrome/Perfetto trace, longest first.

  Args:
    events: the trace's "traceEvents" list. Device streams are the threads
      of processes whose name starts with "/device:".
    calls: how many calls the trace holds (the divisor).
  """
  devices = {e["pid"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"
             and str(e.get("args", {}).get("name", "")).startswith("/device:")}
  total_us, launches = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in devices:
      total_us[e["name"]] += float(e.get("dur", 0.0))
      launches[e["name"]] += 1
  rows = [(name, us / 1e3 / calls, launches[name] / calls) for name, us in total_us.items()]
  return sorted(rows, key=lambda row: -row[1])


def kernel_ms(fn, *args, calls: int = 5) -> list[tuple[str, float, float]]:
  """`summarize_trace` of `calls` back-to-back calls of the jitted `fn(*args)`."""
  jax.block_until_ready(fn(*args))  # compile outside the trace
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
      out = None
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
    paths = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
      return []
    with gzip.open(paths[0]) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  return summarize_trace(events, calls)
