"""ParallelConfig: mesh sizes, logical-axis rules and expert dispatch capacity, from config.

In an ml_collections config:

    c.parallel = ml_collections.ConfigDict()
    c.parallel.mesh = dict(data=-1, fsdp=1, expert=2, context=2)
    c.parallel.rules = dict(embed="fsdp", expert="expert", ...)   # optional; defaults
    c.parallel.capacity_factor = 2.0                              # None: lossless

    pconf = ParallelConfig.from_dict(config.parallel.to_dict())
    mesh = pconf.make_mesh()
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jax.sharding import Mesh

from k3jax.parallel import mesh as mesh_lib
from k3jax.parallel import rules as rules_lib


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
  """How a run is laid out on devices.

  Attributes:
    mesh: axis sizes (one may be -1).
    rules: logical-axis rules; the defaults shard batch over data/fsdp/expert,
      length over context, embed over fsdp, experts over expert.
    capacity_factor: expert-parallel dispatch capacity; None is lossless.
  """

  mesh: mesh_lib.MeshConfig = dataclasses.field(default_factory=mesh_lib.MeshConfig)
  rules: rules_lib.Rules = rules_lib.DEFAULT_RULES
  capacity_factor: float | None = None

  def __post_init__(self):
    if not isinstance(self.mesh, mesh_lib.MeshConfig):
      raise ValueError(f"ParallelConfig.mesh must be a MeshConfig, got {self.mesh!r}")
    object.__setattr__(self, "rules", rules_lib.make_rules(self.rules))
    cf = self.capacity_factor
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or cf <= 0):
      raise ValueError(f"ParallelConfig.capacity_factor={cf!r}; must be > 0 or None (lossless)")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any] | None) -> "ParallelConfig":
    """From a plain mapping with optional keys mesh, rules, capacity_factor."""
    d = dict(d or {})
    unknown = sorted(set(d) - {"mesh", "rules", "capacity_factor"})
    if unknown:
      raise ValueError(f"unknown parallel config keys {unknown}; allowed: "
                       "['capacity_factor', 'mesh', 'rules']")
    mesh = d.get("mesh")
    return cls(mesh=mesh if isinstance(mesh, mesh_lib.MeshConfig)
               else mesh_lib.MeshConfig.from_dict(mesh or {}),
               rules=rules_lib.make_rules(d.get("rules")),
               capacity_factor=d.get("capacity_factor"))

  def make_mesh(self, devices=None) -> Mesh:
    """The mesh over `devices` (default: all devices of all processes)."""
    return mesh_lib.make_mesh(self.mesh, devices=devices)
