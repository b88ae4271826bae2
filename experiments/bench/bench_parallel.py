"""Train-step throughput with expert, context and pipeline parallelism vs one device.

    PYTHONPATH=. python experiments/bench/bench_parallel.py                 # all visible devices
    PYTHONPATH=. python experiments/bench/bench_parallel.py --meshes=1,1,1:2,1,1:1,2,1:1,1,2 \
        --kda_implementation=pallas,xla                               # one table per implementation
    PYTHONPATH=. python experiments/bench/bench_parallel.py --meshes=2,1,1:1,1,1,2 \
        --microbatches=8 --first_layer_dense=false      # two pipeline stages against data 2
    PYTHONPATH=. python experiments/bench/bench_parallel.py ... --json=/tmp/parallel.json   # rows as JSON too

Every mesh (data, expert, context[, stage]) runs the same per-device work:
each device holds `--batch_per_device` sequences of `--seq_per_device`
tokens, so the global batch is batch_per_device * data * expert * stage
sequences of seq_per_device * context tokens (a pipeline's stages each run
their share of the layers on the whole batch, in `--microbatches`
microbatches). A perfect scaling keeps the step time of the one-device run,
i.e. tokens/s grows with the device count; a pipeline's best is 1 minus its
bubble, (S - 1) / (M + S - 1), printed beside it.

The table lists, per mesh: median step time, tokens/s, the scaling
efficiency against the first mesh (tokens/s per device / the first mesh's),
and the median time of the forward-only program (the rest of the step is
backward + optimizer + gradient reduction). `--profile_dir` writes a
`jax.profiler` trace of a few steps per mesh for a breakdown by op
(collectives vs compute).
"""
import statistics
import sys
import time
import traceback

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from k3jax.layers.moe_path import ExpertParallel
from k3jax.models.config import ModelConfig
from k3jax.parallel.model_layout import ModelLayout
from k3jax.parallel.pipeline_layout import PipelineLayout
from k3jax.sharding.mesh import MeshConfig, make_mesh
from k3jax.train import sharded_state
from k3jax.train.step import make_train_step
from pallas_kernels.tools import bench_json

FLAGS = flags.FLAGS
flags.DEFINE_string("meshes", "1,1,1:1,2,1:1,1,2:2,1,1",
                    "colon-separated data,expert,context[,stage] sizes; the first is the baseline")
flags.DEFINE_integer("microbatches", 8, "pipeline microbatches of the meshes with stages")
flags.DEFINE_bool("first_layer_dense", True, "a dense FFN in layer 0 (a pipeline needs False: "
                  "every stage holds the same layer kinds)")
flags.DEFINE_integer("batch_per_device", 4, "sequences per device")
flags.DEFINE_integer("seq_per_device", 4096, "tokens per sequence per device (x context)")
flags.DEFINE_integer("d_model", 1024, "model width")
flags.DEFINE_integer("num_layers", 4, "decoder layers")
flags.DEFINE_string("layer_pattern", "KKKA", "mixer pattern")
flags.DEFINE_integer("num_heads", 8, "heads")
flags.DEFINE_integer("head_dim", 128, "head width (KDA K = V)")
flags.DEFINE_integer("num_experts", 16, "routed experts per MoE layer")
flags.DEFINE_integer("top_k", 2, "experts per token")
flags.DEFINE_integer("expert_hidden", 1024, "expert SwiGLU width")
flags.DEFINE_integer("vocab_size", 32768, "vocabulary")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "compute dtype")
flags.DEFINE_list("kda_implementation", ["xla"],
                  "chunk_kda implementations, comma-separated (xla, pallas): one table each")
flags.DEFINE_enum("moe_impl", "ragged", ["ragged", "buffered"],
                  "one-device MoE expert path (expert-parallel meshes dispatch with all_to_all "
                  "and run grouped matmuls locally either way)")
flags.DEFINE_float("dispatch_slot_factor", 2.0,
                   "expert-parallel send slots per device pair relative to an even split "
                   "(<= 0: lossless worst-case buffers)")
flags.DEFINE_integer("warmup", 2, "untimed steps after compilation")
flags.DEFINE_integer("steps", 10, "timed steps (median reported)")
flags.DEFINE_string("profile_dir", "", "write a jax.profiler trace per mesh here")
flags.DEFINE_string("json", "", "also write the tables' rows, the command line, device and commit "
                    "to this JSON file (see pallas_kernels/tools/bench_json.py)")


KDA_IMPLEMENTATIONS = ("xla", "pallas")


def _config(kda_implementation: str) -> ModelConfig:
  return ModelConfig.from_dict(dict(
      vocab_size=FLAGS.vocab_size, d_model=FLAGS.d_model, num_layers=FLAGS.num_layers,
      layer_pattern=FLAGS.layer_pattern, num_heads=FLAGS.num_heads, head_dim=FLAGS.head_dim,
      num_kv_heads=FLAGS.num_heads, num_experts=FLAGS.num_experts, top_k=FLAGS.top_k,
      expert_hidden=FLAGS.expert_hidden, dense_hidden=4 * FLAGS.d_model,
      first_layer_dense=FLAGS.first_layer_dense, kda=dict(implementation=kda_implementation),
      dtype=FLAGS.dtype))


def _median_time(fn, steps):
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _run(mesh_shape, config):
  data, expert, context, stage = mesh_shape
  n = data * expert * context * stage
  if n > jax.device_count():
    raise ValueError(f"mesh {mesh_shape} needs {n} devices, {jax.device_count()} visible")
  mesh = make_mesh(MeshConfig(data=data, expert=expert, context=context, stage=stage),
                   devices=jax.devices()[:n])
  b = FLAGS.batch_per_device * data * expert * stage
  t = FLAGS.seq_per_device * context
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.vocab_size, (b, t), dtype=np.int32)
  batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1),
           "mask": np.ones((b, t), np.float32)}
  tx = optax.adamw(1e-4)
  slots = FLAGS.dispatch_slot_factor if FLAGS.dispatch_slot_factor > 0 else None
  ep = ExpertParallel(dispatch_slot_factor=slots) if expert > 1 else None

  sizes = {"stage": stage, "data": data, "fsdp": 1, "expert": expert, "context": context}
  layout = ModelLayout.for_mesh(sizes, config.kda.implementation, FLAGS.microbatches)
  model_fn = lambda rngs: layout.build_lm(config, rngs=rngs, moe_impl=FLAGS.moe_impl,
                                         expert_parallel=ep)

  graphdef, state = sharded_state.create_sharded_train_state(model_fn, tx, 0, mesh)
  step = make_train_step(graphdef, tx, optax.constant_schedule(1e-4))

  @jax.jit
  def forward(state, batch):
    model = nnx.merge(graphdef, state.params, state.model_state, copy=True)
    logits, _ = model(batch["inputs"], deterministic=True)
    return jnp.mean(logits)

  with jax.set_mesh(mesh):
    batch = sharded_state.shard_batch(batch, mesh)
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    for _ in range(FLAGS.warmup):
      state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    holder = {"state": state}

    def one_step():
      holder["state"], m = step(holder["state"], batch)
      return m["loss"]

    step_s = _median_time(one_step, FLAGS.steps)
    jax.block_until_ready(forward(holder["state"], batch))
    fwd_s = _median_time(lambda: forward(holder["state"], batch), FLAGS.steps)
    if FLAGS.profile_dir:
      with jax.profiler.trace(f"{FLAGS.profile_dir}/mesh_{data}x{expert}x{context}x{stage}"):
        for _ in range(3):
          jax.block_until_ready(one_step())
    loss = float(jax.device_get(one_step()))
  return dict(n=n, b=b, t=t, step_s=step_s, fwd_s=fwd_s, compile_s=compile_s,
              tok_s=b * t / step_s, loss=loss)


def main(argv):
  del argv
  impls = list(FLAGS.kda_implementation)
  for impl in impls:
    if impl not in KDA_IMPLEMENTATIONS:
      raise ValueError(f"--kda_implementation entry {impl!r}; allowed: {KDA_IMPLEMENTATIONS}")
  meshes = [tuple(int(x) for x in m.split(",")) for m in FLAGS.meshes.split(":")]
  for m in meshes:
    if len(m) not in (3, 4):
      raise ValueError(f"--meshes entries are data,expert,context[,stage] sizes, got {m}")
  meshes = [m if len(m) == 4 else (*m, 1) for m in meshes]
  tables = bench_json.Tables()  # one table per implementation
  for impl in impls:
    config = _config(impl)
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; model d={config.d_model} "
          f"L={config.num_layers} {config.layer_pattern} H={config.num_heads} hd={config.head_dim} "
          f"E={config.num_experts} k={config.top_k} eh={config.expert_hidden} {config.dtype}; "
          f"kda={config.kda.implementation}; moe={FLAGS.moe_impl}; per device {FLAGS.batch_per_device} x "
          f"{FLAGS.seq_per_device} tokens; dispatch_slot_factor={FLAGS.dispatch_slot_factor}")
    header = ("mesh d,e,c,s", "devs", "global BxT", "step ms", "fwd ms", "tokens/s",
              "eff vs base", "bubble", "loss", "compile s")
    tables.start(f"kda={impl}", header)
    base = None
    for m in meshes:
      try:
        r = _run(m, config)
      except Exception as e:  # pylint: disable=broad-except
        # One failing mesh (memory, a compiler error) must not lose the others' rows.
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        traceback.print_exc(file=sys.stderr)  # the whole message, for a log file
        tables.row([",".join(map(str, m)), "failed", f"{type(e).__name__}: {first_line[:300]}"])
        continue
      per_dev = r["tok_s"] / r["n"]
      base = per_dev if base is None else base
      bubble = PipelineLayout(stages=m[3], microbatches=FLAGS.microbatches).bubble_fraction()
      tables.row([",".join(map(str, m)), r["n"], f"{r['b']}x{r['t']}",
                  f"{1e3 * r['step_s']:.1f}", f"{1e3 * r['fwd_s']:.1f}", f"{r['tok_s']:.0f}",
                  f"{per_dev / base:.3f}", f"{bubble:.2f}" if m[3] > 1 else "-",
                  f"{r['loss']:.4f}", f"{r['compile_s']:.1f}"])
    print(flush=True)
  if FLAGS.json:
    bench_json.write(FLAGS.json, tables.tables, peer_or_base=(
        "base: the first mesh of each table in the same call (eff vs base: tokens/s per device "
        "over its)"))


if __name__ == "__main__":
  app.run(main)
