"""Helpers shared by the Mosaic GPU (Hopper) kernel bodies of `gmm` and `kda`.

`plgpu` is `jax.experimental.pallas.mosaic_gpu`, imported on its first use:
the Mosaic GPU bodies are opt-in prototypes, and importing that module costs
every process that merely imports the kernels (the CPU ones included) a
noticeable start-up delay.
"""
from __future__ import annotations

import importlib

import jax.numpy as jnp


class _ModuleOnFirstUse:
  """Stands for the module `name`, which is imported when an attribute is first read."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr: str):
    return getattr(importlib.import_module(self._name), attr)


plgpu = _ModuleOnFirstUse("jax.experimental.pallas.mosaic_gpu")


def swizzled_smem(shape, dtype):
  """SMEM of `shape` [rows, cols], tiled (8 rows) and swizzled along cols as wgmma
  operands must be: the widest swizzle (up to 128 bytes) that cols' bytes allow."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(shape[-1] * bits)
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle * 8 // bits)),
                                              plgpu.SwizzleTransform(swizzle)))
