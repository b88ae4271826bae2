"""Triton IR and SASS of the Pallas kernels, read on a CPU machine (no GPU).

`lower_kernels` lowers the KDA forward+VJP for CUDA (sm_90) and captures
each pallas_call's Triton IR (`lower_program` does so for any jitted
program); `compile_kernel` (needs the `triton` package, which is not a
dependency) compiles one for sm_90a and reports registers, spills and the
SASS mix. The front end is `experiments/bench/inspect_triton.py`,
whose docstring has the commands and caveats. Reads the lowering through
private modules of jax 0.11.2 (`jax._src.pallas.triton`).
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import subprocess

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import gpu_info
from jax._src.pallas.triton import pallas_call_registration as reg

from pallas_kernels.kda import pallas_op
from pallas_kernels.kda.spec import KdaSpec

SASS_KEYS = ("BAR", "STS", "LDS", "LDSM", "HGMMA", "HMMA", "MUFU", "LDL", "STL", "LDG", "STG")
_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)")


def lower_kernels(out_dir: str, shape: tuple[int, int, int, int], diagonal: str = "dense",
                  overrides: dict | None = None, fused_gate: bool = False,
                  sub_chunk: int = 16) -> list[dict]:
  """Lowers the bf16 forward+VJP for CUDA (sm_90) and writes each kernel's Triton IR.

  The kernels are those `api.chunk_kda` runs on a traced gate: on the dense
  diagonal, the clamped gate cumsums (`kernel_cumsum.clamped_cumsum`).

  Args:
    out_dir: folder for `NN_<kernel>.ttir` files and `kernels.json`.
    shape: (B, T, H, D) with K = V = D.
    overrides: KernelConfig fields (`bench.parse_overrides` output).
    fused_gate: lower with gate_activation="bounded_sigmoid" (a bf16 gate
      pre-activation and an [H, K] bias in place of the f32 log-decay).
    sub_chunk: L, the diagonal tile (the dense diagonal's bound is scaled
      to the largest one L allows).

  Returns:
    One dict per pallas_call, in launch order: name, num_warps, num_stages,
    file (the .ttir path). Source locations are stripped, so a compiler's
    line info points at lines of the .ttir file itself.
  """
  b, t, h, d = shape
  bound = -5.0 if sub_chunk <= 16 else -80.0 / (sub_chunk - 1)
  spec = KdaSpec(sub_chunk=sub_chunk, diagonal=diagonal, lower_bound=bound,
                 implementation="pallas")
  gate = dict(gate_activation="bounded_sigmoid") if fused_gate else {}

  def loss(q, k, v, g, beta, *bias):
    # As `api.chunk_kda` runs a traced gate: the dense path clamps it inside the cumsums.
    o, _ = pallas_op.chunk_kda_pallas(q, k, v, g, beta, spec=spec, scale=d ** -0.5,
                                      backend="triton", config_overrides=overrides,
                                      gate_bias=bias[0] if bias else None,
                                      clamp_gates=diagonal == "dense" and not fused_gate,
                                      **gate)
    return jnp.sum(o.astype(jnp.float32) ** 2)

  qkv = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  g_dtype = jnp.bfloat16 if fused_gate else jnp.float32
  args = (qkv, qkv, qkv, jax.ShapeDtypeStruct((b, t, h, d), g_dtype),
          jax.ShapeDtypeStruct((b, t, h), jnp.bfloat16))
  if fused_gate:
    args += (jax.ShapeDtypeStruct((h, d), jnp.float32),)
  return lower_program(out_dir, jax.grad(loss, argnums=tuple(range(len(args)))), args)


def lower_program(out_dir: str, fn, args) -> list[dict]:
  """Lowers `jax.jit(fn)` on `args` (ShapeDtypeStructs) for CUDA (sm_90) and
  writes each pallas_call's Triton IR; returns `lower_kernels`' entries.

  Any program of Pallas kernels in their Triton form: `lower_kernels` builds
  the KDA training step; `experiments/bench/inspect_triton.py --op=moe` the
  routed experts' grouped matmuls (which must be called with interpret=False).
  """
  os.makedirs(out_dir, exist_ok=True)
  with capture_cuda_lowering() as (modules, params):
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  for entry in params:
    del entry["aliases"]
  if len(modules) != len(params):
    raise RuntimeError(f"captured {len(modules)} modules but {len(params)} launches")
  for i, (asm, entry) in enumerate(zip(modules, params)):
    entry["file"] = os.path.join(out_dir, f"{i:02d}_{entry['name']}.ttir")
    with open(entry["file"], "w") as f:
      f.write(strip_locations(asm))
  with open(os.path.join(out_dir, "kernels.json"), "w") as f:
    json.dump(params, f, indent=1)
  return params


@contextlib.contextmanager
def capture_cuda_lowering():
  """Lowers for an H200 (sm_90) without a GPU and records each pallas_call.

  Yields (modules, params), filled while the block lowers a program for
  CUDA: the Triton IR text of each kernel, and per launch {name, num_warps,
  num_stages, aliases} (aliases: input/output buffer pairs XLA shares).
  """
  modules, params = [], []
  saved = (reg.gpu_info_lib.get_gpu_info, reg.lowering.lower_jaxpr_to_triton_module,
           reg.mlir.custom_call)

  def lower(*args, **kwargs):
    result = saved[1](*args, **kwargs)
    modules.append(result.module.operation.get_asm())
    return result

  def custom_call(*args, backend_config=None, operand_output_aliases=None, **kwargs):
    if isinstance(backend_config, dict) and "num_warps" in backend_config:
      params.append(dict(name=ir.StringAttr(backend_config["name"]).value,
                         num_warps=ir.IntegerAttr(backend_config["num_warps"]).value,
                         num_stages=ir.IntegerAttr(backend_config["num_stages"]).value,
                         aliases=len(operand_output_aliases or {})))
    return saved[2](*args, backend_config=backend_config,
                    operand_output_aliases=operand_output_aliases, **kwargs)

  # No GPU here: name the target, and record what the lowering hands to XLA.
  reg.gpu_info_lib.get_gpu_info = lambda: gpu_info.GpuInfo(
      gpu_version=gpu_info.GpuVersion.H200, arch_name="9.0", compute_capability=90)
  reg.lowering.lower_jaxpr_to_triton_module = lower
  reg.mlir.custom_call = custom_call
  try:
    yield modules, params
  finally:
    (reg.gpu_info_lib.get_gpu_info, reg.lowering.lower_jaxpr_to_triton_module,
     reg.mlir.custom_call) = saved


def strip_locations(asm: str) -> str:
  """Drops MLIR `loc(...)` annotations and `#loc` aliases from an IR dump."""
  lines = []
  for line in asm.splitlines():
    if line.startswith("#loc"):
      continue
    while (start := line.find(" loc(")) >= 0:
      depth, end = 0, start + 4
      for end in range(start + 4, len(line)):       # the matching parenthesis
        depth += {"(": 1, ")": -1}.get(line[end], 0)
        if depth == 0:
          break
      line = line[:start] + line[end + 1:]
    lines.append(line)
  return "\n".join(lines) + "\n"


def sass_counts(sass: str) -> collections.Counter:
  """Opcode counts (without modifiers) of a cuobjdump/nvdisasm listing."""
  return collections.Counter(m.group(1) for m in map(_SASS_OP.match, sass.splitlines()) if m)


def _ttir_passes(path: str, options: dict) -> str:
  """The Triton-IR module at `path` after the CUDA backend's `make_ttir` passes."""
  from triton._C.libtriton import ir as tir  # optional: GPU hosts only  # pylint: disable=g-import-not-at-top
  from triton.backends.compiler import GPUTarget  # optional: GPU hosts only  # pylint: disable=g-import-not-at-top
  from triton.backends.nvidia.compiler import CUDABackend  # optional: GPU hosts only  # pylint: disable=g-import-not-at-top

  backend = CUDABackend(GPUTarget("cuda", 90, 32))
  context = tir.context()
  tir.load_dialects(context)
  backend.load_dialects(context)
  module = tir.parse_mlir_module(path, context)
  module.context = context
  backend.make_ttir(module, {}, backend.parse_options(options), 90)
  return str(module)


def compile_kernel(entry: dict, attribute: bool = False) -> str:
  """Compiles one captured kernel for sm_90a; returns a one-line report.

  Writes .ptx, .cubin and .sass beside the .ttir file. With `attribute`, the
  report gains one line per Triton IR operation type with its SASS counts.
  """
  import triton  # optional: GPU hosts only  # pylint: disable=g-import-not-at-top
  from triton.backends.compiler import GPUTarget  # optional: GPU hosts only  # pylint: disable=g-import-not-at-top

  tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
  options = dict(num_warps=entry["num_warps"], num_stages=entry["num_stages"])
  base = entry["file"].rsplit(".", 1)[0]
  # triton.compile skips the Triton-IR passes for an IR file; XLA runs them
  # (among them the fold of `acc + dot(a, b, 0)` into dot(a, b, acc)), so
  # run them first, or the SASS shows an accumulator pass that XLA's has not.
  optimized = base + ".opt.ttir"
  with open(optimized, "w") as f:
    f.write(_ttir_passes(entry["file"], options))
  kernel = triton.compile(optimized, target=GPUTarget("cuda", 90, 32), options=options)
  with open(base + ".ptx", "w") as f:
    f.write(kernel.asm["ptx"])
  with open(base + ".cubin", "wb") as f:
    f.write(kernel.asm["cubin"])
  ptxas = subprocess.run([os.path.join(tools, "ptxas"), "-v", "-arch=sm_90a", base + ".ptx",
                          "-o", os.devnull], capture_output=True, text=True, check=True).stderr
  regs = re.search(r"Used (\d+) registers", ptxas)
  spill = re.search(r"(\d+) bytes spill stores", ptxas)
  sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-g", "-c", base + ".cubin"],
                        capture_output=True, text=True, check=True).stdout
  with open(base + ".sass", "w") as f:
    f.write(sass)
  counts = sass_counts(sass)
  report = (f"{entry['name']:20s} warps={entry['num_warps']} regs={regs and regs.group(1)} "
            f"spill_bytes={spill and spill.group(1)} smem={kernel.metadata.shared} "
            f"sass={sum(counts.values())} " + " ".join(f"{k}={counts[k]}" for k in SASS_KEYS))
  if attribute:
    with open(entry["file"]) as f:
      report += "\n" + attribute_by_op(sass, f.read().splitlines())
  return report


def attribute_by_op(sass: str, ttir_lines: list[str], top: int = 20) -> str:
  """SASS counts per Triton IR operation type (op name and result tensor type),
  using the line info that points into the stripped .ttir file."""
  def op_type(line_no):
    if not 0 < line_no <= len(ttir_lines):
      return "?"
    text = ttir_lines[line_no - 1]
    extern = re.search(r'symbol = "(\w+)"', text)
    op = extern or re.search(r'"?([a-z_]+\.[a-z_]+)"?', text)
    tensor = re.search(r"tensor<([0-9x]+x[a-z0-9]+)", text)
    return (op.group(1) if op else "?") + (f" {tensor.group(1)}" if tensor else "")

  per_op = collections.defaultdict(collections.Counter)
  line_no = 0
  for line in sass.splitlines():
    loc = re.search(r"line (\d+)", line)
    if loc and line.strip().startswith("//"):
      line_no = int(loc.group(1))
      continue
    m = _SASS_OP.match(line)
    if m:
      per_op[op_type(line_no)].update([m.group(1), "ALL"])
  rows = sorted(per_op.items(), key=lambda kv: -kv[1]["ALL"])[:top]
  keys = ("BAR", "STS", "LDS", "LDSM", "HGMMA", "MUFU")
  lines = []
  for name, c in rows:
    lines.append(f"  {name:36s} all={c['ALL']:5d} "
                 + " ".join(f"{k}={c[k]}" for k in keys if c[k]))
  return "\n".join(lines)
