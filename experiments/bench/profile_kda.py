"""Runs the Pallas KDA forward+backward a few times: a target for profilers.

Nsight Compute replays the whole application once per pass in
`--replay-mode application`, so the target must start and compile fast; this
one builds one jitted VJP at the given shape and calls it `--calls` times.
On the GPU machine, from the repository root:

  ncu --replay-mode application -k regex:kda_intra_bwd_k --launch-count 1 \\
      --section LaunchStats --section Occupancy --section SpeedOfLight \\
      python experiments/bench/profile_kda.py --shape=16x2048x16x128

Registers and local-memory (spill) traffic of every kernel, in one pass per
metric set (the figures this gave: `git show b6f631a:docs/benchmarks.md`,
"Where the kernel time goes"):

  ncu --replay-mode application -k regex:kda_ --launch-count 8 --metrics \\
    gpu__time_duration.sum,launch__registers_per_thread,\\
l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum \\
    python experiments/bench/profile_kda.py --calls=0

(An XLA dump, `XLA_FLAGS=--xla_dump_to=...`, held no .ptx files for ptxas on
the H200 image with jax 0.11.2. `experiments/bench/inspect_triton.py` compiles the
kernels' Triton IR for sm_90a on a CPU machine instead, for registers, spills
and the SASS.)
"""
from __future__ import annotations

import os
import sys

from absl import app
from absl import flags

# Run from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_SHAPE = flags.DEFINE_string("shape", "16x2048x16x128", "BxTxHxD (K = V = D).")
_CALLS = flags.DEFINE_integer("calls", 2, "Forward+backward calls after the first (compiling) one.")
_DIAGONAL = flags.DEFINE_enum("diagonal", "dense", ["dense", "pairwise"], "Diagonal strategy.")
_OVERRIDES = flags.DEFINE_list("overrides", [], "KernelConfig fields, as bench_kernels.py "
                               "--overrides (e.g. intra_bwd=tiles,warps.intra_bwd_k=4).")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Emulate the kernels (CPU smoke run).")


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_kernels.kda import api  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tools import bench  # pylint: disable=g-import-not-at-top

  b, t, h, d = (int(x) for x in _SHAPE.value.split("x"))
  dtype = jnp.float32 if _INTERPRET.value else jnp.bfloat16
  q, k, v, g, beta = bench.make_inputs(jax.random.PRNGKey(0), b, t, h, d, dtype)
  overrides = bench.parse_overrides(_OVERRIDES.value) or None

  def loss(q, k, v, g, beta):
    o, _ = api.chunk_kda(q, k, v, g, beta, implementation="pallas", diagonal=_DIAGONAL.value,
                         lower_bound=-5.0, interpret=_INTERPRET.value,
                         config_overrides=overrides)
    return jnp.sum(o.astype(jnp.float32) ** 2)

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  for i in range(_CALLS.value + 1):
    grads = jax.block_until_ready(step(q, k, v, g, beta))
    print(f"call {i}: |dq| = {float(jnp.linalg.norm(grads[0].astype(jnp.float32))):.4e}",
          flush=True)


if __name__ == "__main__":
  app.run(main)
