"""Decay-gate ablation: the bounded gate at several (lower_bound, diagonal tile) pairs vs the softplus baseline.

`arg` is `VARIANT[,SCALE]`; SCALE is `gpu_150m` (default) or `tiny` (CPU).
Variants (safe pairs keep |lower_bound| * (tile - 1) < ~85):

  softplus          -exp(A) * softplus(.) gate (lower_bound 0: none), pairwise diagonal tiles (the unbounded baseline)
  bounded_pairwise  lower_bound=-5, tile 16, pairwise diagonal (separates the gate from the kernel path)
  g5_t16            lower_bound=-5,   tile 16, dense diagonal (default model)
  g10_t8            lower_bound=-10,  tile 8,  dense diagonal
  g2.5_t32          lower_bound=-2.5, tile 32, dense diagonal
  g1.3_t64          lower_bound=-1.3, tile 64, dense diagonal (one tile per 64-row chunk)

GPU command (see configs/gpu_150m.py for the wheel install line), one run per variant:

  PYTHONPATH=.:/tmp/site python3 experiments/train.py --config=configs/ablations/decay.py:g5_t16 \
    --workdir=/tmp/runs/decay_g5_t16

The measured sweep (these arms on MQAR and byte text, 3 seeds, 4x/16x length evaluation) is defined in
`k3jax/ablations/sweeps.py` and run by `experiments/run_ablations.py`; results in docs/results.md.

CPU check:
`python experiments/train.py --config=configs/ablations/decay.py:softplus,tiny --workdir=runs/decay_softplus`.
"""
from k3jax.train.config_files import sibling_config

# Each variant's `model.kda` fields; lower_bound 0 is no bound (the softplus gate).
VARIANTS = {
    "softplus": dict(lower_bound=0.0, sub_chunk=16, diagonal="pairwise"),
    "bounded_pairwise": dict(lower_bound=-5.0, sub_chunk=16, diagonal="pairwise"),
    "g5_t16": dict(lower_bound=-5.0, sub_chunk=16, diagonal="dense"),
    "g10_t8": dict(lower_bound=-10.0, sub_chunk=8, diagonal="dense"),
    "g2.5_t32": dict(lower_bound=-2.5, sub_chunk=32, diagonal="dense"),
    "g1.3_t64": dict(lower_bound=-1.3, sub_chunk=64, diagonal="dense"),
}
SCALES = ("gpu_150m", "tiny")


def get_config(arg="g5_t16"):
  """Returns the preset at SCALE with the decay variant's `model.kda` fields."""
  variant, _, scale = arg.partition(",")
  scale = scale or SCALES[0]
  if variant not in VARIANTS or scale not in SCALES:
    raise ValueError(f"decay ablation arg {arg!r}: variant must be one of {sorted(VARIANTS)}, "
                     f"scale one of {SCALES}")
  c = sibling_config(__file__, f"../{scale}.py")
  c.model.kda.update(VARIANTS[variant])
  return c
