"""Lowers the Mosaic GPU kernel bodies for CUDA on a CPU machine and reads their modules.

No GPU needed. For the grouped matmul's forward (`GmmConfig(backend=
"mosaic_gpu")`, rows gathered, at --moe_shape's routed rows in equal groups
aligned to block_m) and the KDA forward's output kernel
(`kernel_output_mosaic`, at --shape, bf16), prints the launch grid and
block, the dynamic shared memory and the counts of wgmma, TMA and mbarrier
instructions of each kernel (`pallas_kernels.tools.mosaic_ir`). Registers
and spills come from ptxas, which runs only where the CUDA plugin compiles
the module (a GPU machine); `--out` keeps each module's text.

  python experiments/bench/inspect_mosaic.py
  python experiments/bench/inspect_mosaic.py --gmm_config=block_n=128 --out=/tmp/mgpu
"""
from __future__ import annotations

import os
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.gmm import api as gmm_api  # noqa: E402
from pallas_kernels.gmm import config as gmm_config  # noqa: E402
from pallas_kernels.gmm import kernel_gmm_mosaic  # noqa: E402
from pallas_kernels.gmm import layout  # noqa: E402
from pallas_kernels.kda import kernel_output_mosaic  # noqa: E402
from pallas_kernels.tools import mosaic_ir  # noqa: E402

_MOE_SHAPE = flags.DEFINE_string("moe_shape", "16,2048,1536,16,2,768",
                                 "B,T,d,E,k,h of the routed layer (default gpu_1b); the "
                                 "product lowered is the gate/up forward [rows, d] x [d, 2h].")
_GMM_CONFIG = flags.DEFINE_list("gmm_config", [], "GmmConfig fields over the bf16 heuristic's "
                                "(backend=mosaic_gpu is set).")
_SHAPE = flags.DEFINE_string("shape", "16x2048x16x128", "BxTxHxD of the KDA output kernel.")
_OUT = flags.DEFINE_string("out", None, "Folder for the modules' text (optional).")


def _gmm_lowered():
  b, t, d, e, k, h = (int(x) for x in _MOE_SHAPE.value.split(","))
  cfg = gmm_config.with_fields([*_GMM_CONFIG.value, "backend=mosaic_gpu"], jnp.bfloat16)
  per_group = layout.round_up(b * t * k // e, cfg.block_m)
  starts = jnp.arange(e, dtype=jnp.int32) * per_group
  tiles = layout.tile_map(starts, jnp.full((e,), b * t * k // e), e * per_group, cfg.block_m)
  fn = lambda x, w, index: gmm_api.gmm(x, w, tiles, row_index=index, config=cfg)
  spec = jax.ShapeDtypeStruct
  args = (spec((b * t, d), jnp.bfloat16), spec((e, d, 2 * h), jnp.bfloat16),
          spec((tiles.num_rows,), jnp.int32))
  return f"gmm fwd, rows gathered ({kernel_gmm_mosaic.fit_tiles(cfg)})", jax.jit(fn).trace(*args).lower(
      lowering_platforms=("cuda",))


def _kda_output_lowered():
  b, t, h, d = (int(x) for x in _SHAPE.value.split("x"))
  c = 64
  fn = lambda *a: kernel_output_mosaic.output_fwd(*a, heads=h, chunk_size=c,
                                                  out_dtype=jnp.bfloat16)
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  args = (spec(b, t, h * d), spec(b, h, t, c), spec(b, h, t // c * d, d), spec(b, t, h * d))
  return f"kda output_fwd B{b} T{t} H{h} D{d}", jax.jit(fn).trace(*args).lower(
      lowering_platforms=("cuda",))


def main(argv):
  del argv
  for i, (label, lowered) in enumerate((_gmm_lowered(), _kda_output_lowered())):
    for j, text in enumerate(mosaic_ir.kernel_modules(lowered)):
      print(f"{label}: {mosaic_ir.summary(text)}", flush=True)
      if _OUT.value:
        os.makedirs(_OUT.value, exist_ok=True)
        with open(os.path.join(_OUT.value, f"kernel{i}_{j}.mlir"), "w", encoding="utf-8") as f:
          f.write(text)


if __name__ == "__main__":
  app.run(main)
