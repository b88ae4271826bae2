"""Pipeline-stacked layer storage: each stage's layers live on that stage's devices.

    stacked = stack_layers(model.layers, stages=2)    # nnx.List of L / S modules
    layer_sj = nnx.merge(graphdef_j, stage_slice(state_j, s))

Under a pipeline of S stages, local layer j of the model holds layers
j, L/S + j, ..., (S - 1) L/S + j stacked along a leading dim of size S. That
dim carries the logical axis name "stage" (`rules.STAGE_NAME`), which the
sharding rules map onto the mesh's stage axis, so each device stores only its own
stage's layers, and the optimizer moments follow them: 1/S of the layer
memory per device. The pipeline reads slice s on stage s without a copy.

Checkpoints are written in the layout of the run that saves them: `layers/<i>`
for a plain model, `stage_layers/<j>` (leading dim S) for a pipelined one.
`convert_layout` moves a tree of host arrays from one layout to the other
(any S to any S, or to and from the plain one), which is what a restore under
another stage count does (`k3jax.train.checkpoint`).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.sharding.rules import STAGE_NAME  # the stacked leading dim's logical name

STACKED = "stage_layers"     # the pipelined model's attribute (and state key) for them
PLAIN = "layers"             # the plain model's


def layer_index(stage: int, local: int, per_stage: int) -> int:
  """The plain index of stage `stage`'s layer `local` (slice `stage` of stack `local`)."""
  return stage * per_stage + local


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def _axes(var: nnx.Variable, ndim: int) -> tuple:
  return tuple(var.get_metadata().get("out_sharding") or (None,) * ndim)


def _stacked_var(*parts: nnx.Variable) -> nnx.Variable:
  value = jnp.stack([p.get_value() for p in parts])
  return parts[0].replace(value, out_sharding=(STAGE_NAME, *_axes(parts[0], value.ndim - 1)))


def stack_layers(layers: Sequence[nnx.Module], stages: int) -> nnx.List:
  """L layers -> L / S modules whose variables are stacked over the S stages.

  Module j stacks layers j, L/S + j, ... (stage s's j-th layer at index s).

  Raises:
    ValueError: `stages` does not divide the layer count, or two layers that
      would stack differ in structure (kinds, shapes).
  """
  if stages < 1 or len(layers) % stages:
    raise ValueError(f"{len(layers)} layers do not split into {stages} equal stages")
  per_stage = len(layers) // stages
  out = []
  for j in range(per_stage):
    parts = [nnx.split(layers[layer_index(s, j, per_stage)]) for s in range(stages)]
    graphdef = parts[0][0]
    for s, (other, _) in enumerate(parts):
      if other != graphdef:
        raise ValueError(f"layer {layer_index(s, j, per_stage)} differs in structure from "
                         f"layer {j}: every pipeline stage must hold the same layers")
    state = jax.tree.map(_stacked_var, *[p[1] for p in parts], is_leaf=_is_var)
    out.append(nnx.merge(graphdef, state))
  return nnx.List(out)


def stage_slice(state: Any, index: Any) -> Any:
  """Slice `index` of every stacked variable in `state` (an nnx.State), "stage" dropped from
  its axis names; `index` may be traced."""
  def one(var):
    value = var.get_value()
    return var.replace(value[index], out_sharding=_axes(var, value.ndim)[1:])
  return jax.tree.map(one, state, is_leaf=_is_var)


# -- checkpoint layouts (nested dicts with string keys, as `checkpoint.to_nested_dict`) --


def stage_count(nested: dict) -> int:
  """S of the stacked layers in `nested` (leaves with a `.shape`), 0 when it holds none."""
  counts = set()

  def walk(node):
    if not isinstance(node, dict):
      return
    if STACKED in node:
      counts.update(int(leaf.shape[0]) for leaf in jax.tree.leaves(node[STACKED]))
    for value in node.values():
      walk(value)

  walk(nested)
  if len(counts) > 1:
    raise ValueError(f"stacked layers with different stage counts {sorted(counts)}")
  return counts.pop() if counts else 0


def _layers_of(node: dict) -> dict[int, Any]:
  """{layer index: subtree} of one dict holding `layers` or `stage_layers` (host arrays)."""
  if PLAIN in node and STACKED in node:
    raise ValueError(f"a tree holds both {PLAIN!r} and {STACKED!r}")
  if PLAIN in node:
    return {int(i): sub for i, sub in node[PLAIN].items()}
  stacked = node[STACKED]
  per_stage = len(stacked)
  stages = {int(x.shape[0]) for x in jax.tree.leaves(stacked)}.pop()
  return {layer_index(s, int(j), per_stage): jax.tree.map(lambda x, s=s: x[s], sub)
          for j, sub in stacked.items() for s in range(stages)}


def convert_layout(nested: dict, stages: int) -> dict:
  """`nested` (host arrays) with every layer stack in the layout of `stages` stages.

  Args:
    nested: a tree of dicts whose layer stacks are `layers/<i>/...` or
      `stage_layers/<j>/...` (leading dim S).
    stages: 0 for the plain layout; S > 0 for S stacked stages (S = 1 stacks
      with a leading dim of 1).

  Returns:
    A new tree; the leaves outside the layer stacks are the same objects.
  """
  if not isinstance(nested, dict):
    return nested
  out = {k: convert_layout(v, stages) for k, v in nested.items() if k not in (PLAIN, STACKED)}
  if PLAIN not in nested and STACKED not in nested:
    return out
  layers = _layers_of(nested)
  n = len(layers)
  if sorted(layers) != list(range(n)):
    raise ValueError(f"layer indices {sorted(layers)} are not 0 .. {n - 1}")
  if not stages:
    out[PLAIN] = {str(i): layers[i] for i in range(n)}
    return out
  if n % stages:
    raise ValueError(f"{n} layers do not split into {stages} stages")
  per_stage = n // stages
  out[STACKED] = {
      str(j): jax.tree.map(lambda *xs: np.stack(xs),
                           *[layers[layer_index(s, j, per_stage)] for s in range(stages)])
      for j in range(per_stage)}
  return out


def plain_items(flat_state) -> list[tuple[tuple, Any]]:
  """(path, array) of `nnx.to_flat_state(state)` with every stacked layer variable listed per
  layer under its plain path (`stage_layers/j/...` slice s -> `layers/<s L/S + j>/...`)."""
  flat = list(flat_state)
  per_stage = len({path[1] for path, _ in flat if path and path[0] == STACKED})
  out = []
  for path, var in flat:
    value = var.get_value() if _is_var(var) else var
    if not path or path[0] != STACKED:
      out.append((tuple(path), value))
      continue
    for s in range(value.shape[0]):
      out.append(((PLAIN, layer_index(s, int(path[1]), per_stage), *path[2:]), value[s]))
  return out
