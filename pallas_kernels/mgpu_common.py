"""Helpers shared by the Mosaic GPU (Hopper) kernel bodies of `gmm` and `kda`."""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


def swizzled_smem(shape, dtype):
  """SMEM of `shape` [rows, cols], tiled (8 rows) and swizzled along cols as wgmma
  operands must be: the widest swizzle (up to 128 bytes) that cols' bytes allow."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(shape[-1] * bits)
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle * 8 // bits)),
                                              plgpu.SwizzleTransform(swizzle)))
