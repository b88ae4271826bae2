"""AdamW with linear warmup, cosine decay and global-norm clipping."""
from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from k3jax.sharding.rules import STAGE_NAME


def make_schedule(optim_cfg: Any, num_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `learning_rate`, then cosine decay to `end_lr_fraction * learning_rate`."""
  peak = optim_cfg.learning_rate
  warmup = min(optim_cfg.warmup_steps, num_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(num_steps, warmup + 1), end_value=peak * optim_cfg.end_lr_fraction)


def _is_matrix(p: Any) -> Any:
  if not isinstance(p, nnx.Variable):
    return p.ndim >= 2
  # A pipeline stacks each layer's variables over a leading "stage" dim, which is no matrix dim.
  stacked = tuple(p.get_metadata().get("out_sharding") or ())[:1] == (STAGE_NAME,)
  return p.replace(p.get_value().ndim - stacked >= 2)


def decay_mask(params: Any) -> Any:
  """Weight decay only on matrices (ndim >= 2, a pipeline's stage dim not counted): norms,
  biases, gates' scalars and queries are exempt."""
  return jax.tree.map(_is_matrix, params, is_leaf=lambda p: isinstance(p, nnx.Variable))


def make_optimizer(optim_cfg: Any, num_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Returns (clip -> AdamW transformation, learning-rate schedule) from `config.optim`."""
  schedule = make_schedule(optim_cfg, num_steps)
  tx = optax.chain(
      optax.clip_by_global_norm(optim_cfg.grad_clip),
      optax.adamw(schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps,
                  weight_decay=optim_cfg.weight_decay, mask=decay_mask),
  )
  return tx, schedule
