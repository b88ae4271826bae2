"""The Mosaic GPU body of `gmm` (`GmmConfig(backend="mosaic_gpu")`) against the
plain-jnp reference: Mosaic GPU's interpreter on the CPU with race detection, and
the compiled kernel in the GPU twins, beside the Triton body on the same inputs."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
# The interpreter's race record has no public name yet.
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

from pallas_kernels.gmm import api, reference
from pallas_kernels.gmm.config import GmmConfig, default_config, with_fields
from pallas_kernels.tools import mosaic_ir
from tests.test_gmm import LAYER_CALLS, _layout, _row_index

# One warpgroup's wgmma takes 64 rows: the smallest tile. Empty groups, one of
# two tiles, one of four, a ragged one and a spare tile.
MOSAIC = GmmConfig(block_m=64, block_n=64, block_k=64, group_m=2, backend="mosaic_gpu")
SIZES = [0, 80, 0, 212, 20, 64]


def _case(rng, sizes, block_m, k, n, source_rows, gathered, dtype):
  """(tiles, lhs, rhs [G, K, N], call kwargs) of a routed layout in `dtype`."""
  tiles, starts = _layout(sizes, block_m)
  m = tiles.num_rows
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
  kw = {}
  if gathered:
    kw = dict(row_index=_row_index(rng, sizes, starts, m, source_rows),
              row_scale=jnp.asarray(rng.uniform(0.5, 1.5, m), jnp.float32))
  lhs = normal(source_rows if gathered else m, k)
  return tiles, lhs, normal(len(sizes), k, n), kw


@pytest.mark.parametrize("gathered", [False, True])
def test_mosaic_gmm_interpret_matches_reference(gathered):
  rng = np.random.default_rng(0)
  tiles, lhs, rhs, kw = _case(rng, SIZES, 64, 128, 64, 300, gathered, jnp.bfloat16)
  params = plgpu.InterpretGPUParams(detect_races=True)
  out = api.gmm(lhs, rhs, tiles, out_dtype=jnp.float32, config=MOSAIC, interpret=params, **kw)
  assert not interpret_pallas_call.get_races().races_found
  want = reference.gmm_reference(lhs, rhs, tiles, **kw)
  # bf16 products are exact in float32; only the order of the sums differs.
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-4, rtol=1e-5)
  pad = np.asarray(reference.row_groups(tiles)) < 0
  if gathered:
    pad |= np.asarray(kw["row_index"]) >= lhs.shape[0]
  np.testing.assert_array_equal(np.asarray(out)[pad], 0.0)


def test_mosaic_gmm_selection_and_limits():
  assert default_config().backend == "triton"
  assert with_fields(["backend=mosaic_gpu"]).backend == "mosaic_gpu"
  with pytest.raises(ValueError, match="backend"):
    GmmConfig(backend="cuda")
  tiles, _ = _layout([64], 64)
  x = jnp.zeros((tiles.num_rows, 64), jnp.bfloat16)
  w = jnp.zeros((1, 64, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="16-bit"):
    api.gmm(x.astype(jnp.float32), w.astype(jnp.float32), tiles, config=MOSAIC, interpret=True)
  with pytest.raises(ValueError, match="transposed rhs"):
    api.gmm(x, w, tiles, transpose_rhs=True, config=MOSAIC, interpret=True)
  tiles32, _ = _layout([64], 32, spare_tiles=2)
  with pytest.raises(ValueError, match="multiple of 64"):
    api.gmm(x, w, tiles32, config=dataclasses.replace(MOSAIC, block_m=32), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("call", [c for c, v in LAYER_CALLS.items()
                                  if v[0] == "gmm" and not v[5]])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_mosaic_gmm_matches_reference_and_triton(call, out_dtype):
  """The layer's untransposed products at its tiles on a routed layout of realistic
  size, against the reference and the Triton body on the same inputs."""
  rng = np.random.default_rng(3)
  gathered = LAYER_CALLS[call][1]
  triton = default_config(jnp.bfloat16)
  tiles, lhs, rhs, kw = _case(rng, [0, 300, 1, 700, 0, 129, 2000, 64], triton.block_m, 384,
                              512, 3000, gathered, jnp.bfloat16)
  rhs = (rhs.astype(jnp.float32) * 384 ** -0.5).astype(jnp.bfloat16)
  mosaic = dataclasses.replace(triton, backend="mosaic_gpu")
  out = api.gmm(lhs, rhs, tiles, out_dtype=out_dtype, config=mosaic, **kw)
  base = api.gmm(lhs, rhs, tiles, out_dtype=out_dtype, config=triton, **kw)
  want = reference.gmm_reference(lhs, rhs, tiles, **kw)
  top = float(jnp.abs(want).max())
  for name, got in (("mosaic_gpu", out), ("triton", base)):
    np.testing.assert_allclose(np.asarray(got, np.float32) / top, np.asarray(want) / top,
                               atol=1e-2, err_msg=f"{call}: {name}")


def test_mosaic_gmm_lowers_for_cuda_on_the_cpu():
  """The kernel lowers for CUDA without a GPU: one warpgroup a block, the rows'
  TMA copies, wgmma on the swizzled tiles (`pallas_kernels.tools.mosaic_ir`),
  the default 128 x 256 tile cut to 128 x 128 (one warpgroup's accumulator)."""
  tiles, _ = _layout([100, 0, 300], 128)
  cfg = dataclasses.replace(default_config(jnp.bfloat16), backend="mosaic_gpu")
  spec = jax.ShapeDtypeStruct
  fn = lambda x, w, index: api.gmm(x, w, tiles, row_index=index, config=cfg)
  lowered = jax.jit(fn).trace(spec((500, 256), jnp.bfloat16), spec((3, 256, 512), jnp.bfloat16),
                              spec((tiles.num_rows,), jnp.int32)).lower(
                                  lowering_platforms=("cuda",))
  (text,) = mosaic_ir.kernel_modules(lowered)
  info = mosaic_ir.summary(text)
  assert info["block"] == (128, 1, 1) and info["wgmma_shapes"] == ["m64n128k16"]
  # The rows, the weights' tile, the tile's row indices and row factors.
  assert info["tma_loads"] == cfg.block_m + 3
  assert 0 < info["smem_bytes"] <= 227 * 1024   # an H100 block's shared memory
