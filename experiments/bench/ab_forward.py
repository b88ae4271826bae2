"""A/B timing of whole Pallas KDA calls under several KernelConfig variants.

`bench_kernels.py --overrides` times one variant per process, and machines
drift by several percent between processes and minutes. Here the variants
share one process and one set of inputs, and their timings interleave:
every round times each variant once (forward, then forward+backward, both
timers of `bench`), and the table gives the median over rounds. The last
column is the largest difference of the forward output from the first
variant's, in units of its largest magnitude: a cheap guard that a variant
computes the same thing (correctness itself is the `gpu` tests' job).

On the GPU machine, from the repository root:

  python experiments/bench/ab_forward.py --shapes=16x2048x16x128,4x8192x16x128 \\
      --variants=",block_k=32"

A variant is "" (the defaults) or overrides joined by "+", e.g.
`block_k=32+warps.intra_fwd=8` (syntax of
`bench_kernels.py --overrides`).
"""
from __future__ import annotations

import os
import statistics
import sys

from absl import app
from absl import flags

# Run from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_SHAPES = flags.DEFINE_list("shapes", ["16x2048x16x128"], "BxTxHxD (K = V = D) shapes.")
_VARIANTS = flags.DEFINE_list("variants", ["", "block_k=32"],
                              "Override sets to compare (see the module docstring).")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds (median over them).")
_ITERS = flags.DEFINE_integer("iters", 10, "Calls per timing within a round.")
_DIAGONAL = flags.DEFINE_enum("diagonal", "dense", ["dense", "pairwise"], "Diagonal strategy.")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Emulate the kernels at a tiny shape (CPU "
                               "smoke run; the times mean nothing).")

_COLUMNS = ("fwd sync", "fwd pipelined", "fwd+bwd sync", "fwd+bwd pipelined")


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tools import bench  # pylint: disable=g-import-not-at-top
  from pallas_kernels.kda import pallas_op  # pylint: disable=g-import-not-at-top
  from pallas_kernels.kda.spec import KdaSpec  # pylint: disable=g-import-not-at-top

  variants = [(v or "defaults", bench.parse_overrides(v.split("+")) if v else {})
              for v in _VARIANTS.value]
  for shape in _SHAPES.value:
    b, t, h, d = (int(x) for x in shape.split("x"))
    if _INTERPRET.value:
      b, t, h, d = 1, 128, 1, 32
    # make_inputs' gates lie in [-5, 0], the bound of every call here.
    q, k, v, g, beta = bench.make_inputs(jax.random.PRNGKey(0), b, t, h, d, lower_bound=-5.0)
    spec = KdaSpec(diagonal=_DIAGONAL.value, lower_bound=-5.0, implementation="pallas")
    do = jax.random.normal(jax.random.PRNGKey(1), v.shape, v.dtype)

    def build(overrides):
      def fwd(q, k, v, g, beta):
        return pallas_op.chunk_kda_pallas(
            q, k, v, g, beta, spec=spec, scale=d ** -0.5,
            interpret=_INTERPRET.value, config_overrides=overrides)[0]

      def fwd_bwd(q, k, v, g, beta, do):
        o, vjp = jax.vjp(fwd, q, k, v, g, beta)
        return o, vjp(do)
      return jax.jit(fwd), jax.jit(fwd_bwd)

    fns = {name: build(ov) for name, ov in variants}
    outs = {name: fwd(q, k, v, g, beta) for name, (fwd, _) in fns.items()}
    first = outs[variants[0][0]].astype(jnp.float32)
    scale = float(jnp.max(jnp.abs(first)))
    diffs = {name: float(jnp.max(jnp.abs(o.astype(jnp.float32) - first))) / scale
             for name, o in outs.items()}
    times = {name: {col: [] for col in _COLUMNS} for name in fns}
    iters = 1 if _INTERPRET.value else _ITERS.value
    for _ in range(_ROUNDS.value):
      for name, (fwd, fwd_bwd) in fns.items():
        col = times[name]
        col["fwd sync"].append(bench.time_ms(fwd, q, k, v, g, beta, iters=iters, warmup=1))
        col["fwd pipelined"].append(bench.pipelined_ms(fwd, q, k, v, g, beta, iters=iters,
                                                       rounds=1, warmup=1))
        col["fwd+bwd sync"].append(bench.time_ms(fwd_bwd, q, k, v, g, beta, do, iters=iters,
                                                 warmup=1))
        col["fwd+bwd pipelined"].append(bench.pipelined_ms(fwd_bwd, q, k, v, g, beta, do,
                                                           iters=iters, rounds=1, warmup=1))
    print(f"\n{shape} ({jax.devices()[0].device_kind}, bf16, {_DIAGONAL.value}, "
          f"median of {_ROUNDS.value} interleaved rounds, ms; range in brackets)")
    print("| variant | " + " | ".join(_COLUMNS) + " | max |o - o_0| / max |o_0| |")
    print("|---" * (len(_COLUMNS) + 2) + "|")
    for name in fns:
      cells = [f"{statistics.median(x):.3f} ({min(x):.3f}-{max(x):.3f})"
               for x in times[name].values()]
      print(f"| {name} | " + " | ".join(cells) + f" | {diffs[name]:.1e} |", flush=True)


if __name__ == "__main__":
  app.run(main)
