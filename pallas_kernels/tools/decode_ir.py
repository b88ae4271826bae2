"""Triton IR of the KDA decode kernel, lowered for CUDA (sm_90) on a CPU machine.

`lower_decode_kernel` writes the kernel's Triton IR and returns an entry that
`triton_ir.compile_kernel` takes (registers, spills, SASS; needs `triton`).
Reads the lowering through the same private jax 0.11.2 modules as `triton_ir`.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels.kda import decode
from pallas_kernels.tools import triton_ir


def lower_decode_kernel(out_dir: str, *, batch: int, heads: int, dk: int, dv: int, t_new: int,
                        block_v: int | None = None, num_warps: int | None = None,
                        dtype=jnp.bfloat16) -> dict:
  """Lowers one `decode_step_pallas` call for CUDA and writes its Triton IR.

  Args:
    out_dir: folder for `kda_decode_step.ttir`.
    batch, heads, dk, dv, t_new: B, H, K, V, T_new of q/k/v [B, T_new, H, K/V]
      in `dtype` (g f32 [B, T_new, H, K], state f32 [B, H, K, V]).
    block_v, num_warps: the kernel's tiling (None: its defaults).

  Returns:
    {name, num_warps, num_stages, file, aliases}: `aliases` is the number of
    input/output buffer pairs XLA is told to share (1: the state in place).
  """
  os.makedirs(out_dir, exist_ok=True)
  with triton_ir.capture_cuda_lowering() as (modules, params):
    x = jax.ShapeDtypeStruct((batch, t_new, heads, dk), dtype)
    xv = jax.ShapeDtypeStruct((batch, t_new, heads, dv), dtype)
    g = jax.ShapeDtypeStruct((batch, t_new, heads, dk), jnp.float32)
    beta = jax.ShapeDtypeStruct((batch, t_new, heads), dtype)
    state = jax.ShapeDtypeStruct((batch, heads, dk, dv), jnp.float32)
    step = lambda *a: decode.decode_step_pallas(*a, scale=dk ** -0.5, block_v=block_v,
                                                num_warps=num_warps)
    jax.jit(step, donate_argnums=5).trace(x, x, xv, g, beta, state).lower(
        lowering_platforms=("cuda",))
  if len(modules) != 1 or len(params) != 1:
    raise RuntimeError(f"expected one decode kernel, captured {len(modules)} modules and "
                       f"{len(params)} launches")
  entry = params[0]
  entry["file"] = os.path.join(out_dir, f"{entry['name']}.ttir")
  with open(entry["file"], "w") as f:
    f.write(triton_ir.strip_locations(modules[0]))
  return entry
