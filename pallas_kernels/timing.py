"""Wall-clock timers for accelerator work, with no framework imported.

The caller passes `wait`, which blocks until the work a call returned is done
(`jax.block_until_ready`, or a torch device synchronise), so the JAX
benchmarks and the torch peer process time their calls with the same loops.
"""
from __future__ import annotations

import statistics
import time


def sync_ms(call, wait, *, iters: int, warmup: int) -> float:
  """Median ms of `wait(call())`: each call waited for before the next one.

  The time holds the host's dispatch and the wait as well as the device's
  work ("sync" timing).
  """
  for _ in range(warmup):
    wait(call())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    wait(call())
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


def pipelined_ms(call, wait, *, iters: int, rounds: int, warmup: int) -> float:
  """Ms per call of `call()` dispatched `iters` times back to back, one wait.

  The host's dispatch overlaps the device's work, so the per-call time is the
  device's ("pipelined" timing; what CUDA-event timers such as triton's
  `do_bench` measure). Median over `rounds` rounds; `wait` gets the list of
  the round's results.
  """
  for _ in range(warmup):
    wait(call())
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    outs = [call() for _ in range(iters)]
    wait(outs)
    times.append((time.perf_counter() - t0) * 1e3 / iters)
    del outs
  return statistics.median(times)
