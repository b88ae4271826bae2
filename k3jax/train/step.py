"""Jitted train and eval steps over the functional (graphdef, state) form of an NNX model."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from k3jax.train.state import TrainState


def flatten_scalars(tree: Any, prefix: str = "") -> dict[str, jax.Array]:
  """Flattens nested dicts of stats into {"a/b/c": float32 scalar}, dropping non-scalar entries."""
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      out.update(flatten_scalars(v, f"{prefix}/{k}" if prefix else str(k)))
    return out
  if isinstance(tree, (jax.Array, float, int)) and jnp.ndim(tree) == 0:
    return {prefix: jnp.asarray(tree, jnp.float32)}
  return {}


def masked_cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns (sum of masked nats, sum of masked correct argmax, sum of mask), all float32 []."""
  logits_btv = logits_btv.astype(jnp.float32)
  nll_bt = optax.softmax_cross_entropy_with_integer_labels(logits_btv, targets_bt)
  correct_bt = (jnp.argmax(logits_btv, axis=-1) == targets_bt).astype(jnp.float32)
  return jnp.sum(nll_bt * mask_bt), jnp.sum(correct_bt * mask_bt), jnp.sum(mask_bt)


def model_inputs(batch: dict, max_segments: int | None) -> dict:
  """The keyword arguments the model takes from a batch besides its tokens: the rows' segment
  ids and their static bound when the run resets at document boundaries, else none."""
  if max_segments is None:
    return {}
  return {"segment_ids": batch["segment_ids"], "max_segments": max_segments}


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, *, max_segments: int | None = None
                    ) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """Builds `train_step(state, batch) -> (new_state, metrics)`, jitted with the state donated.

  The model computes in its configured dtype (bf16 on GPU presets) and returns
  float32 logits; the loss, gradients' norm and optimizer math are float32.
  `metrics["finite"]` is 1.0 only if both the loss and the gradient norm are finite.
  With `max_segments` the model sees `batch["segment_ids"]` (packed documents,
  each row at most that many runs of equal ids).
  """

  def loss_fn(params, model_state, batch):
    # copy=True gives fresh variables owned by this trace, so the forward may update router state.
    model = nnx.merge(graphdef, params, model_state, copy=True)
    logits_btv, aux = model(batch["inputs"], deterministic=False, **model_inputs(batch, max_segments))
    nll, correct, count = masked_cross_entropy(logits_btv, batch["targets"], batch["mask"])
    count = jnp.maximum(count, 1.0)
    ce = nll / count
    aux_loss = jnp.asarray(aux.get("aux_loss", 0.0), jnp.float32) if isinstance(aux, dict) else 0.0
    new_model_state = nnx.split(model, nnx.Param, ...)[2]
    return ce + aux_loss, (ce, aux_loss, correct / count, aux, new_model_state)

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, (ce, aux_loss, acc, aux, model_state)), grads = grad_fn(state.params, state.model_state, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.global_norm(grads)
    metrics = {
        "loss": loss, "ce_loss": ce, "aux_loss": aux_loss, "accuracy": acc,
        "grad_norm": grad_norm, "param_norm": optax.global_norm(params),
        "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
        "finite": (jnp.isfinite(loss) & jnp.isfinite(grad_norm)).astype(jnp.float32),
    }
    if isinstance(aux, dict):
      metrics.update({k: v for k, v in flatten_scalars(aux).items() if k != "aux_loss"})
    new_state = state.replace(step=state.step + 1, params=params, model_state=model_state,
                              opt_state=opt_state)
    return new_state, metrics

  return _layout_preserving_jit(train_step)


def _layout_preserving_jit(train_step):
  """jit of `train_step(state, batch)`, donating the state, whose new state keeps its shardings.

  Without pinned output shardings, the compiler may hand back parameters in a
  layout that an activation constraint inside the model propagated into them
  (e.g. attention heads split over the context axis), so the state would drift
  away from the rules' layout from one step to the next. The first call with a
  given layout compiles a version whose output state has exactly the input's.
  """
  unpinned = jax.jit(train_step, donate_argnums=(0,))
  by_layout = {}

  def step(state, batch):
    leaves, treedef = jax.tree.flatten(state)
    shardings = tuple(getattr(x, "sharding", None) for x in leaves)
    if any(s is None for s in shardings):  # host arrays: nothing to keep
      return unpinned(state, batch)
    key = (treedef, shardings)
    if key not in by_layout:
      by_layout[key] = jax.jit(train_step, donate_argnums=(0,),
                               out_shardings=(jax.tree.unflatten(treedef, shardings), None))
    return by_layout[key](state, batch)

  return step


def make_eval_step(graphdef: nnx.GraphDef, *, max_segments: int | None = None
                   ) -> Callable[[TrainState, dict], dict]:
  """Builds jitted `eval_step(state, batch) -> {"nll_sum", "correct_sum", "count"}` (deterministic mode).

  The state is not donated and not changed: routers run with frozen state.
  `max_segments` as in `make_train_step`.
  """

  def eval_step(state: TrainState, batch: dict) -> dict:
    model = nnx.merge(graphdef, state.params, state.model_state, copy=True)
    logits_btv, _ = model(batch["inputs"], deterministic=True, **model_inputs(batch, max_segments))
    nll, correct, count = masked_cross_entropy(logits_btv, batch["targets"], batch["mask"])
    return {"nll_sum": nll, "correct_sum": correct, "count": count}

  return jax.jit(eval_step)
