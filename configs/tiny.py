"""Tiny byte-level hybrid model on the Python standard library's sources; CPU, a few minutes.

The README's first command:

  python experiments/train.py --config=configs/tiny.py --workdir=runs/tiny

One document per source file, packed into rows, the KDA state reset at every
document start. Held-out bits/byte over held-out documents: 8.50 at step 0,
3.83 / 2.99 / 2.74 at steps 25 / 50 / 75 and 2.63 at step 100 (the README gives
the wall time on a 2-core CPU). The progress bar starts after the first step's compilation,
so its first estimate is the steady one. Running again
with `--config.num_steps=300` continues a finished run (the schedule is stretched).

Any field can be overridden, e.g. `--config.num_steps=50 --config.model.residual=block_attnres`.
"""
from k3jax.train.defaults import base_config


def get_config():
  """A ~1M-parameter KDA/attention MoE model trained on stdlib bytes."""
  c = base_config()
  # 100 steps of 2048 tokens: held-out bits/byte still falls steeply at the end (see the docstring).
  c.num_steps = 100
  c.batch_size = 16
  c.seq_len = 128
  c.log_every = 10
  c.eval_every = 25
  c.eval_batches = 4
  c.checkpoint_every = 50

  c.model.vocab_size = 256
  c.model.d_model = 128
  c.model.num_layers = 4
  c.model.layer_pattern = "KKKA"
  c.model.num_heads = 4
  c.model.head_dim = 32
  c.model.num_kv_heads = 4
  c.model.kda.chunk_size = 64
  c.model.kda.sub_chunk = 16
  c.model.num_experts = 4
  c.model.top_k = 2
  c.model.expert_hidden = 128
  c.model.num_shared_experts = 1
  c.model.dense_hidden = 256
  # On a CPU at this size the recurrent form is the fastest chunk_kda path (same math as the chunked
  # one): 1.3 s against 3.4 s of CPU time per step for "xla" (B16 T128). GPU presets use "pallas".
  c.model.kda.implementation = "naive"
  c.model.dtype = "float32"  # CPUs gain nothing from bf16

  c.data.kind = "bytes"
  c.data.paths = ()  # the stdlib source tree of the running Python
  c.data.max_bytes = 8_000_000  # reading all ~30 MB is not needed for a few hundred steps

  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 10
  return c
