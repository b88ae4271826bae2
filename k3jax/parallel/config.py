"""ParallelConfig: mesh sizes, pipeline microbatches, logical-axis rules and expert
dispatch slots, from config.

The trainer's flat `config.parallel` section (see `k3jax.train.defaults`):

    c.parallel.data, c.parallel.fsdp, c.parallel.expert, c.parallel.context = -1, 1, 2, 2
    c.parallel.stages, c.parallel.microbatches = 2, 8  # pipeline: the mesh's stage axis
    c.parallel.dispatch_slot_factor = 0.0           # 0: lossless
    c.parallel.rules.embed = "fsdp"                 # "a,b": several axes, "": replicated

    pconf = ParallelConfig.from_trainer_config(config.parallel)

The nested form (library use):

    c.parallel = ml_collections.ConfigDict()
    c.parallel.mesh = dict(data=-1, fsdp=1, expert=2, context=2, stage=1)
    c.parallel.microbatches = 1                                   # pipeline microbatches
    c.parallel.rules = dict(embed="fsdp", expert="expert", ...)   # optional; defaults
    c.parallel.dispatch_slot_factor = 2.0                         # None: lossless

    pconf = ParallelConfig.from_dict(config.parallel.to_dict())
    mesh = pconf.make_mesh()
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jax.sharding import Mesh

from k3jax.configdict import did_you_mean
from k3jax.configdict import to_plain as _to_plain
from k3jax.layers.moe_path import ExpertParallel
from k3jax.sharding import mesh as mesh_lib
from k3jax.sharding import rules as rules_lib


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """How a run is laid out on devices.

  Attributes:
    mesh: axis sizes (one may be -1).
    rules: logical-axis rules; the defaults shard batch over data/fsdp/expert,
      length over context, embed over fsdp, experts over expert.
    dispatch_slot_factor: expert-parallel send slots per device pair, as a
      multiple of an even split; None is lossless. (Not the router's
      `capacity_factor`, which caps each expert's load over the batch.)
    microbatches: microbatches of a step's batch that the pipeline schedule
      streams through the stages (`mesh.stage` of them); 1 without stages.
  """

  mesh: mesh_lib.MeshConfig = dataclasses.field(default_factory=mesh_lib.MeshConfig)
  rules: rules_lib.Rules = rules_lib.DEFAULT_RULES
  dispatch_slot_factor: float | None = None
  microbatches: int = 1

  def __post_init__(self):
    if not isinstance(self.mesh, mesh_lib.MeshConfig):
      raise ValueError(f"ParallelConfig.mesh must be a MeshConfig, got {self.mesh!r}")
    object.__setattr__(self, "rules", rules_lib.make_rules(self.rules))
    f = self.dispatch_slot_factor
    if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or f <= 0):
      raise ValueError(f"ParallelConfig.dispatch_slot_factor={f!r}; must be > 0 or None "
                       "(lossless)")
    m = self.microbatches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
      raise ValueError(f"parallel.microbatches={m!r}; must be a positive int (the pipeline "
                       "splits each step's batch into this many microbatches)")
    for name, target in self.rules:
      if mesh_lib.STAGE in ((target,) if isinstance(target, str) else (target or ())):
        raise ValueError(f"parallel.rules.{name} maps to the {mesh_lib.STAGE!r} axis, which "
                         "splits the layers between pipeline stages; no logical axis may use it")

  @property
  def stages(self) -> int:
    """Pipeline stages: the size of the mesh's stage axis."""
    return self.mesh.stage

  def expert_parallel(self, expert_axis_size: int) -> ExpertParallel | None:
    """The MoE layers' expert-parallel path on a mesh whose expert axis has this size
    (None, local experts, when it is 1)."""
    if expert_axis_size == 1:
      return None
    return ExpertParallel(axis=mesh_lib.EXPERT, dispatch_slot_factor=self.dispatch_slot_factor)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any] | None) -> "ParallelConfig":
    """From a plain mapping with optional keys mesh, rules, dispatch_slot_factor, microbatches."""
    d = dict(d or {})
    _check_renamed(d)
    allowed = ["dispatch_slot_factor", "mesh", "microbatches", "rules"]
    unknown = sorted(set(d) - set(allowed))
    if unknown:
      raise ValueError(f"unknown parallel config keys {unknown}; allowed: {allowed}")
    mesh = d.get("mesh")
    return cls(mesh=mesh if isinstance(mesh, mesh_lib.MeshConfig)
               else mesh_lib.MeshConfig.from_dict(mesh or {}),
               rules=rules_lib.make_rules(d.get("rules")),
               dispatch_slot_factor=d.get("dispatch_slot_factor"),
               microbatches=d.get("microbatches", 1))

  @classmethod
  def from_trainer_config(cls, section: Mapping[str, Any] | None) -> "ParallelConfig":
    """From the trainer's flat section: data, fsdp, expert, context, stages, microbatches,
    dispatch_slot_factor, rules.

    Every key may be left out (defaults: data=-1, the others 1, lossless
    dispatch, DEFAULT_RULES). `stages` is the size of the mesh's stage axis.
    `dispatch_slot_factor` 0 means lossless (None). `rules` maps logical
    names to mesh axes and overrides only the names it lists; see
    `parse_rule_overrides`.
    """
    d = dict(_to_plain(section) or {})
    _check_renamed(d)
    allowed = (*TRAINER_AXIS_KEYS, "microbatches", "dispatch_slot_factor", "rules")
    for key in d:
      if key not in allowed:
        raise ValueError(f"unknown parallel config key {key!r}{did_you_mean(key, allowed)} "
                         f"Allowed: {list(allowed)}")
    sizes = {}
    for key, axis in TRAINER_AXIS_KEYS.items():
      size = d.get(key, -1 if axis == mesh_lib.DATA else 1)
      if isinstance(size, bool) or not isinstance(size, int):
        raise ValueError(f"parallel.{key}={size!r}; must be a positive int or -1")
      sizes[axis] = size
    f = d.get("dispatch_slot_factor", 0.0)
    if isinstance(f, bool) or not isinstance(f, (int, float)) or f < 0:
      raise ValueError(f"parallel.dispatch_slot_factor={f!r}; must be >= 0 (0 = lossless "
                       "dispatch)")
    return cls(mesh=mesh_lib.MeshConfig(**sizes), rules=parse_rule_overrides(d.get("rules")),
               dispatch_slot_factor=float(f) if f else None,
               microbatches=d.get("microbatches", 1))

  def make_mesh(self, devices=None) -> Mesh:
    """The mesh over `devices` (default: all devices of all processes)."""
    return mesh_lib.make_mesh(self.mesh, devices=devices)


# The trainer's keys for the mesh axes: the stage axis is set by `parallel.stages`.
TRAINER_AXIS_KEYS = {"data": mesh_lib.DATA, "fsdp": mesh_lib.FSDP, "expert": mesh_lib.EXPERT,
                     "context": mesh_lib.CONTEXT, "stages": mesh_lib.STAGE}

# Parallel keys that were renamed: old name -> new name. Only the router's setting is
# called capacity_factor; the dispatch's became dispatch_slot_factor.
RENAMED = {"capacity_factor": "dispatch_slot_factor"}


def renamed_message(old: str) -> str:
  """Why `parallel.<old>` is refused: the key it was renamed to, and how to set it."""
  new = RENAMED[old]
  return (f"config 'parallel.{old}' was renamed 'parallel.{new}' (the same meaning: "
          f"expert-parallel send slots per device pair relative to an even split, 0 = lossless; "
          f"the router's capacity is model.router.capacity_factor). "
          f"Use --config.parallel.{new}=VALUE (or set it there in the config file).")


def _check_renamed(d: Mapping[str, Any]) -> None:
  for old in RENAMED:
    if old in d:
      raise ValueError(renamed_message(old))


def _parse_target(name: str, target: Any):
  """A rule's mesh axes from config: "a" / "a,b" / "" (replicated) / a list / None."""
  if target is None:
    return None
  if isinstance(target, str):
    axes = tuple(a.strip() for a in target.split(",") if a.strip())
  elif isinstance(target, (list, tuple)):
    axes = tuple(target)
  else:
    raise ValueError(f"parallel.rules.{name}={target!r}; expected a string of comma-separated "
                     f"mesh axes ({', '.join(mesh_lib.AXES)}) or '' for replicated")
  for axis in axes:
    if axis not in mesh_lib.AXES:
      raise ValueError(f"parallel.rules.{name}={target!r}: unknown mesh axis {axis!r}"
                       f"{did_you_mean(str(axis), mesh_lib.AXES)} Mesh axes: "
                       f"{list(mesh_lib.AXES)}")
  if len(set(axes)) != len(axes):
    raise ValueError(f"parallel.rules.{name}={target!r} repeats a mesh axis")
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def parse_rule_overrides(overrides: Mapping[str, Any] | None,
                         base: rules_lib.Rules = rules_lib.DEFAULT_RULES) -> rules_lib.Rules:
  """`base` rules with the logical names in `overrides` replaced.

  Args:
    overrides: logical name -> mesh axes: "data" / "data,fsdp" (several, in
      order) / "" or None (replicated) / a list of axis names. Only the
      logical names of `base` are known to the layers; any other name is a
      typo and raises (with a suggestion).
    base: the rules to start from.
  """
  overrides = dict(_to_plain(overrides) or {})
  table = dict(base)
  for name, target in overrides.items():
    if name not in table:
      raise ValueError(f"parallel.rules.{name}: unknown logical axis {name!r}"
                       f"{did_you_mean(name, table)} Known: {sorted(table)}")
    table[name] = _parse_target(name, target)
  return rules_lib.make_rules(tuple(table.items()))


def rule_axes(rules: rules_lib.Rules, name: str) -> tuple[str, ...]:
  """The mesh axes logical axis `name` maps to (empty when replicated or unknown)."""
  target = dict(rules).get(name)
  return () if target is None else (target,) if isinstance(target, str) else tuple(target)
