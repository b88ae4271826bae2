"""Lowers the Pallas kernels for CUDA on a CPU machine and reads their SASS.

No GPU needed. The Triton lowering of every kernel in one jitted forward+VJP
(`--op=kda`: chunked KDA; `--op=moe`: the routed experts' grouped matmuls,
`k3jax.layers.routed_gmm`, on a dropless plan) is captured as Triton IR (one
`.ttir` file per pallas_call, with its warps and pipeline stages in
`kernels.json`). With `--compile`, a separately installed
`triton` package (not a dependency of this project; its wheel carries ptxas,
cuobjdump and nvdisasm) compiles each file for sm_90a and prints, per kernel,
the registers per thread, the spilled bytes and counts of the SASS
instructions that matter here: barriers and shared-memory traffic (layout
conversions), HGMMA (wgmma), MUFU (exp2), local loads and stores (spills).
`--attribute` adds, for the kernels matched by `--kernels`, the instruction
counts per Triton IR operation type. The functions live in
`pallas_kernels/tools/triton_ir.py`.

  python experiments/bench/inspect_triton.py --out=/tmp/ttir
  python experiments/bench/inspect_triton.py --out=/tmp/ttir --compile --attribute \\
      --kernels=intra_bwd_k --overrides=warps.intra_bwd_k=8
  python experiments/bench/inspect_triton.py --op=moe --out=/tmp/moe --compile --kernels=tgmm \\
      --gmm_config=wgrad_block_n=256,wgrad_warps=8

The commands with `--compile` need `triton` installed next to the project's stack
(`pip install triton==3.6.0`, the version on the H200 image).

Caveats: this runs pip Triton's pass pipeline, not the one inside the GPU
jaxlib plugin, so figures can differ from the real build (registers matched
Nsight Compute's for most kernels on 2026-12-01; spill bytes did not track
the measured times). It reads the lowering through private modules of
jax 0.11.2 (`jax._src.pallas.triton`). Use it to compare variants, then time
them on the GPU (`tune_kda.py`).
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys

from absl import app
from absl import flags

# Run from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_OUT = flags.DEFINE_string("out", None, "Folder for the .ttir files and kernels.json.")
_SHAPE = flags.DEFINE_string("shape", "16x2048x16x128", "BxTxHxD (K = V = D) the kernels are "
                             "lowered for (only shapes are used, no arrays are made).")
_DIAGONAL = flags.DEFINE_enum("diagonal", "dense", ["dense", "pairwise"], "Diagonal strategy.")
_OVERRIDES = flags.DEFINE_list("overrides", [], "KernelConfig fields, as bench_kernels.py "
                               "--overrides (e.g. warps.intra_bwd_k=8).")
_COMPILE = flags.DEFINE_bool("compile", False, "Compile each kernel with the installed triton "
                             "package and print registers, spills and the SASS mix.")
_KERNELS = flags.DEFINE_string("kernels", ".", "Regex on kernel names to compile.")
_SUB = flags.DEFINE_integer("sub_chunk", 16, "Diagonal tile length L.")
_FUSED_GATE = flags.DEFINE_bool("fused_gate", False, "Lower with the gate activation fused "
                                "into the gate cumsums (gate_activation='bounded_sigmoid').")
_ATTRIBUTE = flags.DEFINE_bool("attribute", False, "Also count SASS instructions per Triton IR "
                               "operation type (needs --compile).")
_OP = flags.DEFINE_enum("op", "kda", ["kda", "moe"], "The program lowered: chunked KDA (--shape, "
                        "--diagonal, --overrides) or the routed experts (--moe_shape, --gmm_config).")
_MOE_SHAPE = flags.DEFINE_string("moe_shape", "16,2048,1536,16,2,768",
                                 "--op=moe: B,T,d,E,k,h (experts E, top-k k, expert hidden h; "
                                 "default the gpu_1b layer).")
_GMM_CONFIG = flags.DEFINE_list("gmm_config", [], "--op=moe: GmmConfig fields over the bf16 "
                                "heuristic's, name=int (e.g. wgrad_block_n=256,wgrad_warps=8).")


def _lower_moe(out_dir: str):
  """The bf16 routed experts' forward+VJP (`routed_gmm`, dropless, tiles of --gmm_config)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from k3jax.layers import moe_dispatch, routed_gmm  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gmm import config as gmm_config  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tools import triton_ir  # pylint: disable=g-import-not-at-top
  try:
    b, t, d, e, k, h = (int(x) for x in _MOE_SHAPE.value.split(","))
    cfg = gmm_config.with_fields(_GMM_CONFIG.value, jnp.bfloat16)
  except (ValueError, TypeError) as err:
    raise app.UsageError(f"--moe_shape is B,T,d,E,k,h and --gmm_config name=int GmmConfig "
                         f"fields: {err}") from err
  n = b * t

  def loss(x, w, wi_gate, wi_up, wo, idx):
    plan = moe_dispatch.plan_slots(idx, w > 0, e, None, align=cfg.block_m)
    y = routed_gmm.routed_swiglu_gmm(x, w, wi_gate, wi_up, wo, plan, dtype=jnp.bfloat16,
                                     config=cfg, interpret=False)
    return jnp.sum(y ** 2)

  spec = jax.ShapeDtypeStruct
  args = (spec((n, d), jnp.bfloat16), spec((n, k), jnp.float32), spec((e, d, h), jnp.float32),
          spec((e, d, h), jnp.float32), spec((e, h, d), jnp.float32), spec((n, k), jnp.int32))
  return triton_ir.lower_program(out_dir, jax.grad(loss, argnums=(0, 1, 2, 3, 4)), args)


def main(argv):
  del argv
  if not _OUT.value:
    raise app.UsageError("--out is required (a folder for the Triton IR files)")
  from pallas_kernels.tools import bench  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tools import triton_ir  # pylint: disable=g-import-not-at-top
  if _OP.value == "moe":
    entries = _lower_moe(_OUT.value)
  else:
    shape = tuple(int(x) for x in _SHAPE.value.split("x"))
    if len(shape) != 4:
      raise app.UsageError(f"--shape must be BxTxHxD, got {_SHAPE.value!r}")
    entries = triton_ir.lower_kernels(_OUT.value, shape, _DIAGONAL.value,
                                      bench.parse_overrides(_OVERRIDES.value) or None,
                                      fused_gate=_FUSED_GATE.value, sub_chunk=_SUB.value)
  for entry in entries:
    print(f"{entry['name']:20s} warps={entry['num_warps']} stages={entry['num_stages']} "
          f"{entry['file']}")
  if not _COMPILE.value:
    return
  if importlib.util.find_spec("triton") is None:
    raise app.UsageError("--compile needs the triton package (with its NVIDIA backend) in "
                         "this Python environment; it is not a dependency of k3jax")
  print()
  for entry in entries:
    if re.search(_KERNELS.value, entry["name"]):
      print(triton_ir.compile_kernel(entry, attribute=_ATTRIBUTE.value), flush=True)


if __name__ == "__main__":
  app.run(main)
