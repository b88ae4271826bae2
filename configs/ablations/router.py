"""Router ablation: same-batch quantile vs lagged quantile vs bias-sign vs auxiliary loss (plus references).

`arg` is `VARIANT[,SCALE]`; SCALE is `gpu_150m` (default) or `tiny` (CPU).
Variants: quantile, quantile_lagged, bias_sign, aux_loss, expert_choice, topk.
Per-layer MaxVio and drop fraction land in `metrics.jsonl` as `router/<layer>/max_vio` etc.

GPU command (see configs/gpu_150m.py for the wheel install line), one run per variant:

  PYTHONPATH=.:/tmp/site python3 experiments/train.py --config=configs/ablations/router.py:quantile_lagged \
    --workdir=/tmp/runs/router_quantile_lagged

The measured sweep (fixed small model, 3 seeds) is defined in `k3jax/ablations/sweeps.py` and run by
`experiments/run_ablations.py`; results in docs/results.md.
"""
from k3jax.train.config_files import sibling_config

VARIANTS = {
    "quantile": dict(name="quantile"),
    "quantile_lagged": dict(name="quantile_lagged"),
    "bias_sign": dict(name="bias_sign", bias_update_rate=1e-3),
    "aux_loss": dict(name="aux_loss", aux_loss_coef=1e-2),
    "expert_choice": dict(name="expert_choice"),
    "topk": dict(name="topk"),
}
SCALES = ("gpu_150m", "tiny")


def get_config(arg="quantile"):
  """Returns the preset at SCALE with the router variant."""
  variant, _, scale = arg.partition(",")
  scale = scale or SCALES[0]
  if variant not in VARIANTS or scale not in SCALES:
    raise ValueError(f"router ablation arg {arg!r}: variant must be one of {sorted(VARIANTS)}, "
                     f"scale one of {SCALES}")
  c = sibling_config(__file__, f"../{scale}.py")
  # Every router in capacity mode (expert choice has no other), so the arms differ in
  # the router alone and report their drops.
  c.model.moe_impl = "buffered"
  c.model.router.capacity_factor = 1.25
  c.model.router.update(VARIANTS[variant])
  return c
