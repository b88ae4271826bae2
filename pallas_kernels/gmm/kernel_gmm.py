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

Two SwiGLU fusions spare the layer its elementwise passes over [M, 2h]:
with `lhs_swiglu` the lhs holds [gate | up] and each K step loads both
halves and multiplies silu(gate) * up into the operand (the hidden
activations are never written); with a `swiglu_gu` operand the finished
tile is dh, the cotangent of those activations, and the epilogue writes
the SwiGLU's VJP, d[gate | up], plus the row-scaled activations the
weight gradient of the output projection reads.
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


def _silu_parts(gate_f32):
  """(silu(gate), silu'(gate)) in float32."""
  sig = jax.nn.sigmoid(gate_f32)
  return gate_f32 * sig, sig * (1.0 + gate_f32 * (1.0 - sig))


def _kernel(*refs, has_index, has_scale, transpose_rhs, lhs_swiglu, swiglu_grad, num_k, num_m,
            num_n, cfg: GmmConfig, lhs_rows, precision):
  refs = list(refs)
  tile_group_ref = refs.pop(0)
  index_ref = refs.pop(0) if has_index else None
  scale_ref = refs.pop(0) if has_scale else None
  lhs_ref, rhs_ref = refs.pop(0), refs.pop(0)
  gu_ref = refs.pop(0) if swiglu_grad else None
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

  half = num_k * bk  # the K width; with lhs_swiglu, where the up half of lhs starts

  def step(kk, acc):
    ks = pl.ds(pl.multiple_of(kk * bk, bk), bk)
    if lhs_swiglu:
      gate = lhs_ref[rows, ks].astype(_F32)
      up = lhs_ref[rows, pl.ds(pl.multiple_of(half + kk * bk, bk), bk)].astype(_F32)
      # Rounded to the operand dtype, as `silu_mul` rounds the activations it writes.
      a = (_silu_parts(gate)[0] * up).astype(lhs_ref.dtype)
    else:
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
    # "Grouped matmuls").
    acc = acc * real.astype(_F32)[:, None]
  scale = scale_ref[...].astype(_F32)[:, None] if has_scale else None
  if has_scale:
    acc = acc * scale
  if not swiglu_grad:
    (out_ref,) = refs
    out_ref[...] = acc.astype(out_ref.dtype)
    return
  # acc is dh for hidden columns [j bn, (j + 1) bn); the SwiGLU input of those
  # columns sits at the same place in the gate half and `n` further in the up half.
  dgu_ref, hs_ref = refs
  n = num_n * bn
  own = pl.ds(pl.multiple_of(i * bm, bm), bm)
  up_cols = pl.ds(pl.multiple_of(n + j * bn, bn), bn)
  gate = gu_ref[own, cols].astype(_F32)
  up = gu_ref[own, up_cols].astype(_F32)
  silu, dsilu = _silu_parts(gate)
  dgu_ref[own, cols] = (acc * up * dsilu).astype(dgu_ref.dtype)
  dgu_ref[own, up_cols] = (acc * silu).astype(dgu_ref.dtype)
  hidden = (silu * up).astype(gu_ref.dtype).astype(_F32)  # the forward's rounded activations
  if has_scale:
    hidden = hidden * scale
  hs_ref[...] = hidden.astype(hs_ref.dtype)


def gmm_call(lhs_rk, rhs, tile_group_t, row_index_m, row_scale_m, *, num_rows: int,
             transpose_rhs: bool, out_dtype, cfg: GmmConfig, interpret: bool,
             lhs_swiglu: bool = False, swiglu_gu=None):
  """The pallas_call; `api.gmm` and `api.gmm_swiglu_grad` check the arguments.

  Returns [num_rows, N] out_dtype; with `swiglu_gu` ([num_rows, 2N]) the pair
  (d[gate | up] [num_rows, 2N], scaled activations [num_rows, N]) in its dtype.
  """
  k = lhs_rk.shape[1] // 2 if lhs_swiglu else lhs_rk.shape[1]
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
  out_tile = pl.BlockSpec((bm, bn), tile)
  if swiglu_gu is None:
    out_specs, out_shape = out_tile, jax.ShapeDtypeStruct((num_rows, n), out_dtype)
  else:
    inputs.append(swiglu_gu)
    specs.append(full(swiglu_gu.shape))
    # Each program stores its two column tiles of d[gate | up] itself.
    out_specs = (full(swiglu_gu.shape), out_tile)
    out_shape = (jax.ShapeDtypeStruct(swiglu_gu.shape, swiglu_gu.dtype),
                 jax.ShapeDtypeStruct((num_rows, n), swiglu_gu.dtype))
  kernel = functools.partial(
      _kernel, has_index=row_index_m is not None, has_scale=row_scale_m is not None,
      transpose_rhs=transpose_rhs, lhs_swiglu=lhs_swiglu, swiglu_grad=swiglu_gu is not None,
      num_k=k // cfg.block_k, num_m=num_m, num_n=num_n, cfg=cfg, lhs_rows=lhs_rk.shape[0],
      precision=precision_for(lhs_rk.dtype, not interpret))
  params = None if interpret else pltriton.CompilerParams(num_warps=cfg.num_warps,
                                                          num_stages=cfg.num_stages)
  return pl.pallas_call(
      kernel, grid=(num_m * num_n,), in_specs=specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=params, interpret=interpret, name="gmm")(*inputs)
