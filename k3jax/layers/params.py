"""Parameter creation with logical axis names.

Every parameter carries its logical axes ("embed", "mlp", "heads", "kv",
"expert", "vocab", ...) as `out_sharding` metadata, so that the parallel code
can map them onto mesh axes with rules. Eager sharding is only requested when
a mesh is active; on a bare CPU the names are kept as metadata only.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


def _mesh_active() -> bool:
  return not jax.sharding.get_abstract_mesh().empty


def logical_param(rngs: nnx.Rngs | None, init: Initializer, shape: Sequence[int],
                  axes: Sequence[str | None], dtype: jnp.dtype) -> nnx.Param:
  """Creates an `nnx.Param` of `shape` named by logical `axes` (one per dim).

  Args:
    rngs: source of the `params` key; may be None for constant initialisers.
    init: `init(key, shape, dtype)`, e.g. from `jax.nn.initializers`.
    shape: parameter shape.
    axes: logical axis name (or None) per dimension.
    dtype: parameter dtype.
  """
  shape = tuple(int(s) for s in shape)
  axes = tuple(axes)
  if len(axes) != len(shape):
    raise ValueError(f"need one logical axis per dim: shape {shape}, axes {axes}")
  key = rngs.params() if rngs is not None else jax.random.key(0)
  value = init(key, shape, dtype)
  eager = nnx.using_eager_sharding() and _mesh_active()
  return nnx.Param(value, out_sharding=axes, eager_sharding=eager)


def fan_in_init(fan_in: int) -> Initializer:
  """Truncated-normal initialiser with std `fan_in ** -0.5`."""
  return jax.nn.initializers.truncated_normal(stddev=float(fan_in) ** -0.5)
