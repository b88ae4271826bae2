"""Reads the Mosaic GPU kernels of a jitted function as lowered for CUDA on any machine.

`jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))` runs Pallas's
Mosaic GPU lowering without a GPU: each kernel becomes a `mosaic_gpu_v2`
custom call carrying its module (MLIR bytecode, dialects renamed with a
`stable_mosaic_gpu.` prefix, undone here) after Mosaic GPU's own lowering: launch
geometry, shared memory, TMA copies, mbarriers and wgmma instructions are
all there. What is not: registers and spills, which ptxas decides when the
CUDA plugin (`_mosaic_gpu_ext` of jax-cuda12/13-plugin) compiles the module
on a machine with a GPU. The parsing reads private modules of jax 0.11.2.
"""
from __future__ import annotations

import re

from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import mosaic_gpu_dialect as mgpu_dialect
from jax._src.lib.mlir import ir
from jax.experimental.mosaic.gpu import core as mgpu_core

# Counted in each module, by a substring of the op or inline-PTX text.
OPS = {
    "wgmma": "wgmma.mma_async",
    "tma_loads": "cp.async.bulk.tensor.shared.cluster.global",
    "tma_stores": "cp.async.bulk.tensor.global.shared",
    "mbarrier_waits": "mbarrier.try_wait",
}


def _walk(op, out):
  for region in op.regions:
    for block in region.blocks:
      for child in block.operations:
        out.append(child)
        _walk(child.operation, out)
  return out


def kernel_modules(lowered) -> list[str]:
  """The text of every Mosaic GPU module in a `jax.stages.Lowered`."""
  module = lowered.compiler_ir("stablehlo")  # held: its ops die with it
  blobs = []
  for op in _walk(module.operation, []):
    if op.operation.name != "stablehlo.custom_call":
      continue
    if "mosaic_gpu" not in str(op.attributes["call_target_name"]):
      continue
    raw = ir.DictAttr(op.attributes["mhlo.backend_config"])["module"]
    blobs.append(bytes(ir.StringAttr(raw).value_bytes))
  texts = []
  for blob in blobs:
    with jax_mlir.make_ir_context() as ctx:
      mgpu_dialect.register_dialect(ctx)
      ctx.allow_unregistered_dialects = True
      module = ir.Module.parse(blob)
      # Undo the serialization's renaming (`stable_mosaic_gpu.` prefixes).
      module = mgpu_core._run_serde_pass(module, serialize=False)
      texts.append(module.operation.get_asm(print_generic_op_form=True))
  return texts


def _constants(text: str) -> dict[str, int]:
  """{SSA name: value} of the module's integer constants."""
  found = re.findall(r'(%\w+) = "[\w.]*arith\.constant"\(\) <?\{value = (-?\d+) : \w+\}', text)
  return {name: int(value) for name, value in found}


def summary(text: str) -> dict:
  """Launch geometry, dynamic shared memory and instruction counts of one module.

  Returns:
    {"grid": (x, y, z), "block": (x, y, z), "smem_bytes": int, "wgmma_shapes":
    sorted distinct wgmma shapes, and one count per `OPS` entry}.
  """
  launch = re.search(r'"[\w.]*gpu\.launch"\(([^)]*)\)', text)
  if launch is None:
    raise ValueError("no gpu.launch in the module")
  # Operands: async token, grid x y z, block x y z, dynamic shared memory bytes.
  names = [s.strip() for s in launch.group(1).split(",")]
  consts = _constants(text)
  values = [consts.get(name) for name in names[1:8]]
  out = {"grid": tuple(values[0:3]), "block": tuple(values[3:6]), "smem_bytes": values[6],
         "wgmma_shapes": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+)\.", text)))}
  out.update({name: text.count(needle) for name, needle in OPS.items()})
  return out
