"""Residual ablation: pre-norm vs block attention residuals vs full attention residuals.

`arg` is `VARIANT[,SCALE]`; SCALE is `gpu_150m` (default) or `tiny` (CPU).
Variants: prenorm, block (block_attnres, 4 sublayers a block), full (full_attnres).

GPU command (see configs/gpu_150m.py for the wheel install line), one run per variant:

  PYTHONPATH=.:/tmp/site python3 experiments/train.py --config=configs/ablations/residual.py:block \
    --workdir=/tmp/runs/residual_block

The measured sweep (fixed small model, 3 seeds) is defined in `k3jax/ablations/sweeps.py` and run by
`experiments/run_ablations.py`; results in docs/results.md.
"""
from k3jax.train.config_files import sibling_config

VARIANTS = {
    "prenorm": dict(residual="prenorm"),
    "block": dict(residual="block_attnres", attnres_block_size=4),
    "full": dict(residual="full_attnres"),
}
SCALES = ("gpu_150m", "tiny")


def get_config(arg="prenorm"):
  """Returns the preset at SCALE with the residual strategy."""
  variant, _, scale = arg.partition(",")
  scale = scale or SCALES[0]
  if variant not in VARIANTS or scale not in SCALES:
    raise ValueError(f"residual ablation arg {arg!r}: variant must be one of {sorted(VARIANTS)}, "
                     f"scale one of {SCALES}")
  c = sibling_config(__file__, f"../{scale}.py")
  c.model.update(VARIANTS[variant])
  return c
