"""The train state: one pytree holding everything a checkpoint must restore."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax import struct


@struct.dataclass
class TrainState:
  """Everything that changes during training.

  Attributes:
    step: int32 [] number of optimizer updates applied.
    params: nnx.State of the model's `nnx.Param` variables (float32 master weights).
    model_state: nnx.State of every other model variable (router biases/statistics, RNG counters).
    opt_state: the optax state over `params`.
  """
  step: jax.Array
  params: Any
  model_state: Any
  opt_state: Any


def initial_state(params: Any, model_state: Any, tx: optax.GradientTransformation) -> TrainState:
  """The TrainState at step 0 of a model split into (params, model_state)."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                    opt_state=tx.init(params))


def abstract_train_state(abstract_model: nnx.Module, tx: optax.GradientTransformation) -> TrainState:
  """The shapes and dtypes of the initial TrainState of `abstract_model` (from
  `nnx.eval_shape`), without building the model again."""
  _, params, model_state = nnx.split(abstract_model, nnx.Param, ...)
  return jax.eval_shape(lambda p, m: initial_state(p, m, tx), params, model_state)


def create_train_state(model_fn: Callable[[nnx.Rngs], nnx.Module], tx: optax.GradientTransformation,
                       seed: int, *, sharding: jax.sharding.Sharding | None = None
                       ) -> tuple[nnx.GraphDef, TrainState]:
  """Builds the model with `model_fn(rngs)` and returns (graphdef, initial TrainState) on `sharding`.

  Initialisation is eager: its many small per-shape programs are cached across
  runs in one process, where one jitted init program would recompile each time.
  """
  graphdef, params, model_state = nnx.split(model_fn(nnx.Rngs(seed)), nnx.Param, ...)
  state = initial_state(params, model_state, tx)
  if sharding is not None:
    state = place(state, sharding)
  return graphdef, state


def place(tree: Any, shardings: Any) -> Any:
  """Puts every leaf of `tree` on its sharding: `shardings` is one sharding for every
  leaf, or a tree of shardings with `tree`'s structure.

  With several processes each one holds the same host values (same seed) and
  contributes its addressable shards, which `jax.device_put` alone cannot do.
  """
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, tree)
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)

  def one(x, sharding):
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  return jax.tree.map(one, tree, shardings)


def count_elements(tree: Any) -> int:
  """Total number of array elements of `tree` (the model's own count: `lm.param_count`)."""
  return sum(int(x.size) for x in jax.tree.leaves(tree))
