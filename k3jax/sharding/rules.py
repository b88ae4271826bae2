"""Logical-axis rules: the layers' axis names mapped onto mesh axes.

Parameters carry logical names ("embed", "mlp", "heads", "kv", "expert",
"vocab") in their `out_sharding` metadata; activations are named here with
"batch", "length" and the same feature names. A rule maps a logical name to
one mesh axis, a tuple of mesh axes, or None (replicated):

    rules = (("batch", ("data", "fsdp", "expert")), ("length", "context"),
             ("embed", "fsdp"), ("expert", "expert"), ...)

Mesh axes that are absent or of size 1 are dropped from a spec, a mesh axis
already used by an earlier dimension of the same array is not used again,
and a dimension that its mesh axes do not divide is an error.

One name has no rule: "stage", the leading dim of the pipeline-stacked layer
parameters (`k3jax.parallel.stage_storage`), always maps to the mesh's stage
axis, and no rule may name it or map onto that axis.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax.sharding import mesh as mesh_lib

Rules = tuple[tuple[str, Any], ...]

# Batch over every axis that does not shard the sequence (the expert axis
# doubles as a data axis outside the MoE layers); parameters fully sharded
# over fsdp along the model width (ZeRO-3); experts over the expert axis.
DEFAULT_RULES: Rules = (
    ("batch", (mesh_lib.DATA, mesh_lib.FSDP, mesh_lib.EXPERT)),
    ("length", mesh_lib.CONTEXT),
    # Softmax attention sees whole sequences: its heads move to the context axis
    # (one all-to-all each way) instead of its keys being gathered.
    ("attn_heads", mesh_lib.CONTEXT),
    ("embed", mesh_lib.FSDP),
    ("expert", mesh_lib.EXPERT),
    ("vocab", None),
    ("mlp", None),
    ("heads", None),
    ("kv", None),
)


# The logical name that maps to the stage mesh axis without a rule (see the docstring).
STAGE_NAME = mesh_lib.STAGE

_ACTIVE = threading.local()


@contextlib.contextmanager
def use_rules(rules: Mapping[str, Any] | Sequence[tuple[str, Any]] | None) -> Iterator[Rules]:
  """Makes `rules` the default of `constrain` while tracing inside the block.

  Layers name activations without knowing the run's rules; the trainer sets
  them next to `jax.set_mesh`. Read at trace time, like the mesh.
  """
  previous = getattr(_ACTIVE, "rules", None)
  _ACTIVE.rules = make_rules(rules)
  try:
    yield _ACTIVE.rules
  finally:
    _ACTIVE.rules = previous


def current_rules() -> Rules:
  """The rules set by `use_rules`, else DEFAULT_RULES."""
  return getattr(_ACTIVE, "rules", None) or DEFAULT_RULES


def make_rules(rules: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None) -> Rules:
  """Normalises rules from config (mapping or pairs; None = DEFAULT_RULES).

  Values: a mesh axis name, a list/tuple of names, or None.
  """
  if rules is None:
    return DEFAULT_RULES
  pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
  out, seen = [], set()
  for pair in pairs:
    if len(pair) != 2:
      raise ValueError(f"a rule is (logical_name, mesh_axes), got {pair!r}")
    name, target = pair
    if name in seen:
      raise ValueError(f"logical axis {name!r} has two rules")
    if name == STAGE_NAME:
      raise ValueError(f"logical axis {STAGE_NAME!r} takes no rule: it is the leading dim of "
                       "pipeline-stacked layers and always maps to the stage mesh axis")
    seen.add(name)
    if target is not None and not isinstance(target, str):
      target = tuple(target)
      for axis in target:
        if not isinstance(axis, str):
          raise ValueError(f"rule {name!r}: mesh axis names must be strings, got {axis!r}")
    out.append((name, target))
  return tuple(out)


def _check_axes(rules: Rules, mesh: Mesh):
  for name, target in rules:
    for axis in (() if target is None else (target,) if isinstance(target, str) else target):
      if axis not in mesh.axis_names:
        raise ValueError(f"rule {name!r} maps to mesh axis {axis!r}; mesh axes are "
                         f"{mesh.axis_names}")


def logical_to_spec(axes: Sequence[str | None], mesh: Mesh, rules: Rules = DEFAULT_RULES,
                    shape: Sequence[int] | None = None) -> P:
  """PartitionSpec for an array whose dims are named `axes`.

  Args:
    axes: logical name (or None) per dimension.
    mesh: the mesh (its axis sizes decide which axes are worth using).
    rules: normalised rules.
    shape: when given, each dimension must be divisible by its mesh axes.
  """
  table = dict(rules)
  _check_axes(rules, mesh)
  used: set[str] = set()
  spec = []
  for dim, name in enumerate(axes):
    if name is not None and name != STAGE_NAME and name not in table:
      raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
    target = None if name is None else mesh_lib.STAGE if name == STAGE_NAME else table[name]
    targets = () if target is None else (target,) if isinstance(target, str) else target
    keep = tuple(a for a in targets
                 if a in mesh.axis_names and mesh.shape[a] > 1 and a not in used)
    if shape is not None and keep:
      size = 1
      for a in keep:
        size *= mesh.shape[a]
      if shape[dim] % size:
        raise ValueError(f"dimension {dim} ({name!r}) of size {shape[dim]} is not divisible "
                         f"by mesh axes {keep} (size {size})")
    used.update(keep)
    spec.append(None if not keep else keep[0] if len(keep) == 1 else keep)
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def tree_shardings(tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
  """NamedShardings for a pytree of model/optimizer state.

  `nnx.Variable` leaves are sharded by their `out_sharding` logical names
  (optax moments keep them, so the optimizer state follows its parameters);
  any other leaf (step counters, RNG keys, unnamed variables) is replicated.
  The result has the tree's structure, usable as jit in/out shardings or
  for `jax.device_put`.
  """
  rules = make_rules(rules)

  def one(leaf):
    if _is_var(leaf):
      axes = leaf.get_metadata().get("out_sharding")
      value = leaf.get_value()
      shape = getattr(value, "shape", ())
      spec = P() if not axes else logical_to_spec(axes, mesh, rules, shape)
      return leaf.replace(NamedSharding(mesh, spec))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, tree, is_leaf=_is_var)


def shard_tree(tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
  """Places `tree` (params, optimizer state, a TrainState) onto `mesh` per the rules."""
  return jax.device_put(tree, tree_shardings(tree, mesh, rules))


def activation_spec(axes: Sequence[str | None], mesh: Mesh, rules: Rules = DEFAULT_RULES,
                    shape: Sequence[int] | None = None) -> P:
  """PartitionSpec of an activation named e.g. ("batch", "length", "embed").

  With `shape`, each dimension is checked for divisibility by its mesh axes.
  """
  return logical_to_spec(axes, mesh, make_rules(rules), shape)


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
  """Sharding of [B, T] token batches: batch and length axes per the rules."""
  return NamedSharding(mesh, activation_spec(("batch", "length"), mesh, rules))


def constrain(x: jax.Array, axes: Sequence[str | None], rules: Rules | None = None,
              mesh: Mesh | None = None, *, skip_indivisible: bool = False) -> jax.Array:
  """`with_sharding_constraint` of an activation by logical names.

  Uses `mesh`, else the current mesh (`jax.set_mesh`); a no-op without one,
  so layers may call it unconditionally. `rules` default to `current_rules()`.
  With `skip_indivisible`, a dimension its mesh axes do not divide (a
  one-token decode step on a context axis) stays unsharded instead of raising.
  """
  if mesh is None:
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
      return x
    mesh = abstract
  if len(axes) != x.ndim:
    raise ValueError(f"need one logical name per dim: shape {x.shape}, axes {tuple(axes)}")
  rules = current_rules() if rules is None else make_rules(rules)
  if skip_indivisible:
    axes = [a if _divides(a, dim, mesh, rules) else None for a, dim in zip(axes, x.shape)]
  spec = logical_to_spec(axes, mesh, rules, x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec) if isinstance(mesh, Mesh)
                                          else spec)


def divides(name: str, dim: int) -> bool:
  """Whether logical `name`'s mesh axes (current mesh and rules) divide `dim`; True off-mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return True
  return _divides(name, dim, mesh, current_rules())


def _divides(name: str | None, dim: int, mesh, rules: Rules) -> bool:
  """Whether the mesh axes of logical `name` (all of them, sizes > 1) divide `dim`."""
  if name is None:
    return True
  target = dict(rules).get(name)
  size = 1
  for a in (() if target is None else (target,) if isinstance(target, str) else target):
    if a in mesh.axis_names:
      size *= int(mesh.shape[a])
  return dim % size == 0
