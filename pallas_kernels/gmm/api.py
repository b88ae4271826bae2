"""Grouped matmuls on the tiled row layout (`layout.TileMap`), as Pallas kernels.

    tiles = layout.tile_map(group_start, group_size, num_rows, block_m)
    out_mn = gmm(x_nd, w_gkn, tiles, row_index=source_m)         # gathered rows
    y_mn = gmm(gate_up_m2k, w_gkn, tiles, lhs_swiglu=True)       # SwiGLU fused in the load
    d_gate_up, h_scaled = gmm_swiglu_grad(g_nd, w_gnk, gate_up_m2k, tiles,
                                          row_index=token_m, row_scale=w_m)
    dw_gkn = tgmm(x_nd, dy_mn, tiles, lhs_index=source_m)        # weight gradient

On the GPU both lower through Triton; `interpret=True` runs the same kernel
bodies anywhere (CPU tests). `GmmConfig(backend="mosaic_gpu")` runs `gmm`'s
plain product on the Mosaic GPU prototype (`kernel_gmm_mosaic`) instead;
there `interpret` may also be a `plgpu.InterpretGPUParams` (race detection). Mosaic (TPU) has no row gather inside a
kernel, so the TPU keeps XLA's own `ragged_dot` (see `k3jax.layers.grouped_matmul`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gmm import kernel_gmm, kernel_gmm_mosaic, kernel_tgmm
from pallas_kernels.gmm.config import GmmConfig, default_config
from pallas_kernels.gmm.layout import TileMap
from pallas_kernels.mgpu_common import plgpu


def _check_index(name, index, num_rows):
  if index is None:
    return
  if index.shape != (num_rows,) or not jnp.issubdtype(index.dtype, jnp.integer):
    raise ValueError(f"{name} must be an int array of shape ({num_rows},) (one entry per row "
                     f"of the layout), got {index.dtype}{list(index.shape)}")


def _config(config, dtype, tiles: TileMap, k, n) -> GmmConfig:
  cfg = (config or default_config(dtype)).fit(k, n)
  if cfg.block_m != tiles.block_m:
    raise ValueError(f"config.block_m={cfg.block_m} differs from the layout's block_m="
                     f"{tiles.block_m}: build the TileMap with the kernel's block_m")
  return cfg


def gmm(lhs: jax.Array, rhs: jax.Array, tiles: TileMap, *, row_index: jax.Array | None = None,
        row_scale: jax.Array | None = None, transpose_rhs: bool = False, out_dtype=None,
        lhs_swiglu: bool = False, config: GmmConfig | None = None,
        interpret: bool = False) -> jax.Array:
  """out[m] = row_scale[m] * lhs_row(m) @ W[g(m)], W = rhs or rhs^T per group.

  Args:
    lhs: [R, K]. Without row_index R must be M, the layout's rows. With
      lhs_swiglu, [R, 2K] holding [gate | up]: the rows multiplied are
      silu(gate) * up, computed in float32 and rounded to lhs's dtype as
      they are loaded (never written).
    rhs: [G, K, N] (or [G, N, K] with transpose_rhs), in lhs's dtype.
    tiles: the layout (M = tiles.num_rows rows in tiles of tiles.block_m).
    row_index: [M] int; row m reads lhs[row_index[m]], a zero row when
      row_index[m] >= R (an empty slot).
    row_scale: [M] float, multiplies row m of the result.
    transpose_rhs: contract with rhs's last axis (the dgrad of `gmm`).
    out_dtype: result dtype (default lhs's).
    config: tile sizes and body (default `default_config(lhs.dtype)`, fitted
      to K, N).
    interpret: run the kernel body in the Pallas interpreter; with the
      mosaic_gpu body True means `plgpu.InterpretGPUParams()`, or pass one.

  Returns:
    [M, N] out_dtype; zero rows for padding tiles and empty slots.
  """
  if lhs.ndim != 2 or rhs.ndim != 3:
    raise ValueError(f"gmm needs lhs [R, K] and rhs [G, K, N], got {lhs.shape} and {rhs.shape}")
  num_groups, rk, rn = rhs.shape
  if lhs_swiglu and lhs.shape[1] % 2:
    raise ValueError(f"lhs_swiglu needs lhs [R, 2K] ([gate | up]), got an odd width "
                     f"{lhs.shape[1]}")
  k = lhs.shape[1] // 2 if lhs_swiglu else lhs.shape[1]
  kk, n = (rn, rk) if transpose_rhs else (rk, rn)
  if kk != k:
    raise ValueError(f"gmm contracts lhs's K={k} with rhs {rhs.shape} (transpose_rhs="
                     f"{transpose_rhs}): the widths differ")
  if num_groups != tiles.num_groups:
    raise ValueError(f"rhs has {num_groups} groups, the layout {tiles.num_groups}")
  if jnp.dtype(lhs.dtype) != jnp.dtype(rhs.dtype):
    raise ValueError(f"gmm operands must share a dtype, got {lhs.dtype} and {rhs.dtype}: "
                     "cast the weights to the compute dtype")
  m = tiles.num_rows
  if row_index is None and lhs.shape[0] != m:
    raise ValueError(f"without row_index lhs needs the layout's {m} rows, got {lhs.shape[0]}")
  _check_index("row_index", row_index, m)
  if row_scale is not None and row_scale.shape != (m,):
    raise ValueError(f"row_scale must have shape ({m},), got {row_scale.shape}")
  cfg = _config(config, lhs.dtype, tiles, k, n)
  index = None if row_index is None else row_index.astype(jnp.int32)
  if cfg.backend == "mosaic_gpu":
    kernel_gmm_mosaic.check_supported(lhs.dtype, cfg, transpose_rhs=transpose_rhs,
                                      lhs_swiglu=lhs_swiglu)
    params = plgpu.InterpretGPUParams() if interpret is True else interpret
    return kernel_gmm_mosaic.gmm_call(lhs, rhs, tiles.tile_group, index, row_scale, num_rows=m,
                                      out_dtype=out_dtype or lhs.dtype, cfg=cfg,
                                      interpret=params)
  return kernel_gmm.gmm_call(lhs, rhs, tiles.tile_group, index, row_scale, num_rows=m,
                             transpose_rhs=transpose_rhs, out_dtype=out_dtype or lhs.dtype,
                             cfg=cfg, interpret=interpret, lhs_swiglu=lhs_swiglu)


def gmm_swiglu_grad(g: jax.Array, rhs: jax.Array, gate_up: jax.Array, tiles: TileMap, *,
                    row_index: jax.Array | None = None, row_scale: jax.Array | None = None,
                    transpose_rhs: bool = True, config: GmmConfig | None = None,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """The backward of `gmm(gate_up, rhs, lhs_swiglu=True)` before its weight gradient.

  With dh = row_scale * (g_row(m) @ W[g(m)]) (W = rhs^T by default; float32,
  never written) and h = silu(gate) * up rounded to gate_up's dtype:

    d_gate_up = [dh * up * silu'(gate) | dh * silu(gate)]     [M, 2N]
    h_scaled  = row_scale * h                                 [M, N]

  the SwiGLU's VJP of dh, and the rows the output projection's weight
  gradient contracts with the cotangent (`tgmm(h_scaled, g_rows)`).

  Args:
    g: [R, K] cotangent rows (read through row_index as in `gmm`).
    rhs: [G, N, K] (or [G, K, N] with transpose_rhs=False), g's dtype.
    gate_up: [M, 2N], the forward's [gate | up] in the layout's rows.
    tiles, row_index, row_scale, config, interpret: as `gmm`.

  Returns:
    (d_gate_up [M, 2N], h_scaled [M, N]), both in gate_up's dtype.
    d_gate_up has zero rows for padding tiles and empty slots; h_scaled has
    them where gate_up does (as the forward `gmm` writes it).
  """
  m = tiles.num_rows
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  if gate_up.shape != (m, 2 * n):
    raise ValueError(f"gate_up must be [M, 2N] = [{m}, {2 * n}] (the layout's rows, [gate | "
                     f"up] of the product's width), got {list(gate_up.shape)}")
  if g.ndim != 2 or rhs.ndim != 3:
    raise ValueError(f"gmm_swiglu_grad needs g [R, K] and rhs [G, N, K], got {g.shape} and "
                     f"{rhs.shape}")
  if (rhs.shape[2] if transpose_rhs else rhs.shape[1]) != g.shape[1]:
    raise ValueError(f"g's width {g.shape[1]} does not contract with rhs {rhs.shape} "
                     f"(transpose_rhs={transpose_rhs})")
  if jnp.dtype(g.dtype) != jnp.dtype(rhs.dtype):
    raise ValueError(f"gmm operands must share a dtype, got {g.dtype} and {rhs.dtype}: "
                     "cast the weights to the compute dtype")
  if rhs.shape[0] != tiles.num_groups:
    raise ValueError(f"rhs has {rhs.shape[0]} groups, the layout {tiles.num_groups}")
  if row_index is None and g.shape[0] != m:
    raise ValueError(f"without row_index g needs the layout's {m} rows, got {g.shape[0]}")
  _check_index("row_index", row_index, m)
  if row_scale is not None and row_scale.shape != (m,):
    raise ValueError(f"row_scale must have shape ({m},), got {row_scale.shape}")
  cfg = _config(config, g.dtype, tiles, g.shape[1], n)
  index = None if row_index is None else row_index.astype(jnp.int32)
  return kernel_gmm.gmm_call(g, rhs, tiles.tile_group, index, row_scale, num_rows=m,
                             transpose_rhs=transpose_rhs, out_dtype=gate_up.dtype, cfg=cfg,
                             interpret=interpret, swiglu_gu=gate_up)


def tgmm(lhs: jax.Array, rhs: jax.Array, tiles: TileMap, *, lhs_index=None, lhs_scale=None,
         rhs_index=None, rhs_scale=None, out_dtype=jnp.float32,
         config: GmmConfig | None = None, interpret: bool = False) -> jax.Array:
  """out[g] = sum_{m in group g} lhs_row(m)^T rhs_row(m), the weight gradient of `gmm`.

  Args:
    lhs: [R_l, K]; rhs: [R_r, N], one dtype. Each is read through its index
      ([M] int, zero rows where the index is >= its rows) or, without one,
      must have the layout's M rows; a scale ([M] float) multiplies its rows
      before the product.
    tiles: the layout.
    out_dtype: result dtype (float32: the sum of many row products).
    config, interpret: as `gmm`.

  Returns:
    [G, K, N] out_dtype; zeros for empty groups.
  """
  if lhs.ndim != 2 or rhs.ndim != 2:
    raise ValueError(f"tgmm needs lhs [R, K] and rhs [R, N], got {lhs.shape} and {rhs.shape}")
  if jnp.dtype(lhs.dtype) != jnp.dtype(rhs.dtype):
    raise ValueError(f"tgmm operands must share a dtype, got {lhs.dtype} and {rhs.dtype}")
  m = tiles.num_rows
  for name, x, index, scale in (("lhs", lhs, lhs_index, lhs_scale),
                                ("rhs", rhs, rhs_index, rhs_scale)):
    if index is None and x.shape[0] != m:
      raise ValueError(f"without {name}_index {name} needs the layout's {m} rows, "
                       f"got {x.shape[0]}")
    _check_index(f"{name}_index", index, m)
    if scale is not None and scale.shape != (m,):
      raise ValueError(f"{name}_scale must have shape ({m},), got {scale.shape}")
  cfg = _config(config, lhs.dtype, tiles, lhs.shape[1], rhs.shape[1])
  as_int = lambda i: None if i is None else i.astype(jnp.int32)
  return kernel_tgmm.tgmm_call(lhs, rhs, tiles.group_tile_start, tiles.group_tile_count,
                               as_int(lhs_index), lhs_scale, as_int(rhs_index), rhs_scale,
                               num_rows=m, out_dtype=out_dtype, cfg=cfg, interpret=interpret)
