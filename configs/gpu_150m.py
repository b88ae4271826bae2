"""~157M-parameter (~80M active) hybrid KDA/attention MoE model, bf16, one H200.

Bytes of the Python standard library by default (no download); point it at your
own tokenized corpus with
`--config.data.kind=token_file --config.data.token_file=PATH --config.data.vocab_size=V --config.model.vocab_size=V`.

GPU command (repo root). On a machine with package access, fetch the wheels the GPU
image lacks (they land in `.whl/`, which travels with the working tree):

  ../shared/tools/gpu_wheels.sh tensorboardX==2.6.5

then on the H200:

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && PYTHONPATH=.:/tmp/site python3 experiments/train.py --config=configs/gpu_150m.py \
         --workdir=/tmp/runs/gpu_150m --config.num_steps=300

The KDA layers run the Pallas kernel (`--config.model.kda_implementation=xla` for
the pure-XLA path). tokens/s and MFU (H200 bf16 peak 989 TFLOP/s)
are in `<workdir>/metrics.jsonl`.
"""
from k3jax.train.defaults import base_config


def get_config():
  """The 150M GPU preset: 12 layers (3 KDA : 1 attention), d=768, 8 experts top-2 + 1 shared."""
  c = base_config()
  c.num_steps = 5000
  c.batch_size = 32
  c.seq_len = 2048  # 65,536 tokens per step
  c.log_every = 25
  c.eval_every = 500
  c.eval_batches = 8
  c.checkpoint_every = 500
  c.keep_checkpoints = 2

  c.model.vocab_size = 256
  c.model.d_model = 768
  c.model.num_layers = 12
  c.model.layer_pattern = "KKKA"
  c.model.num_heads = 6
  c.model.head_dim = 128
  c.model.num_kv_heads = 6
  c.model.kda_chunk_size = 64
  c.model.kda_sub_chunk = 16
  c.model.g_min = -5.0  # 5 * (16 - 1) = 75 < 85: the dense diagonal tiles are safe
  c.model.kda_implementation = "pallas"
  c.model.num_experts = 8
  c.model.top_k = 2
  c.model.expert_hidden = 512
  c.model.num_shared_experts = 1
  # Capacity mode: the quantile router keeps expert loads even, so capacity 1.25
  # dropped under 1% of any layer's assignments in a 60-step gpu_1b run, and the
  # [E, cap, d] buffers run at dense-matmul rate. Dropless ("ragged") is 1.6x
  # (tokamax) to 7.7x (XLA ragged_dot) slower at the gpu_1b layer shape
  # (docs/benchmarks.md, "MoE layer").
  c.model.moe_impl = "buffered"
  c.model.dense_hidden = 2048
  c.model.router.name = "quantile"
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"

  c.data.kind = "bytes"
  c.data.max_bytes = 0  # the whole stdlib source tree (~30 MB)

  c.optim.learning_rate = 1e-3
  c.optim.warmup_steps = 200
  c.optim.weight_decay = 0.1
  return c
