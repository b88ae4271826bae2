"""What the GPU presets share (bf16 hybrid KDA/attention MoE on one H200); not a preset itself.

`gpu_150m.py` and `gpu_1b.py` load it with `sibling_config` and set their sizes,
steps and learning rates on top. It also trains alone (the default widths with
these settings), e.g. to try a change to the shared settings on the H200:

  python3 experiments/train.py --config=configs/gpu_base.py --workdir=/tmp/runs/gpu_base --config.num_steps=100
"""
from k3jax.train.defaults import base_config


def get_config():
  """The GPU presets' common settings: 2048-token rows, 3 KDA : 1 attention, the Pallas
  KDA kernels, top-2 quantile-routed experts in capacity mode, bf16 compute."""
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
  c.model.kda_chunk_size = 64
  c.model.kda_sub_chunk = 16
  c.model.g_min = -5.0  # 5 * (16 - 1) = 75 < 85: the dense diagonal tiles are safe
  c.model.kda_implementation = "pallas"
  c.model.top_k = 2
  c.model.num_shared_experts = 1
  # Capacity mode: the quantile router keeps expert loads even, so capacity 1.25
  # dropped under 1% of any layer's assignments in a 60-step gpu_1b run, and the
  # [E, cap, d] buffers run at dense-matmul rate. Dropless ("ragged") is 1.6x
  # (tokamax) to 7.7x (XLA ragged_dot) slower at the gpu_1b layer shape
  # (docs/benchmarks.md, "MoE layer").
  c.model.moe_impl = "buffered"
  c.model.router.name = "quantile"
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"

  c.data.kind = "bytes"
  c.data.max_bytes = 0  # the whole stdlib source tree (~30 MB)
  return c
