"""Long sequences: time and memory of the KDA forward+backward by residual policy.

One table row per sequence length T (B, H, D fixed) and policy: the residual
bytes `kernel_config.residual_bytes` predicts, the checkpointed segments the
default policy runs at that shape (`segment_chunks` against
`kernel_config.RESIDUAL_BUDGET_BYTES`), the compiled program's memory
(`memory_analysis`: arguments + outputs + temporaries, less aliased bytes,
XLA's own buffer assignment), whether every output is finite, and the
pipelined time per call, with as many calls in flight as memory allows
(`calls_in_flight`); "out of memory" when the program does not fit.

  python experiments/bench/bench_kda_memory.py          # B1 H16 D128, T = 2^13 ... 2^20
  python experiments/bench/bench_kda_memory.py --lengths=65536,1048576 --policies=default
  python experiments/bench/bench_kda_memory.py --lengths=64,128 --heads=2 --head_dim=16 --iters=1   # CPU smoke
  python experiments/bench/bench_kda_memory.py ... --json=/tmp/kda_memory.json   # rows as JSON too

On the CPU the kernels run interpreted (a smoke test: the times mean nothing
there).
"""
from __future__ import annotations

import os
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import platform  # noqa: E402
from pallas_kernels.kda import api  # noqa: E402
from pallas_kernels.kda import kernel_config  # noqa: E402
from pallas_kernels.kda import pallas_op  # noqa: E402
from pallas_kernels.tools import bench  # noqa: E402
from pallas_kernels.tools import bench_json  # noqa: E402

# Policy name -> config_overrides of the pallas path: the default (segments
# above the budget), one whole call saving its residuals, one whole call
# recomputing them in the backward.
POLICIES = {"default": None, "whole": {"segment_chunks": None},
            "recompute": {"segment_chunks": None, "save_residuals": False}}

_GIB = 2 ** 30


def _define_flags():
  """The command line (defined only when run as a script, so tests can import this module)."""
  flags.DEFINE_list("lengths", [str(2 ** n) for n in (13, 15, 17, 18, 19, 20)],
                    "Sequence lengths T.")
  flags.DEFINE_integer("batch", 1, "Batch size B.")
  flags.DEFINE_integer("heads", 16, "Heads H.")
  flags.DEFINE_integer("head_dim", 128, "K = V.")
  flags.DEFINE_list("policies", ["default", "whole", "recompute"],
                    f"Residual policies, of {sorted(POLICIES)}.")
  flags.DEFINE_integer("iters", 5, "Timed calls per round (pipelined; median of 3 rounds).")
  flags.DEFINE_float("lower_bound", -5.0, "Gate lower bound g_min.")
  flags.DEFINE_string("json", "", "Also write the table's rows, the command line, device and "
                      "commit to this JSON file (see pallas_kernels/tools/bench_json.py).")


def default_choice(b: int, t: int, h: int, d: int, dtype=jnp.bfloat16, chunk_size: int = 64,
                   backend: str = "triton") -> tuple[int, int]:
  """(segments, residual bytes of the whole call) of the default config at this shape."""
  chunks = -(-t // chunk_size)
  shape = kernel_config.KernelShape(d, d, chunk_size, 16, b * h, b * chunks * chunk_size * h)
  cfg = kernel_config.heuristic_config(shape, dtype, backend)
  segments, _ = pallas_op.segment_layout(chunks, cfg.segment_chunks)
  return segments, kernel_config.residual_bytes(shape, cfg)


def _compiled_bytes(compiled) -> int | None:
  """Arguments + outputs + temporaries - aliased bytes of a compiled program, or None."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if m is None:
    return None
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


def calls_in_flight(compiled, iters: int, limit: int | None = None) -> int:
  """How many calls the pipelined timer may dispatch before it waits.

  Each call in flight holds its own outputs and temporaries (the timer keeps
  a round's results until its one wait), so at T = 2^20 five of them ask for
  more than the device has although one call fits. Cap the round at what
  half the memory left beside the arguments holds (at least one call); the
  long rows take 100+ ms a call, so a wait per call costs them little.
  `limit`: the device's bytes (default: its allocator's limit).
  """
  try:
    m = compiled.memory_analysis()
    if limit is None:
      limit = jax.devices()[0].memory_stats()["bytes_limit"]
  except Exception:  # pylint: disable=broad-except
    return iters      # CPU (interpret) or no memory statistics: no cap
  if m is None:
    return iters
  per_call = m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  free = limit - m.argument_size_in_bytes
  return max(1, min(iters, int(0.5 * free // max(per_call, 1))))


def measure(b: int, t: int, h: int, d: int, policy: str, *, iters: int,
            lower_bound: float) -> dict:
  """One row: {"compiled": bytes, "ms": float, "finite": bool} or {"error": text}."""
  interpret = platform.interprets("kda")
  overrides = POLICIES[policy]

  def loss_grads(q, k, v, g, beta, do):
    def fwd(q, k, v, g, beta):
      o, _ = api.chunk_kda(q, k, v, g, beta, lower_bound=lower_bound, implementation="pallas",
                           interpret=interpret, config_overrides=overrides)
      return o
    o, vjp = jax.vjp(fwd, q, k, v, g, beta)
    return o, vjp(do)

  try:
    args = bench.make_inputs(jax.random.PRNGKey(0), b, t, h, d, jnp.bfloat16, lower_bound)
    do = jax.random.normal(jax.random.PRNGKey(1), args[2].shape, jnp.bfloat16)
    compiled = jax.jit(loss_grads).lower(*args, do).compile()
    row = {"compiled": _compiled_bytes(compiled), "in_flight": calls_in_flight(compiled, iters)}
    row["ms"] = bench.pipelined_ms(compiled, *args, do, iters=row["in_flight"], rounds=3,
                                   warmup=1)
    finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all())
                 for x in jax.tree.leaves(compiled(*args, do)))
    row["finite"] = finite
    return row
  except Exception as e:  # pylint: disable=broad-except
    text = f"{type(e).__name__}: {e}"
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
      return {"error": "out of memory: " + text.splitlines()[0][:200]}
    return {"error": text.splitlines()[0][:300]}


def _gib(x) -> str:
  return "n/a" if x is None else f"{x / _GIB:.2f}"


def main(argv):
  del argv
  f = flags.FLAGS
  unknown = set(f.policies) - set(POLICIES)
  if unknown:
    raise app.UsageError(f"--policies: unknown {sorted(unknown)}; known {sorted(POLICIES)}")
  b, h, d = f.batch, f.heads, f.head_dim
  backend = "interpret" if platform.interprets("kda") else "triton"
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; B{b} H{h} K=V={d} bf16; "
        f"residual budget {kernel_config.RESIDUAL_BUDGET_BYTES / _GIB:.0f} GiB", flush=True)
  rows = []
  for t in sorted(int(x) for x in f.lengths):
    segments, kept = default_choice(b, t, h, d, backend=backend)
    for policy in f.policies:
      row = measure(b, t, h, d, policy, iters=f.iters, lower_bound=f.lower_bound)
      rows.append((t, kept, segments, policy, row))
      print(f"T={t} {policy}: {row}", flush=True)
  table(rows, f.json)


def table(rows, json_path: str = "") -> None:
  """Prints the (T, residual bytes, segments, policy, measured row) rows; writes them to
  `json_path` as well when it is set."""
  print()
  tables = bench_json.Tables()
  tables.start("kda memory", ["T", "residuals GiB", "default segments", "policy", "fwd+bwd ms",
                              "calls in flight", "compiled GiB", "outputs finite"])
  for t, kept, segments, policy, row in rows:
    if "error" in row:
      tables.row([t, _gib(kept), segments, policy, row["error"], "", "", ""])
    else:
      tables.row([t, _gib(kept), segments, policy, f"{row['ms']:.2f}", row["in_flight"],
                  _gib(row["compiled"]), row["finite"]])
  if json_path:
    bench_json.write(json_path, tables.tables, peer_or_base=(
        "none: absolute times and bytes (the policies of one T side by side)"))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
