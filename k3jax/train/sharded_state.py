"""Train state and batches placed on a mesh by the logical-axis rules.

    mesh = make_mesh(MeshConfig(data=-1, expert=2, context=2))
    graphdef, state = create_sharded_train_state(model_fn, tx, seed, mesh)
    step = k3jax.train.step.make_train_step(graphdef, tx, schedule)
    with jax.set_mesh(mesh):
      state, metrics = step(state, shard_batch(batch, mesh))

`model_fn` builds the model for the mesh: KDA layers that take their
context-parallel path (`HybridLM(..., kda_class=ContextParallelKDA)`), MoE
layers their expert-parallel one (`HybridLM(..., expert_parallel=...)`,
`k3jax.layers.moe_path`), stages (`PipelinedLM`); `k3jax.parallel.model_layout`
chooses them from the mesh.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from k3jax.sharding import rules as rules_lib
from k3jax.train import state as state_lib
from k3jax.train.state import TrainState, initial_state


def create_sharded_train_state(model_fn: Callable[[nnx.Rngs], nnx.Module],
                               tx: optax.GradientTransformation, seed: int, mesh: Mesh,
                               rules: rules_lib.Rules = rules_lib.DEFAULT_RULES, *,
                               shardings: Any = None) -> tuple[nnx.GraphDef, TrainState]:
  """Initialises a TrainState directly in its sharded layout (no full replica first).

  Parameters and optimizer moments are sharded by the parameters' logical
  names; step, RNG and unnamed state are replicated. `model_fn` builds the
  model for the mesh (`k3jax.parallel.model_layout`). `shardings`, when the
  caller has them (`rules.tree_shardings` of the abstract state), saves
  tracing the initialisation once more to find them.

  Returns:
    (graphdef of the model, TrainState on `mesh`).
  """
  graphdefs = []

  def init() -> TrainState:
    graphdef, params, model_state = nnx.split(model_fn(nnx.Rngs(seed)), nnx.Param, ...)
    graphdefs.append(graphdef)  # static: the same at every trace
    return initial_state(params, model_state, tx)

  if shardings is None:
    shardings = rules_lib.tree_shardings(jax.eval_shape(init), mesh, rules)
  state = jax.jit(init, out_shardings=shardings)()
  return graphdefs[0], state


def full_shardings(shardings: Any, tree: Any) -> Any:
  """`shardings` (a prefix of `tree`, as from `rules.tree_shardings`: one sharding per
  variable, whose value may be a dict) expanded to one sharding per leaf of `tree`."""
  return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), shardings, tree)


def place(tree: Any, shardings: Any) -> Any:
  """`state.place` with `shardings` a prefix tree of `tree` (`full_shardings`)."""
  return state_lib.place(tree, full_shardings(shardings, tree))


def process_rows(mesh: Mesh, batch_size: int,
                 rules: rules_lib.Rules = rules_lib.DEFAULT_RULES) -> tuple[int, int]:
  """(index, count): this process's devices hold rows [index B / count, (index + 1) B / count)
  of a [B, T] batch placed by `shard_batch`.

  Processes whose devices split the batch feed different rows; processes that
  differ only along axes the batch is replicated over (pipeline stages: every
  stage reads the whole batch) feed the same rows.

  Raises:
    ValueError: this process's rows are not one contiguous block of B / count.
  """
  sharding = NamedSharding(mesh, rules_lib.activation_spec(("batch",), mesh, rules))
  spans = {(rows.start or 0, batch_size if rows.stop is None else rows.stop)
           for rows, in sharding.addressable_devices_indices_map((batch_size,)).values()}
  start, stop = min(a for a, _ in spans), max(b for _, b in spans)
  covered = np.zeros(batch_size, bool)
  for a, b in spans:
    covered[a:b] = True
  size = stop - start
  if not covered[start:stop].all() or batch_size % size or start % size:
    raise ValueError(f"process {jax.process_index()} holds batch rows {sorted(spans)} of "
                     f"{batch_size}, not one block of equal size: order the mesh so that each "
                     "process's devices split a contiguous block of the batch")
  return start // size, batch_size // size


def shard_batch(batch: Mapping[str, Any], mesh: Mesh,
                rules: rules_lib.Rules = rules_lib.DEFAULT_RULES) -> dict[str, jax.Array]:
  """Places a batch of [B, T] arrays (this process's rows) with batch and length sharded."""
  out = {}
  for key, value in batch.items():
    value = np.asarray(value)
    if value.ndim != 2:
      raise ValueError(f"batch[{key!r}] must be [B, T], got shape {value.shape}")
    spec = rules_lib.activation_spec(("batch", "length"), mesh, rules)
    out[key] = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), value)
  return out
