"""~157M-parameter (~80M active) hybrid KDA/attention MoE model, bf16, one H200.

The bytes of the Python standard library's sources by default (no download), packed as
documents; train on your own text prepared by `experiments/prepare_data.py` with
`--config.data.kind=prepared --config.data.path=DIR --config.model.vocab_size=V` (V at least
the tokenizer's vocabulary).

GPU command (repo root). On a machine with package access, fetch the wheels the GPU
image lacks (they land in `.whl/` and `.whl/data/`, which travel with the working tree):

  ../shared/tools/gpu_wheels.sh && ../shared/tools/gpu_wheels.sh --data

then on the H200:

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && python3 -m pip install -q --no-index --find-links .whl/data grain array-record tokenizers \
    && PYTHONPATH=.:/tmp/site python3 experiments/train.py --config=configs/gpu_150m.py \
         --workdir=/tmp/runs/gpu_150m --config.num_steps=300

The KDA layers run the Pallas kernel (`--config.model.kda.implementation=xla` for
the pure-XLA path). tokens/s and MFU (H200 bf16 peak 989 TFLOP/s)
are in `<workdir>/metrics.jsonl`.
"""
from k3jax.train.config_files import sibling_config


def get_config():
  """The 150M GPU preset: 12 layers (3 KDA : 1 attention), d=768, 8 experts top-2 + 1 shared."""
  c = sibling_config(__file__, "gpu_base.py")
  c.num_steps = 5000
  c.batch_size = 32  # 65,536 tokens per step

  c.model.d_model = 768
  c.model.num_layers = 12
  c.model.num_heads = 6
  c.model.num_kv_heads = 6
  c.model.num_experts = 8
  c.model.expert_hidden = 512
  c.model.dense_hidden = 2048

  c.optim.learning_rate = 1e-3
  c.optim.warmup_steps = 200
  c.optim.weight_decay = 0.1
  return c
