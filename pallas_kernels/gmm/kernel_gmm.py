"""`gmm`: out[m] = lhs_row(m) @ rhs[group of m's tile], one program per output tile.

A 1-D grid of (M / block_m) (N / block_n) programs, one per output tile,
launched in groups of `group_m` row tiles (`tile_of`): the column tiles of
a few row tiles run together, so each gathered row tile comes from HBM once
and its other column tiles read it from L2. A program reads its tile's group from the
TileMap and runs the K loop against that group's weights; a tile no group
owns runs no steps and writes zeros. With a row index, tile row m loads
lhs[row_index[m]] (the gather happens in the operand load; indices >= the
lhs rows mean an empty slot and give a zero row), and a row scale
multiplies the finished rows: (s_m a_m) @ B = s_m (a_m @ B).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gmm.config import GmmConfig

_F32 = jnp.float32


def precision_for(dtype, on_triton: bool):
  """Matmul precision: 16-bit operands as they are; float32 operands f32-accurate
  (3xTF32 on the GPU, where one pass of TF32 would err by ~1e-3)."""
  if jnp.dtype(dtype) != jnp.float32:
    return None
  return lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if on_triton else lax.Precision.HIGHEST


def tile_of(pid, num_m: int, num_n: int, group_m: int):
  """(row tile, column tile) of program `pid`: launch groups of `group_m` row
  tiles, row-fastest within a group (the last group may be shorter)."""
  per_group = group_m * num_n
  first = (pid // per_group) * group_m
  rows_here = jnp.minimum(num_m - first, group_m)
  local = pid % per_group
  return first + local % rows_here, local // rows_here


def _kernel(*refs, has_index, has_scale, transpose_rhs, num_k, num_m, num_n, cfg: GmmConfig,
            lhs_rows, precision):
  refs = list(refs)
  tile_group_ref = refs.pop(0)
  index_ref = refs.pop(0) if has_index else None
  scale_ref = refs.pop(0) if has_scale else None
  lhs_ref, rhs_ref, out_ref = refs
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  i, j = tile_of(pl.program_id(0), num_m, num_n, cfg.group_m)
  group = tile_group_ref[i]
  group_c = jnp.maximum(group, 0)
  cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
  if has_index:
    index = index_ref[...]
    real = index < lhs_rows
    rows = jnp.where(real, index, 0)
  else:
    rows = pl.ds(pl.multiple_of(i * bm, bm), bm)

  def step(kk, acc):
    ks = pl.ds(pl.multiple_of(kk * bk, bk), bk)
    a = lhs_ref[rows, ks]
    if transpose_rhs:
      b = rhs_ref[group_c, cols, ks]
      dims = (((1,), (1,)), ((), ()))
    else:
      b = rhs_ref[group_c, ks, cols]
      dims = (((1,), (0,)), ((), ()))
    return acc + lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_F32)

  steps = jnp.where(group >= 0, jnp.int32(num_k), jnp.int32(0))
  acc = lax.fori_loop(jnp.int32(0), steps, step, jnp.zeros((bm, bn), _F32))
  if has_index:
    # Zero rows for empty slots as a product with a 0/1 row factor: the rows
    # read row 0 (finite), so this equals a select, which on the H200 gave
    # wrong 16-bit results without a row scale after it (docs/benchmarks.md,
    # "The 'pallas' backend").
    acc = acc * real.astype(_F32)[:, None]
  if has_scale:
    acc = acc * scale_ref[...].astype(_F32)[:, None]
  out_ref[...] = acc.astype(out_ref.dtype)


def gmm_call(lhs_rk, rhs, tile_group_t, row_index_m, row_scale_m, *, num_rows: int,
             transpose_rhs: bool, out_dtype, cfg: GmmConfig, interpret: bool):
  """The pallas_call; `api.gmm` checks the arguments. Returns [num_rows, N] out_dtype."""
  k = lhs_rk.shape[1]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  bm, bn = cfg.block_m, cfg.block_n
  num_m, num_n = num_rows // bm, n // bn
  tile = lambda pid: tile_of(pid, num_m, num_n, cfg.group_m)
  full = lambda shape: pl.BlockSpec(shape, lambda pid: (0,) * len(shape))
  per_tile = pl.BlockSpec((bm,), lambda pid: (tile(pid)[0],))
  inputs, specs = [tile_group_t], [full(tile_group_t.shape)]
  for extra in (row_index_m, row_scale_m):
    if extra is not None:
      inputs.append(extra)
      specs.append(per_tile)
  inputs += [lhs_rk, rhs]
  specs += [full(lhs_rk.shape), full(rhs.shape)]
  kernel = functools.partial(
      _kernel, has_index=row_index_m is not None, has_scale=row_scale_m is not None,
      transpose_rhs=transpose_rhs, num_k=k // cfg.block_k, num_m=num_m, num_n=num_n, cfg=cfg, lhs_rows=lhs_rk.shape[0],
      precision=precision_for(lhs_rk.dtype, not interpret))
  params = None if interpret else pltriton.CompilerParams(num_warps=cfg.num_warps,
                                                          num_stages=cfg.num_stages)
  return pl.pallas_call(
      kernel, grid=(num_m * num_n,), in_specs=specs,
      out_specs=pl.BlockSpec((bm, bn), tile),
      out_shape=jax.ShapeDtypeStruct((num_rows, n), out_dtype),
      compiler_params=params, interpret=interpret, name="gmm")(*inputs)
