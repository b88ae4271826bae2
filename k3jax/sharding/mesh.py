"""Device mesh from config: axes stage / data / fsdp / expert / context.

    mesh = make_mesh(MeshConfig(data=-1, expert=2, context=2))

Sizes are positive ints, with at most one -1 meaning "all remaining
devices". Axis order is fixed, slowest-varying first: stage, data, fsdp,
expert, context. Context is innermost because its per-layer exchange (KDA
state summaries, attention keys) is the most frequent, so it lands on the
closest devices; stage is outermost: a pipeline stage sends one boundary
state per microbatch to its neighbour, the least traffic of any axis (data
reduces every gradient once per step).
Multi-host runs call `jax.distributed.initialize()` before building the mesh;
`jax.devices()` then lists every process's devices.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

AXES = ("stage", "data", "fsdp", "expert", "context")
STAGE, DATA, FSDP, EXPERT, CONTEXT = AXES
# The axes that split one pipeline stage's work (every axis but stage).
WITHIN_STAGE_AXES = AXES[1:]


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes; one of them may be -1 ("the rest of the devices").

  `stage` is the pipeline axis (`k3jax.parallel.pipeline`); it is the last
  field so that positional sizes keep their meaning, and the first axis.
  """

  data: int = -1
  fsdp: int = 1
  expert: int = 1
  context: int = 1
  stage: int = 1

  def __post_init__(self):
    sizes = self.sizes()
    for name, size in zip(AXES, sizes):
      if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
        raise ValueError(f"MeshConfig.{name}={size!r}; must be a positive int or -1")
    if sizes.count(-1) > 1:
      raise ValueError(f"MeshConfig {dict(zip(AXES, sizes))}: at most one axis may be -1")

  def sizes(self) -> tuple[int, ...]:
    """Sizes in AXES order, -1 unresolved."""
    return tuple(getattr(self, name) for name in AXES)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "MeshConfig":
    """From a plain mapping (e.g. `config.mesh` of an ml_collections config)."""
    d = dict(d)
    unknown = sorted(set(d) - set(AXES))
    if unknown:
      raise ValueError(f"unknown mesh axes {unknown}; allowed: {list(AXES)}")
    return cls(**{k: int(v) for k, v in d.items()})


def resolve_sizes(config: MeshConfig, num_devices: int) -> tuple[int, ...]:
  """Axis sizes (AXES order) with -1 resolved so their product is num_devices."""
  sizes = list(config.sizes())
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"mesh {dict(zip(AXES, sizes))}: the fixed axes multiply to {known}, "
                       f"which does not divide the {num_devices} devices")
    sizes[sizes.index(-1)] = num_devices // known
  elif known != num_devices:
    raise ValueError(f"mesh {dict(zip(AXES, sizes))} has {known} devices, but {num_devices} "
                     "are available; set one axis to -1 or change the sizes")
  return tuple(sizes)


def make_mesh(config: MeshConfig | Mapping[str, Any] | None = None, *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the 5-axis mesh (stage, data, fsdp, expert, context) over `devices`.

  Args:
    config: MeshConfig or mapping of axis sizes; None puts every device on data.
    devices: defaults to `jax.devices()` (all processes' devices).

  Returns:
    A `jax.sharding.Mesh` with Auto axis types, so code outside `shard_map`
    is partitioned by the compiler from the shardings of its inputs.
  """
  if config is None:
    config = MeshConfig()
  elif not isinstance(config, MeshConfig):
    config = MeshConfig.from_dict(config)
  devices = list(jax.devices() if devices is None else devices)
  if not devices:
    raise ValueError("make_mesh needs at least one device")
  sizes = resolve_sizes(config, len(devices))
  try:
    # Topology-aware placement where the platform provides it.
    grid = mesh_utils.create_device_mesh(sizes, devices=devices)
  except (AttributeError, ValueError, NotImplementedError, AssertionError):
    grid = np.asarray(devices, dtype=object).reshape(sizes)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def current_mesh():
  """The mesh set with `jax.set_mesh` (or `jax.sharding.use_mesh`), or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def axis_size(mesh: Mesh | None, name: str) -> int:
  """Size of mesh axis `name`, 1 when there is no mesh or no such axis."""
  if mesh is None or name not in mesh.axis_names:
    return 1
  return int(mesh.shape[name])
