"""`tgmm`: out[g] = sum over group g's rows m of lhs_row(m)^T rhs_row(m).

The weight gradient of `gmm`. Grid (N / BN, K / BK, G) for a [BK, BN] result
tile (`GmmConfig.wgrad_tile`), group slowest: the programs of one group run
together and stream the same rows, so each row tile comes from HBM about
once and is reused from L2 (with the group fastest, one wave of programs
spans many groups, and every lhs row is re-read N / BN times and every rhs
row K / BK times). A program owns one [BK, BN] tile of one group's [K, N]
result and walks that group's row tiles (`TileMap.group_tile_start/count`)
in steps of `wgrad_rows` rows, so an empty group writes zeros and a long
group simply runs more steps. Either operand may be gathered through a row
index (indices past its rows load zero rows) and scaled per row before the
product.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gmm.config import GmmConfig
from pallas_kernels.gmm.kernel_gmm import precision_for

_F32 = jnp.float32


def _load_rows(ref, index_ref, scale_ref, rows, cols, num_rows, width, masked_load):
  """[block_m, width] rows of `ref` (gathered through index_ref[rows] if given),
  zero where the index is out of range, scaled by scale_ref[rows] if given.

  On Triton the zero rows come from a masked load (`other=0`), not from a
  select on the loaded tile: a select pulls the tile into registers and back
  to shared memory before the transposed product, outside the copy pipeline.
  The interpreter has no masked gather, so it selects (the same values)."""
  if index_ref is None:
    x = ref[rows, cols]
  else:
    index = index_ref[rows]
    real = index < num_rows
    safe = jnp.where(real, index, 0)
    if masked_load:
      mask = jnp.broadcast_to(real[:, None], (real.shape[0], width))
      x = pltriton.load(ref.at[safe, cols], mask=mask, other=0)
    else:
      x = jnp.where(real[:, None], ref[safe, cols], 0)
  if scale_ref is not None:
    x = (x.astype(_F32) * scale_ref[rows].astype(_F32)[:, None]).astype(ref.dtype)
  return x


def _kernel(*refs, flags, cfg: GmmConfig, block_k, block_n, lhs_rows, rhs_rows, precision,
            masked_load):
  refs = list(refs)
  start_ref, count_ref = refs.pop(0), refs.pop(0)
  opt = [refs.pop(0) if present else None for present in flags]
  lhs_ref, rhs_ref, out_ref = refs
  bm, bn = cfg.block_m, block_n
  nb, kb, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  kcols = pl.ds(pl.multiple_of(kb * block_k, block_k), block_k)
  ncols = pl.ds(pl.multiple_of(nb * bn, bn), bn)
  start = start_ref[g]

  rows_per_step = cfg.wgrad_step

  def step(t, acc):
    rows = pl.ds(pl.multiple_of(start * bm + t * rows_per_step, rows_per_step), rows_per_step)
    a = _load_rows(lhs_ref, opt[0], opt[1], rows, kcols, lhs_rows, block_k, masked_load)
    b = _load_rows(rhs_ref, opt[2], opt[3], rows, ncols, rhs_rows, bn, masked_load)
    return acc + lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=_F32)

  num_steps = count_ref[g].astype(jnp.int32) * (bm // rows_per_step)
  acc = lax.fori_loop(jnp.int32(0), num_steps, step, jnp.zeros((block_k, bn), _F32))
  out_ref[...] = acc.astype(out_ref.dtype)


def tgmm_call(lhs, rhs, group_tile_start, group_tile_count, lhs_index, lhs_scale, rhs_index,
              rhs_scale, *, num_rows: int, out_dtype, cfg: GmmConfig, interpret: bool):
  """The pallas_call; `api.tgmm` checks the arguments. Returns [G, K, N] out_dtype.

  The [K, N] result tile is `cfg.wgrad_tile(K, N)` (K here is the lhs
  width, a result dimension; the contraction runs over rows in steps of
  wgrad_step)."""
  num_groups = group_tile_start.shape[0]
  k, n = lhs.shape[1], rhs.shape[1]
  bk, bn = cfg.wgrad_tile(k, n)
  grid = (n // bn, k // bk, num_groups)
  full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
  inputs = [group_tile_start, group_tile_count]
  optional = (lhs_index, lhs_scale, rhs_index, rhs_scale)
  inputs += [x for x in optional if x is not None] + [lhs, rhs]
  kernel = functools.partial(
      _kernel, flags=tuple(x is not None for x in optional), cfg=cfg, block_k=bk, block_n=bn,
      lhs_rows=lhs.shape[0], rhs_rows=rhs.shape[0],
      precision=precision_for(lhs.dtype, not interpret), masked_load=not interpret)
  params = None if interpret else pltriton.CompilerParams(num_warps=cfg.wgrad_warps,
                                                          num_stages=cfg.wgrad_stages)
  del num_rows  # the row tiles come from the TileMap
  return pl.pallas_call(
      kernel, grid=grid, in_specs=[full(x.shape) for x in inputs],
      out_specs=pl.BlockSpec((None, bk, bn), lambda nb, kb, g: (g, kb, nb)),
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      compiler_params=params, interpret=interpret, name="tgmm")(*inputs)
