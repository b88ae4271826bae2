"""`output_fwd` of the GPU forward state pass on Mosaic GPU (Hopper).

The same outputs as `kernel_state_split.output_fwd`, O = A_qk V' + qg S_entry
per chunk, as a Mosaic GPU kernel: one CUDA block (one warpgroup) per
(chunk, head, batch row). Its four operand tiles come in by TMA on one
barrier into swizzled shared memory, the two products accumulate in one
wgmma accumulator [C, V] (float32), and the result leaves through shared
memory by TMA.

A prototype: whole K and V per block (no V tiles), 16-bit operands of one
dtype (the output kernel's operands are `mm_dtype` when the forward keeps no
residuals), C a multiple of 64 (one warpgroup's wgmma rows).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.mgpu_common import plgpu, swizzled_smem

_F32 = jnp.float32


def check_supported(qg, a_qk, hs, v_new, chunk_size: int):
  """Raise ValueError for what this body does not do (see the module docstring)."""
  dtypes = {jnp.dtype(x.dtype) for x in (qg, a_qk, hs, v_new)}
  if len(dtypes) != 1 or next(iter(dtypes)).itemsize != 2:
    raise ValueError(f"the Mosaic GPU output kernel takes 16-bit operands of one dtype, got "
                     f"{sorted(map(str, dtypes))}")
  if chunk_size % 64:
    raise ValueError(f"the Mosaic GPU output kernel needs chunk_size a multiple of 64 (one "
                     f"warpgroup's wgmma rows), got {chunk_size}")


def _kernel(qg_ref, aqk_ref, hs_ref, vn_ref, o_ref, *, c, dk, dv):
  """One (chunk, head, batch row); refs in GMEM with the layouts of `output_fwd`."""
  ic, ih, ib = (jax.lax.axis_index(name) for name in ("chunk", "head", "batch"))
  rows = pl.ds(pl.multiple_of(ic * c, c), c)
  k_cols = pl.ds(pl.multiple_of(ih * dk, dk), dk)
  v_cols = pl.ds(pl.multiple_of(ih * dv, dv), dv)
  dtype = qg_ref.dtype

  def products(qg_smem, aqk_smem, hs_smem, vn_smem, barrier, acc_ref):
    for src, dst in ((qg_ref.at[ib, rows, k_cols], qg_smem), (aqk_ref.at[ib, ih, rows], aqk_smem),
                     (hs_ref.at[ib, ih, pl.ds(pl.multiple_of(ic * dk, dk), dk)], hs_smem),
                     (vn_ref.at[ib, rows, v_cols], vn_smem)):
      plgpu.copy_gmem_to_smem(src, dst, barrier)
    plgpu.barrier_wait(barrier)
    plgpu.wgmma(acc_ref, aqk_smem, vn_smem)
    plgpu.wgmma(acc_ref, qg_smem, hs_smem)
    plgpu.wgmma_wait(0)
    return acc_ref[...]

  def scoped(qg_smem, aqk_smem, hs_smem, vn_smem, o_smem, barrier):
    acc = pl.run_scoped(
        functools.partial(products, qg_smem, aqk_smem, hs_smem, vn_smem, barrier),
        plgpu.ACC((c, dv), _F32))
    o_smem[...] = acc.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[ib, rows, v_cols])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(scoped, swizzled_smem((c, dk), dtype), swizzled_smem((c, c), dtype),
                swizzled_smem((dk, dv), dtype), swizzled_smem((c, dv), dtype),
                plgpu.SMEM((c, dv), o_ref.dtype), plgpu.Barrier(num_arrivals=4))


def output_fwd(qg, a_qk, hs, v_new, *, heads, chunk_size, out_dtype, interpret=False):
  """O = A_qk V' + qg S_entry for every chunk, as `kernel_state_split.output_fwd`.

  Args:
    qg: [B, Tp, H*K] gated queries; a_qk: [B, H, Tp, C]; hs: [B, H, NC*K, V]
      entry states; v_new: [B, Tp, H*V]; all one 16-bit dtype.
    interpret: False, or a `plgpu.InterpretGPUParams` to run on the CPU.

  Returns:
    o [B, Tp, H*V] in out_dtype.
  """
  check_supported(qg, a_qk, hs, v_new, chunk_size)
  b, tp, hk = qg.shape
  c = chunk_size
  dk, dv = hk // heads, v_new.shape[-1] // heads
  kernel = functools.partial(_kernel, c=c, dk=dk, dv=dv)
  call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((b, tp, heads * dv), out_dtype),
                      grid=(tp // c, heads, b), grid_names=("chunk", "head", "batch"),
                      interpret=interpret or None, kernel_name="kda_output_fwd_mosaic")
  return call(qg, a_qk, hs, v_new)
