"""Times the fused gate activation against the unfused gate, on the op and on the KDA layer.

Per BxTxHxD shape (K = V = D), forward+backward median times (ms, sync
timing) of:

* op: `chunk_kda` fed a bf16 gate pre-activation z and a bias [H, K], with
  the gate g = g_min sigmoid(z + b) formed in jnp (unfused: g is written as
  [B, T, H, K] f32 and read back by the gate cumsum) or inside the gate
  cumsum kernels (fused, `gate_activation="bounded_sigmoid"`); gradients of
  q, k, v, z, b, beta.
* layer: the `KDA` layer (d_model = H * D, bf16 compute) with fuse_gate off
  and on; gradients of every parameter.

  python experiments/bench/bench_gate_fusion.py
  python experiments/bench/bench_gate_fusion.py --shapes=16x2048x16x128 --iters=50
  python experiments/bench/bench_gate_fusion.py ... --json=/tmp/gate_fusion.json   # rows as JSON too
"""
from __future__ import annotations

import os
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _define_flags():
  """The command line. Defined only when this file runs as a script, so that
  tests (and other benchmarks) can import its functions in one process."""
  flags.DEFINE_list("shapes", ["16x2048x16x128", "1x8192x16x128", "4x8192x16x128",
      "1x32768x16x128"], "BxTxHxD shapes (K = V = D).")
  flags.DEFINE_list("parts", ["op", "layer"], "What to time: op, layer.")
  flags.DEFINE_integer("iters", 20, "Timed calls per measurement (median).")
  flags.DEFINE_float("lower_bound", -5.0, "Gate lower bound g_min.")
  flags.DEFINE_enum("implementation", "pallas", ["pallas", "xla"], "chunk_kda path "
      "(xla: a CPU smoke run; the fused gate is then jnp as well).")
  flags.DEFINE_string("json", "", "Also write the table's rows, the command line, device and "
                      "commit to this JSON file (see pallas_kernels/tools/bench_json.py).")


FLAGS = flags.FLAGS


def _parse(shape):
  b, t, h, d = (int(x) for x in shape.split("x"))
  return b, t, h, d


def op_fns(implementation: str, lower_bound: float, interpret: bool = False):
  """Jitted forward+backward of chunk_kda with the gate unfused and fused, keyed by name.

  Each takes (q, k, v, z, bias, beta, do) and returns (o, grads of q, k, v, z, bias, beta).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from pallas_kernels.kda import api  # pylint: disable=g-import-not-at-top
  from pallas_kernels.kda import kernel_gate_cumsum  # pylint: disable=g-import-not-at-top
  kw = dict(implementation=implementation, lower_bound=lower_bound, interpret=interpret)

  def unfused(q, k, v, z, bias, beta):
    g = kernel_gate_cumsum.bounded_sigmoid(z, bias, lower_bound)
    return api.chunk_kda(q, k, v, g, beta, **kw)[0]

  def fused(q, k, v, z, bias, beta):
    return api.chunk_kda(q, k, v, z, beta, gate_activation="bounded_sigmoid", gate_bias=bias,
                         **kw)[0]

  def fwd_bwd(fn):
    def run(q, k, v, z, bias, beta, do):
      o, vjp = jax.vjp(fn, q, k, v, z, bias, beta)
      return o, vjp(do)
    return jax.jit(run)

  return {"unfused": fwd_bwd(unfused), "fused": fwd_bwd(fused)}


def op_inputs(b, t, h, d, lower_bound):
  """bf16 q, k, v, z, beta, do and an f32 bias [H, D] (z + bias ~ N(0, 2))."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tools import bench  # pylint: disable=g-import-not-at-top
  q, k, v, _, beta = bench.make_inputs(jax.random.PRNGKey(0), b, t, h, d,
                                       lower_bound=lower_bound)
  kz, kb, ko = jax.random.split(jax.random.PRNGKey(1), 3)
  z = jax.random.normal(kz, (b, t, h, d)).astype(jnp.bfloat16)
  bias = jax.random.normal(kb, (h, d))
  do = jax.random.normal(ko, (b, t, h, d)).astype(jnp.bfloat16)
  return q, k, v, z, bias, beta, do


def layer_fns(b, t, h, d, implementation: str, lower_bound: float):
  """Jitted forward+backward of the bf16 KDA layer with fuse_gate off / on, and its input.

  Returns ({"unfused": fn, "fused": fn}, args); fn(*args) -> (loss, param grads).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from k3jax.layers.kda import KDA  # pylint: disable=g-import-not-at-top
  from pallas_kernels.kda.spec import KdaSpec  # pylint: disable=g-import-not-at-top
  x = jax.random.normal(jax.random.PRNGKey(2), (b, t, h * d)).astype(jnp.bfloat16)
  fns, state = {}, None
  for name, fuse in (("unfused", False), ("fused", True)):
    layer = KDA(h * d, h, d, spec=KdaSpec(lower_bound=lower_bound, implementation=implementation),
                fuse_gate=fuse,
                dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graph, state = nnx.split(layer)

    def loss(st, x, graph=graph):
      y, _ = nnx.merge(graph, st)(x)
      return jnp.mean(jnp.square(y.astype(jnp.float32)))

    fns[name] = jax.jit(jax.value_and_grad(loss))
  return fns, (state, x)


def main(argv):
  del argv
  from pallas_kernels.tools import bench  # pylint: disable=g-import-not-at-top
  lb = FLAGS.lower_bound
  rows = []
  for shape in FLAGS.shapes:
    b, t, h, d = _parse(shape)
    for part in FLAGS.parts:
      if part == "op":
        fns, args = op_fns(FLAGS.implementation, lb), op_inputs(b, t, h, d, lb)
      elif part == "layer":
        fns, args = layer_fns(b, t, h, d, FLAGS.implementation, lb)
      else:
        raise app.UsageError(f"--parts takes op and layer, got {part!r}")
      ms = {name: bench.time_ms(fn, *args, iters=FLAGS.iters) for name, fn in fns.items()}
      rows.append((shape, part, ms["unfused"], ms["fused"]))
      print(f"{shape:18s} {part:6s} unfused {ms['unfused']:9.3f} ms  fused {ms['fused']:9.3f} ms",
            flush=True)
  summary_table(rows)


def summary_table(rows) -> None:
  """Prints the (shape, part, unfused ms, fused ms) rows as a markdown table; --json writes it."""
  from pallas_kernels.tools import bench_json  # pylint: disable=g-import-not-at-top
  print(f"\nforward+backward, ms (median of {FLAGS.iters} calls)\n")
  tables = bench_json.Tables()
  tables.start("gate fusion", ["shape", "part", "unfused ms", "fused ms", "saved ms", "saved %"])
  for shape, part, unfused, fused in rows:
    tables.row([shape, part, f"{unfused:.3f}", f"{fused:.3f}", f"{unfused - fused:.3f}",
                f"{100 * (unfused - fused) / unfused:.1f}"])
  if FLAGS.json:
    bench_json.write(FLAGS.json, tables.tables,
                     peer_or_base="base: the unfused gate of the same shape and part in the same call")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
