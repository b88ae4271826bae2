"""`gmm` on Mosaic GPU (Hopper): TMA copies into swizzled shared memory, wgmma.

The same product as `kernel_gmm` (out[m] = lhs_row(m) @ rhs[group of m's
tile], zero rows for padding tiles and empty slots, an optional row scale),
as a Mosaic GPU kernel: one CUDA block (one warpgroup) per output tile, in
the launch groups of `kernel_gmm.tile_of`.

Hopper's TMA has no row gather (Blackwell's has), so a gathered row tile is
block_m one-row copies into a plain row-major staging buffer, all counted on
one barrier with the weights' tile copy; the warpgroup then moves the rows
through registers into the swizzled operand buffer wgmma reads. Without a
row index the tile is one TMA copy straight into the swizzled buffer.

Empty slots read row 0 (finite) and their rows are zeroed by a 0/1 row
factor on the float32 accumulator, as the Triton body does; the factor
carries the row scale too, so the epilogue multiplies once.

A prototype: one K step in flight (no multi-stage pipeline), no SwiGLU
fusions, no transposed rhs, 16-bit operands only, result tiles of at most
128 x 128 (`fit_tiles`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gmm.config import GmmConfig
from pallas_kernels.gmm.kernel_gmm import tile_of
from pallas_kernels.mgpu_common import plgpu, swizzled_smem

_F32 = jnp.float32


def check_supported(dtype, cfg: GmmConfig, *, transpose_rhs=False, lhs_swiglu=False):
  """Raise ValueError for what this body does not do (see the module docstring)."""
  if jnp.dtype(dtype).itemsize != 2:
    raise ValueError(f"the Mosaic GPU gmm takes 16-bit operands, got {jnp.dtype(dtype)} "
                     "(float32 operands would run TF32 wgmma; use the Triton body)")
  if transpose_rhs or lhs_swiglu:
    raise ValueError("the Mosaic GPU gmm has no transposed rhs or SwiGLU fusion yet")
  if cfg.block_m % 64:
    raise ValueError(f"the Mosaic GPU gmm needs block_m a multiple of 64 (one warpgroup's "
                     f"wgmma rows), got {cfg.block_m}")


def fit_tiles(cfg: GmmConfig) -> GmmConfig:
  """cfg with block_n cut so one warpgroup's float32 accumulator [block_m,
  block_n] is at most 128 registers a thread (block_m * block_n <= 128 * 128):
  the Triton default's 128 x 256 tile would need 256, past the 255 a thread
  has."""
  return dataclasses.replace(cfg, block_n=min(cfg.block_n, 128 * 128 // cfg.block_m))


def _kernel(tile_group_ref, source_ref, factor_ref, lhs_ref, rhs_ref, out_ref, *, num_k, num_m,
            num_n, cfg: GmmConfig, gathered):
  """One output tile; refs in GMEM. source_ref: [M] int32 lhs row of each layout
  row (read when gathered); factor_ref: [M] f32 row factor (0 for empty slots)."""
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  i, j = tile_of(lax.axis_index("tile"), num_m, num_n, cfg.group_m)
  group = tile_group_ref[i]
  group_c = jnp.maximum(group, 0)
  rows = pl.ds(pl.multiple_of(i * bm, bm), bm)
  cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
  dtype = lhs_ref.dtype

  def products(a_smem, b_smem, stage_smem, src_smem, barrier, acc_ref):
    """acc_ref += the tile's K steps (none for a padding tile); returns its value."""
    def step(kk, carry):
      ks = pl.ds(pl.multiple_of(kk * bk, bk), bk)
      plgpu.copy_gmem_to_smem(rhs_ref.at[group_c, ks, cols], b_smem, barrier)
      if gathered:
        for r in range(bm):  # one TMA row copy each: Hopper's TMA cannot gather
          plgpu.copy_gmem_to_smem(lhs_ref.at[pl.ds(src_smem[r], 1), ks],
                                  stage_smem.at[pl.ds(r, 1)], barrier)
        plgpu.barrier_wait(barrier)
        a_smem[...] = plgpu.load(stage_smem, layout=plgpu.Layout.WGMMA)
        plgpu.commit_smem()  # also orders the reads of stage_smem before its next copies
      else:
        plgpu.copy_gmem_to_smem(lhs_ref.at[rows, ks], a_smem, barrier)
        plgpu.barrier_wait(barrier)
      plgpu.wgmma(acc_ref, a_smem, b_smem)
      plgpu.wgmma_wait(0)  # the buffers are refilled by the next step
      return carry

    steps = jnp.where(group >= 0, jnp.int32(num_k), jnp.int32(0))
    lax.fori_loop(jnp.int32(0), steps, step, None)
    return acc_ref[...]

  def scoped(a_smem, b_smem, stage_smem, src_smem, f_smem, o_smem, barrier, row_barrier):
    # The tile's source rows and row factors, once, before the K loop reads them.
    plgpu.copy_gmem_to_smem(source_ref.at[rows], src_smem, row_barrier)
    plgpu.copy_gmem_to_smem(factor_ref.at[rows], f_smem, row_barrier)
    plgpu.barrier_wait(row_barrier)
    acc = pl.run_scoped(
        functools.partial(products, a_smem, b_smem, stage_smem, src_smem, barrier),
        plgpu.ACC((bm, bn), _F32))
    factor = plgpu.load(f_smem, layout=plgpu.Layout.WGMMA.reduce(1))
    o_smem[...] = (acc * factor[:, None]).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[rows, cols])
    plgpu.wait_smem_to_gmem(0)

  # One barrier for each step's copies: the weights' tile plus bm row copies
  # (gathered) or the lhs tile; one for the row indices and factors.
  arrivals = 1 + (bm if gathered else 1)
  pl.run_scoped(
      scoped, swizzled_smem((bm, bk), dtype), swizzled_smem((bk, bn), dtype),
      plgpu.SMEM((bm, bk), dtype), plgpu.SMEM((bm,), jnp.int32), plgpu.SMEM((bm,), _F32),
      plgpu.SMEM((bm, bn), out_ref.dtype), plgpu.Barrier(num_arrivals=arrivals),
      plgpu.Barrier(num_arrivals=2))


def gmm_call(lhs_rk, rhs, tile_group_t, row_index_m, row_scale_m, *, num_rows: int, out_dtype,
             cfg: GmmConfig, interpret=False):
  """The Mosaic GPU kernel; `api.gmm` checks the arguments.

  Args:
    lhs_rk: [R, K] 16-bit rows; rhs: [G, K, N] in lhs's dtype.
    tile_group_t: [M / block_m] int32 group of each tile (-1: padding).
    row_index_m: [M] int32 or None; row_scale_m: [M] float or None.
    interpret: False, or a `plgpu.InterpretGPUParams` to run on the CPU.

  Returns:
    [num_rows, N] out_dtype.
  """
  check_supported(lhs_rk.dtype, cfg)
  cfg = fit_tiles(cfg)
  n = rhs.shape[2]
  num_m, num_n = num_rows // cfg.block_m, n // cfg.block_n
  gathered = row_index_m is not None
  if gathered:
    real = row_index_m < lhs_rk.shape[0]
    source = jnp.where(real, row_index_m, 0).astype(jnp.int32)  # empty slots read row 0
    factor = real.astype(_F32)
  else:
    source = jnp.zeros((num_rows,), jnp.int32)
    factor = jnp.ones((num_rows,), _F32)
  if row_scale_m is not None:
    factor = factor * row_scale_m.astype(_F32)
  kernel = functools.partial(_kernel, num_k=lhs_rk.shape[1] // cfg.block_k, num_m=num_m,
                             num_n=num_n, cfg=cfg, gathered=gathered)
  call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((num_rows, n), out_dtype),
                      grid=(num_m * num_n,), grid_names=("tile",),
                      interpret=interpret or None, kernel_name="gmm_mosaic")
  return call(tile_group_t, source, factor, lhs_rk, rhs)
