"""Long-context ablation: bounded vs softplus gate in the hybrid, and a pure-attention reference,
trained at 2048 tokens and evaluated far past it.

`arg` is `VARIANT[,SCALE]`; SCALE is `gpu_150m` (default, seq_len 2048) or `tiny` (CPU, seq_len 128).
Variants (otherwise identical models):

  bounded    KKKA hybrid, bounded gate lower_bound=-5, 16-row dense diagonal tiles (the default model)
  softplus   KKKA hybrid, -exp(A) * softplus(.) gate (lower_bound 0: none), pairwise diagonal tiles
  attention  every layer NoPE softmax attention (the reference expected to degrade past 2048)

GPU command (see configs/gpu_150m.py for the wheel install line), one run per variant and seed:

  PYTHONPATH=.:/tmp/site python3 experiments/train.py --config=configs/ablations/long_context.py:bounded \
    --workdir=/tmp/runs/long_bounded --config.seed=0

then evaluate at 2k, 8k, 32k and 128k tokens:

  PYTHONPATH=.:/tmp/site python3 experiments/long_context.py --setting=full \
    --runs=/tmp/runs/long_bounded,/tmp/runs/long_softplus,/tmp/runs/long_attention \
    --names=bounded,softplus,attention --summary=$OUT/long_150m.json

The preset's quantile router has a batch capacity, so a lone decoded token is routed differently
from the same token in a full forward: `--decode_prefill_x=64` would measure routing differences
as well. The sweep's dense-FFN models isolate the KDA state and the KV cache.

The smaller sweep of the same three arms (d=256, 4 layers, bytes and MQAR, 3 seeds) is
`long_sweep` in `k3jax/ablations/sweeps.py`, run by `experiments/long_context.py`.

CPU check:
`python experiments/train.py --config=configs/ablations/long_context.py:bounded,tiny --workdir=runs/long_bounded`.
"""
from k3jax.train.config_files import sibling_config

VARIANTS = {
    "bounded": dict(layer_pattern="KKKA", kda=dict(lower_bound=-5.0, sub_chunk=16, diagonal="dense")),
    "softplus": dict(layer_pattern="KKKA", kda=dict(lower_bound=0.0, sub_chunk=16, diagonal="pairwise")),
    "attention": dict(layer_pattern="A"),
}
SCALES = ("gpu_150m", "tiny")


def get_config(arg="bounded"):
  """Returns the preset at SCALE (seq_len 2048 at gpu_150m) with the variant's model fields."""
  variant, _, scale = arg.partition(",")
  scale = scale or SCALES[0]
  if variant not in VARIANTS or scale not in SCALES:
    raise ValueError(f"long-context ablation arg {arg!r}: variant must be one of {sorted(VARIANTS)}, "
                     f"scale one of {SCALES}")
  c = sibling_config(__file__, f"../{scale}.py")
  c.model.update(VARIANTS[variant])
  if scale == "gpu_150m":
    c.seq_len = 2048
  return c
