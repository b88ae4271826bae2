"""~1.09B-parameter (~350M active) hybrid KDA/attention MoE model, bf16, one H200.

Same data options and wheels as `gpu_150m.py`. GPU command (run from the repo root on the H200):

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && python3 -m pip install -q --no-index --find-links .whl/data grain array-record tokenizers \
    && PYTHONPATH=.:/tmp/site python3 experiments/train.py --config=configs/gpu_1b.py \
         --workdir=/tmp/runs/gpu_1b --config.num_steps=300 --config.optim.warmup_steps=100

The KDA layers run the Pallas kernel (`--config.model.kda.implementation=xla` for
the pure-XLA path). Memory: float32 weights, AdamW moments
and gradients take ~17 GB; activations at batch 16 x 2048 dominate the rest.
"""
from k3jax.train.config_files import sibling_config


def get_config():
  """The 1B GPU preset: 16 layers (3 KDA : 1 attention), d=1536, 16 experts top-2 + 1 shared."""
  c = sibling_config(__file__, "gpu_base.py")
  c.num_steps = 10000
  c.batch_size = 16  # 32,768 tokens per step

  c.model.d_model = 1536
  c.model.num_layers = 16
  c.model.num_heads = 12
  c.model.num_kv_heads = 4
  c.model.num_experts = 16
  c.model.expert_hidden = 768
  c.model.dense_hidden = 4096

  c.optim.learning_rate = 6e-4
  c.optim.warmup_steps = 500
  return c
