"""Times the HybridLM forward (and forward+backward) for each KDA implementation.

  python experiments/bench/bench_model.py --preset=100m --batch=8 --seq_len=2048 \
      --implementations=xla,pallas
  python experiments/bench/bench_model.py ... --json=/tmp/model.json   # the rows as JSON too

Prints a table: for each implementation the median forward time, then the
median forward+backward time, with tokens/s and the achieved TFLOP/s (from
`flops_per_token`: forward = 1/3 of the training FLOPs). Rows measured in the
same run are comparable; the last column is the time ratio against the first
implementation of the same pass.
`--preset=tiny` runs on a CPU in seconds (a smoke test of the script).
"""
import os
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax.models import lm  # noqa: E402
from k3jax.models.config import ModelConfig  # noqa: E402
from pallas_kernels.tools import bench_json  # noqa: E402

PRESETS = {
    # ~99M parameters (~60M active): 12 layers 3 KDA : 1 attention, 8 experts top-2 + 1 shared.
    "100m": dict(vocab_size=256, d_model=768, num_layers=12, num_heads=6, head_dim=128,
                 num_kv_heads=6, num_experts=8, top_k=2, expert_hidden=256,
                 num_shared_experts=1, dense_hidden=2048, dtype="bfloat16"),
    "tiny": dict(vocab_size=256, d_model=64, num_layers=4, num_heads=2, head_dim=32,
                 num_kv_heads=2, num_experts=4, top_k=2, expert_hidden=64, dense_hidden=128,
                 kda=dict(chunk_size=16, sub_chunk=8)),
}

FLAGS = flags.FLAGS
flags.DEFINE_enum("preset", "100m", list(PRESETS), "Model size.")
flags.DEFINE_integer("batch", 8, "Sequences per step.")
flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence.")
flags.DEFINE_list("implementations", ["xla", "pallas"], "KDA implementations to compare.")
flags.DEFINE_string("residual", "prenorm", "Residual strategy.")
flags.DEFINE_string("dtype", None, "Override the preset's compute dtype.")
flags.DEFINE_integer("warmup", 2, "Untimed calls after compilation.")
flags.DEFINE_integer("iters", 10, "Timed calls (median reported).")
flags.DEFINE_bool("backward", True, "Also time forward+backward.")
flags.DEFINE_string("moe_impl", None, "MoE expert path: ragged | buffered | dense (default: MoE's).")
flags.DEFINE_string("json", "", "Also write the table's rows, the command line, device and "
                    "commit to this JSON file (see pallas_kernels/tools/bench_json.py).")


def _median_seconds(fn, *args):
  jax.block_until_ready(fn(*args))  # compile
  for _ in range(FLAGS.warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(FLAGS.iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _functions(cfg: ModelConfig):
  """(state, jitted forward, jitted forward+backward) of a fresh model."""
  model = lm.HybridLM(cfg, rngs=nnx.Rngs(0), moe_impl=FLAGS.moe_impl)
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens):
    return nnx.merge(graphdef, state)(tokens, deterministic=True)[0]

  @jax.jit
  def forward_backward(state, tokens):
    def loss(state):
      logits, aux = nnx.merge(graphdef, state)(tokens)
      nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
      return nll.mean() + aux["aux_loss"]
    return jax.grad(loss)(state)

  return state, forward, forward_backward


def main(argv):
  del argv
  overrides = dict(PRESETS[FLAGS.preset], residual=FLAGS.residual)
  if FLAGS.dtype:
    overrides["dtype"] = FLAGS.dtype
  base = ModelConfig.from_dict(overrides)
  b, t = FLAGS.batch, FLAGS.seq_len
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, base.vocab_size, (b, t)), jnp.int32)
  total, active = lm.param_count(base), lm.active_param_count(base)
  fpt = lm.flops_per_token(base, t)
  device = jax.devices()[0].device_kind
  print(f"# HybridLM preset={FLAGS.preset}: {total / 1e6:.1f}M params ({active / 1e6:.1f}M active), "
        f"{base.num_layers} layers '{base.layer_pattern}', d={base.d_model}, "
        f"residual={base.residual}, router={base.router.name}, moe_impl={FLAGS.moe_impl or 'default'}")
  print(f"# device: {device}; batch={b} seq_len={t} dtype={base.dtype}; "
        f"training FLOPs/token={fpt / 1e9:.3f} GFLOP; median of {FLAGS.iters}", flush=True)
  # Forward rows for every implementation first, then forward+backward rows,
  # so that a time-limited run still reports the forward comparison.
  passes = [("fwd", 1)] + ([("fwd+bwd", 3)] if FLAGS.backward else [])
  header = ("impl", "pass", "ms", "Mtok/s", "TFLOP/s", "ratio vs first")
  tables = bench_json.Tables()
  tables.start("model", header)
  cache = {}
  for name, flop_share in passes:
    first = None
    for impl in FLAGS.implementations:
      cfg = dataclasses.replace(base, kda=dataclasses.replace(base.kda, implementation=impl))
      try:
        if impl not in cache:
          cache[impl] = _functions(cfg)
        state, forward, forward_backward = cache[impl]
        seconds = _median_seconds(forward if name == "fwd" else forward_backward, state, tokens)
      except NotImplementedError as e:
        tables.row([impl, name, f"n/a ({e})", "", "", ""])
        continue
      first = first or seconds
      tflops = fpt / 3 * flop_share * b * t / seconds / 1e12
      tables.row([impl, name, f"{seconds * 1e3:.2f}", f"{b * t / seconds / 1e6:.3f}",
                  f"{tflops:.1f}", f"{seconds / first:.2f}"])
  if FLAGS.json:
    bench_json.write(FLAGS.json, tables.tables, peer_or_base=(
        "base: the first implementation of the same pass in the same call"))


if __name__ == "__main__":
  app.run(main)
