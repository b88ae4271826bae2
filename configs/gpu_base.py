"""What the GPU presets share (bf16 hybrid KDA/attention MoE on one H200); not a preset itself.

`gpu_150m.py` and `gpu_1b.py` load it with `sibling_config` and set their sizes,
steps and learning rates on top. It also trains alone (the default widths with
these settings), e.g. to try a change to the shared settings on the H200:

  python3 experiments/train.py --config=configs/gpu_base.py --workdir=/tmp/runs/gpu_base --config.num_steps=100
"""
from k3jax.train.defaults import base_config


def get_config():
  """The GPU presets' common settings: 2048-token rows, 3 KDA : 1 attention, the Pallas
  KDA kernels, top-2 quantile-routed experts,
  dropless, bf16 compute."""
  c = base_config()
  c.seq_len = 2048
  c.log_every = 25
  c.eval_every = 500
  c.eval_batches = 8
  c.checkpoint_every = 500
  c.keep_checkpoints = 2

  c.model.vocab_size = 256
  c.model.layer_pattern = "KKKA"
  c.model.head_dim = 128
  c.model.kda.chunk_size = 64
  c.model.kda.sub_chunk = 16
  c.model.kda.lower_bound = -5.0  # 5 * (16 - 1) = 75 < 85: the dense diagonal tiles are safe
  c.model.kda.implementation = "pallas"
  c.model.top_k = 2
  c.model.num_shared_experts = 1
  # Dropless: every routed token reaches its experts through our grouped matmuls
  # ("auto" picks them on NVIDIA GPUs). In training it ran 1.01x the capacity mode's
  # tokens/s at gpu_150m and 1.005x at gpu_1b, with nothing dropped
  # (docs/benchmarks.md, "Model and trainer"). `moe_impl="buffered"` with a capacity
  # factor > 0 gives the capacity mode back.
  c.model.moe_impl = "ragged"
  c.model.router.capacity_factor = 0.0
  c.model.router.name = "quantile"
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"

  c.data.kind = "bytes"
  c.data.max_bytes = 0  # the whole stdlib source tree (~30 MB)
  return c
