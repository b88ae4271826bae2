"""Bytes of a pipeline (docs/sharding.md, "Pipeline parallelism"): what one stage sends the
next per microbatch, measured from the compiled forward's collective-permutes beside the
formula; and the parameters and optimizer state each device stores, per stage count.

    PYTHONPATH=. python experiments/bench/pipeline_bytes.py --stages=2,4
    PYTHONPATH=. python experiments/bench/pipeline_bytes.py --tables=state --stages=1,2,4 \
        --state_configs=configs/gpu_150m.py,configs/gpu_1b.py
    PYTHONPATH=. python experiments/bench/pipeline_bytes.py ... --json=/tmp/pipeline.json   # rows as JSON too

Compiles only (nothing runs), so a CPU host measures any size, on 8 CPU devices.
"""
from absl import app
from absl import flags
import jax

from k3jax.models.config import ModelConfig
from k3jax.parallel import pipeline_bytes
from k3jax.parallel.pipeline_layout import PipelineLayout
from k3jax.train.config_files import load_config_file
from k3jax.train.config_schema import model_config_from
from k3jax.train.optimizer import make_optimizer
from pallas_kernels.tools import bench_json

FLAGS = flags.FLAGS
flags.DEFINE_list("tables", ["boundary"], "tables to print: boundary (bytes crossing a stage "
                  "boundary), state (parameter and optimizer bytes per device)")
flags.DEFINE_list("state_configs", ["configs/gpu_150m.py", "configs/gpu_1b.py"],
                  "trainer configs of the state table (first_layer_dense off, so that every "
                  "stage holds the same layer kinds)")
flags.DEFINE_list("stages", ["2", "4"], "stage counts")
flags.DEFINE_integer("num_layers", 8, "layers")
flags.DEFINE_string("layer_pattern", "KA", "mixer kinds, repeated")
flags.DEFINE_integer("d_model", 1024, "model width")
flags.DEFINE_integer("seq_len", 2048, "tokens per sequence")
flags.DEFINE_integer("microbatch", 1, "sequences per microbatch")
flags.DEFINE_integer("microbatches", 4, "microbatches")
flags.DEFINE_integer("block_size", 4, "attnres_block_size of block AttnRes")
flags.DEFINE_integer("wide_block_size", 8, "a second block size, which some stage counts cut "
                     "(refused, with the counts that would align)")
# float32: XLA's CPU compiler widens a bfloat16 collective-permute to float32, so on a CPU
# host the compiled program would show twice the bytes of the bfloat16 program it lowers.
flags.DEFINE_string("dtype", "float32", "compute dtype")
flags.DEFINE_string("json", "", "also write the tables' rows, the command line, device and commit "
                    "to this JSON file (see pallas_kernels/tools/bench_json.py)")

# The printed tables ("state", "boundary"), kept for --json.
_TABLES = bench_json.Tables()


def _config(residual: str, block: int) -> ModelConfig:
  return ModelConfig(vocab_size=256, d_model=FLAGS.d_model, num_layers=FLAGS.num_layers,
                     layer_pattern=FLAGS.layer_pattern, num_heads=8,
                     head_dim=FLAGS.d_model // 8, num_kv_heads=8, num_experts=0,
                     dense_hidden=2 * FLAGS.d_model, first_layer_dense=False,
                     residual=residual, attnres_block_size=block, dtype=FLAGS.dtype)


def state_table(stage_counts: list[int]) -> None:
  """Parameter + AdamW state bytes one device stores, per config and stage count."""
  _TABLES.start("state", ["config", "model", "S", "layers GiB / device", "rest MiB / device",
                          "total GiB / device", "vs S = 1"])
  for path in FLAGS.state_configs:
    config = load_config_file(path)
    config.model.first_layer_dense = False
    model_cfg = model_config_from(config.model)
    tx, _ = make_optimizer(config.optim, config.num_steps)
    base = None
    for stages in stage_counts:
      try:
        PipelineLayout(stages=stages, microbatches=1).check_model(model_cfg)
      except ValueError as e:
        _TABLES.row([path, "", stages, "refused", "", "", str(e).split(";")[0]])
        continue
      got = pipeline_bytes.state_bytes_per_device(model_cfg, stages, tx)
      base = base or (got["total"] if stages == 1 else None)
      ratio = f"{got['total'] / base:.2f}x" if base else ""
      _TABLES.row([path, f"{model_cfg.num_layers} layers, d {model_cfg.d_model}", stages,
                   f"{got['layers'] / 2**30:.2f}", f"{got['other'] / 2**20:.1f}",
                   f"{got['total'] / 2**30:.2f}", ratio])


def main(argv):
  del argv
  stage_counts = [int(s) for s in FLAGS.stages]
  if "state" in FLAGS.tables:
    state_table(stage_counts)
  if "boundary" in FLAGS.tables:
    boundary_table(stage_counts)
  if FLAGS.json:
    bench_json.write(FLAGS.json, _TABLES.tables, peer_or_base=(
        "state: S = 1 (one device holds every layer); boundary: the formula's prediction "
        "beside the compiled program's bytes"))


def boundary_table(stage_counts: list[int]) -> None:
  """Bytes one stage sends the next per microbatch, predicted and measured, per residual."""
  mb_tokens = FLAGS.microbatch * FLAGS.seq_len
  tensor = mb_tokens * FLAGS.d_model * (2 if FLAGS.dtype == "bfloat16" else 4)
  print(f"microbatch {FLAGS.microbatch} x {FLAGS.seq_len} tokens, d_model {FLAGS.d_model}, "
        f"{FLAGS.dtype}: one [mb, T, D] tensor = {tensor / 2**20:.1f} MiB; "
        f"{FLAGS.num_layers} layers ({2 * FLAGS.num_layers} sublayers)")
  _TABLES.start("boundary", ["residual", "S", "tensors", "predicted MiB", "measured MiB"])
  cases = [("prenorm", FLAGS.block_size), ("block_attnres", FLAGS.block_size),
           ("block_attnres", FLAGS.wide_block_size), ("full_attnres", 1)]
  for residual, block in cases:
    for stages in stage_counts:
      layout = PipelineLayout(stages=stages, microbatches=FLAGS.microbatches)
      cfg = _config(residual, block)
      try:
        measured = pipeline_bytes.measured_boundary_bytes(
            cfg, layout, batch=FLAGS.microbatch * FLAGS.microbatches, seq_len=FLAGS.seq_len)
      except ValueError as e:  # a misaligned layout: the error says what would align
        _TABLES.row([f"{residual} (block {block})", stages, "refused", "", e])
        continue
      predicted = pipeline_bytes.predicted_boundary_bytes(cfg, layout, mb_tokens)
      name = f"{residual} (block {block})" if residual == "block_attnres" else residual
      _TABLES.row([name, stages, layout.boundary_slots(cfg), f"{predicted / 2**20:.1f}",
                   f"{measured / 2**20:.1f}"])


if __name__ == "__main__":
  # The CPU platform's devices (no effect on an accelerator's); before any backend starts.
  jax.config.update("jax_num_cpu_devices", 8)
  app.run(main)
