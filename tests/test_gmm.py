"""The Pallas grouped matmuls (`pallas_kernels.gmm`) against plain-jnp references:
uneven, empty and long groups, gathered and scaled rows, both products and the
weight gradient; interpret mode here, the Triton kernels in the GPU twins."""
import dataclasses

import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels.gmm import api, layout, reference
from pallas_kernels.gmm.config import GmmConfig, default_config, with_fields

SMALL = GmmConfig(block_m=16, block_n=16, block_k=16, wgrad_block=16)


def _layout(sizes, block_m, spare_tiles=1):
  """Groups of `sizes` rows packed on tile boundaries, plus spare (unowned) tiles."""
  padded = layout.round_up(np.asarray(sizes), block_m)
  starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
  num_rows = int(padded.sum()) + spare_tiles * block_m
  tiles = layout.tile_map(jnp.asarray(starts), jnp.asarray(sizes), num_rows, block_m)
  return tiles, starts


def _row_index(rng, sizes, starts, num_rows, source_rows):
  """Each group's rows read random sources; padding rows read the empty sentinel."""
  index = np.full(num_rows, source_rows)
  for start, size in zip(starts, sizes):
    index[start:start + size] = rng.integers(0, source_rows, size)
  return jnp.asarray(index, jnp.int32)


def _operand(rng, gathered, starts, num_rows, width, source_rows):
  """(x, row index, row scale): float32 rows read through a random index and scaled
  when `gathered` (x has `source_rows` rows), else the layout's own rows (None, None)."""
  if not gathered:
    return jnp.asarray(rng.standard_normal((num_rows, width)), jnp.float32), None, None
  x = jnp.asarray(rng.standard_normal((source_rows, width)), jnp.float32)
  index = _row_index(rng, SIZES, starts, num_rows, source_rows)
  return x, index, jnp.asarray(rng.standard_normal(num_rows), jnp.float32)


# Uneven groups, an empty first and a middle one, one group of several tiles.
SIZES = [0, 20, 0, 53, 5, 16]


def test_tile_map_owners_and_counts():
  tiles, _ = _layout(SIZES, 16, spare_tiles=2)
  np.testing.assert_array_equal(tiles.tile_group, [1, 1, 3, 3, 3, 3, 4, 5, -1, -1])
  np.testing.assert_array_equal(tiles.group_tile_count, [0, 2, 0, 4, 1, 1])
  np.testing.assert_array_equal(tiles.group_tile_start, [0, 0, 2, 2, 6, 7])
  with pytest.raises(ValueError, match="multiple of block_m"):
    layout.tile_map(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), 40, 16)


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("gathered", [False, True])
def test_gmm_matches_reference(gathered, transpose_rhs):
  rng = np.random.default_rng(0)
  tiles, starts = _layout(SIZES, 16)
  m, k, n, source_rows = tiles.num_rows, 48, 32, 70
  g = len(SIZES)
  rhs_shape = (g, n, k) if transpose_rhs else (g, k, n)
  rhs = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)
  kw = dict(transpose_rhs=transpose_rhs)
  lhs, index, scale = _operand(rng, gathered, starts, m, k, source_rows)
  if gathered:
    kw.update(row_index=index, row_scale=scale)
  out = api.gmm(lhs, rhs, tiles, config=SMALL, interpret=True, **kw)
  want = reference.gmm_reference(lhs, rhs, tiles, **kw)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)
  # Padding: the spare tile and every empty slot's row are written as zeros.
  np.testing.assert_array_equal(np.asarray(out)[-16:], 0.0)
  if gathered:
    np.testing.assert_array_equal(np.asarray(out)[np.asarray(kw["row_index"]) >= source_rows], 0)


@pytest.mark.parametrize("lhs_gathered, rhs_scaled, block_m, wgrad_rows, wgrad_tile, n", [
    (True, True, 16, 64, (16, None), 48), (False, False, 16, 64, (16, None), 48),
    (True, True, 32, 16, (16, None), 48),
    (True, True, 16, 64, (16, 32), 64),    # [16, 32] result tiles
    (True, False, 16, 64, (32, 16), 48)])  # [32, 16]
def test_tgmm_matches_reference(lhs_gathered, rhs_scaled, block_m, wgrad_rows, wgrad_tile, n):
  rng = np.random.default_rng(1)
  tiles, starts = _layout(SIZES, block_m)
  m, k, source_rows = tiles.num_rows, 32, 70
  kw = {}
  lhs, index, scale = _operand(rng, lhs_gathered, starts, m, k, source_rows)
  if lhs_gathered:
    kw.update(lhs_index=index, lhs_scale=scale)
  rhs = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  if rhs_scaled:
    kw.update(rhs_index=_row_index(rng, SIZES, starts, m, m),
              rhs_scale=jnp.asarray(rng.standard_normal(m), jnp.float32))
  cfg = GmmConfig(block_m=block_m, block_n=16, block_k=16, wgrad_rows=wgrad_rows,
                  wgrad_block=wgrad_tile[0], wgrad_block_n=wgrad_tile[1])
  assert cfg.wgrad_tile(k, n) == (wgrad_tile[0], wgrad_tile[1] or wgrad_tile[0])
  out = api.tgmm(lhs, rhs, tiles, config=cfg, interpret=True, **kw)
  want = reference.tgmm_reference(lhs, rhs, tiles, **kw)
  assert out.shape == (len(SIZES), k, n) and out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-4, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(out)[[0, 2]], 0.0)  # empty groups


def test_config_and_argument_errors():
  tiles, _ = _layout([16, 16], 16)
  x = jnp.zeros((tiles.num_rows, 32))
  w = jnp.zeros((2, 32, 32))
  with pytest.raises(ValueError, match="power of two"):
    GmmConfig(block_n=96)
  with pytest.raises(ValueError, match="wgrad_block"):
    GmmConfig(wgrad_block=96)
  with pytest.raises(ValueError, match="wgrad_block_n"):
    GmmConfig(wgrad_block_n=96)
  with pytest.raises(ValueError, match="wgrad_rows"):
    GmmConfig(wgrad_rows=48)
  # [K, N] result tiles: square by default, each side shrunk to the power of two dividing it.
  assert GmmConfig().wgrad_tile(1536, 1536) == (128, 128)
  assert GmmConfig(wgrad_block_n=256).wgrad_tile(1536, 1536) == (128, 256)
  assert GmmConfig(wgrad_block_n=256).wgrad_tile(96, 768) == (32, 256)
  assert GmmConfig(wgrad_block=64, wgrad_block_n=256).wgrad_tile(1536, 1536) == (64, 256)
  # The heuristic: [128, 256] at 8 warps for 16-bit operands, square 64 for float32.
  assert default_config(jnp.bfloat16).wgrad_tile(1536, 1536) == (128, 256)
  assert default_config(jnp.bfloat16).wgrad_warps == 8
  assert default_config(jnp.float32).wgrad_tile(1536, 1536) == (64, 64)
  # The benchmarks' --gmm_config items over the heuristic.
  assert with_fields(["wgrad_block_n=128", "wgrad_warps=4"]) == GmmConfig(wgrad_block_n=128)
  for bad in ("wgrad_block_n", "no_such_field=4", "wgrad_warps=eight", "wgrad_block_n=96"):
    with pytest.raises(ValueError, match="GmmConfig"):
      with_fields([bad])
  assert GmmConfig(block_m=32, wgrad_rows=64).wgrad_step == 32
  with pytest.raises(ValueError, match="multiple of 16"):
    default_config().fit(40, 32)
  assert default_config().fit(48, 96).block_k == 16 and default_config().fit(48, 96).block_n == 32
  with pytest.raises(ValueError, match="block_m"):
    api.gmm(x, w, tiles, config=GmmConfig(block_m=32), interpret=True)
  with pytest.raises(ValueError, match="share a dtype"):
    api.gmm(x, w.astype(jnp.bfloat16), tiles, config=SMALL, interpret=True)
  with pytest.raises(ValueError, match="groups"):
    api.gmm(x, jnp.zeros((3, 32, 32)), tiles, config=SMALL, interpret=True)
  with pytest.raises(ValueError, match="row_index"):
    api.gmm(x, w, tiles, row_index=jnp.zeros(5, jnp.int32), config=SMALL, interpret=True)
  with pytest.raises(ValueError, match="layout's"):
    api.tgmm(x[:8], x, tiles, config=SMALL, interpret=True)


def test_tile_order_visits_every_tile_once():
  from pallas_kernels.gmm.kernel_gmm import tile_of
  for num_m, num_n, group_m in [(10, 3, 4), (7, 12, 8), (5, 1, 1), (3, 4, 100)]:
    pids = jnp.arange(num_m * num_n)
    i, j = tile_of(pids, num_m, num_n, group_m)
    assert sorted(zip(np.asarray(i).tolist(), np.asarray(j).tolist())) == [
        (a, b) for a in range(num_m) for b in range(num_n)]
    # Within a launch group every column tile of its rows comes before the next group.
    assert np.all(np.diff(np.asarray(i) // group_m) >= 0)


# The five calls of the MoE layer (`k3jax.layers.routed_gmm`), each a GPU twin:
# (gmm or tgmm, lhs gathered, lhs scaled, rhs gathered, rhs scaled, transposed).
LAYER_CALLS = {
    "gate_up: gmm, rows gathered": ("gmm", True, False, False, False, False),
    "out: gmm, plain rows": ("gmm", False, False, False, False, False),
    "dh: gmm, rows gathered and scaled, rhs transposed": ("gmm", True, True, False, False, True),
    "dx: gmm, plain rows, rhs transposed": ("gmm", False, False, False, False, True),
    "dW_out: tgmm, rhs gathered and scaled": ("tgmm", False, False, True, True, False),
    "dW_in: tgmm, lhs gathered": ("tgmm", True, False, False, False, False),
    "tgmm, both gathered and scaled": ("tgmm", True, True, True, True, False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("call", list(LAYER_CALLS))
@pytest.mark.parametrize("dtype, out_dtype", [(jnp.bfloat16, jnp.float32),
                                              (jnp.bfloat16, jnp.bfloat16),
                                              (jnp.float32, jnp.float32)])
def test_gpu_kernel_calls_match_reference(call, dtype, out_dtype):
  """Each operand form the layer uses, on a routed layout of realistic size, with
  float32 results and (products) results in the operands' 16-bit dtype, as the layer
  writes them."""
  _check_layer_call(call, dtype, out_dtype, default_config(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("call", [c for c in LAYER_CALLS if LAYER_CALLS[c][0] == "tgmm"])
def test_gpu_tgmm_with_square_128_result_tiles_matches_reference(call):
  """The weight gradients with square [128, 128] result tiles at 4 warps (the heuristic
  takes [128, 256] at 8; `--gmm_config=wgrad_block_n=128,wgrad_warps=4` selects these)."""
  cfg = dataclasses.replace(default_config(jnp.bfloat16), wgrad_block_n=None, wgrad_warps=4)
  _check_layer_call(call, jnp.bfloat16, jnp.float32, cfg)


def _check_layer_call(call, dtype, out_dtype, cfg):
  kind, lhs_index, lhs_scale, rhs_index, rhs_scale, transpose = LAYER_CALLS[call]
  rng = np.random.default_rng(3)
  sizes = [0, 300, 1, 700, 0, 129, 2000, 64]    # empty, ragged and many-tile groups
  tiles, starts = _layout(sizes, cfg.block_m)
  m, k, n, source_rows = tiles.num_rows, 384, 512, 3000  # n: two 256-wide column tiles
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
  scale = lambda: jnp.asarray(rng.uniform(0.5, 1.5, m), jnp.float32)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  if kind == "gmm":
    kw = {"transpose_rhs": transpose}
    if lhs_index:
      kw["row_index"] = _row_index(rng, sizes, starts, m, source_rows)
    if lhs_scale:
      kw["row_scale"] = scale()
    x = normal(source_rows if lhs_index else m, k)
    w = normal(*((len(sizes), n, k) if transpose else (len(sizes), k, n))) * k ** -0.5
    out = api.gmm(x, w.astype(dtype), tiles, out_dtype=out_dtype, config=cfg, **kw)
    want = reference.gmm_reference(x, w.astype(dtype), tiles, **kw)
  else:
    if out_dtype != jnp.float32:
      pytest.skip("weight gradients are float32")
    kw = {}
    if lhs_index:
      kw["lhs_index"] = _row_index(rng, sizes, starts, m, source_rows)
    if lhs_scale:
      kw["lhs_scale"] = scale()
    if rhs_index:
      kw["rhs_index"] = _row_index(rng, sizes, starts, m, source_rows)
    if rhs_scale:
      kw["rhs_scale"] = scale()
    x = normal(source_rows if lhs_index else m, k)
    y = normal(source_rows if rhs_index else m, n)
    out = api.tgmm(x, y, tiles, config=cfg, **kw)
    want = reference.tgmm_reference(x, y, tiles, **kw)
    np.testing.assert_array_equal(np.asarray(out)[[0, 4]], 0.0)  # empty groups
  top = float(jnp.abs(want).max())
  np.testing.assert_allclose(np.asarray(out, np.float32) / top, np.asarray(want) / top,
                             atol=tol, err_msg=call)


def _swiglu_case(rng, dtype, sizes, cfg, k, n, source_rows, gathered):
  """A routed layout with [gate | up] rows (zero on padding and empty slots, as the
  forward writes them), cotangent rows, weights and the dgrad's index and scale."""
  tiles, starts = _layout(sizes, cfg.block_m)
  m = tiles.num_rows
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
  owned = np.zeros(m, bool)
  for start, size in zip(starts, sizes):
    owned[start:start + size] = True
  gate_up = jnp.where(jnp.asarray(owned)[:, None], normal(m, 2 * n) * 2, 0).astype(dtype)
  kw = {}
  if gathered:
    kw = dict(row_index=_row_index(rng, sizes, starts, m, source_rows),
              row_scale=jnp.asarray(rng.uniform(0.5, 1.5, m), jnp.float32))
  g = normal(source_rows if gathered else m, k)
  w = normal(len(sizes), n, k) * k ** -0.5       # [G, N, K]: the output projection
  return tiles, gate_up, g, w.astype(dtype), kw


def _check_swiglu_kernels(dtype, sizes, cfg, k, n, source_rows, gathered, tol, interpret):
  rng = np.random.default_rng(4)
  tiles, gate_up, g, w, kw = _swiglu_case(rng, dtype, sizes, cfg, k, n, source_rows, gathered)
  # Forward: gmm over silu(gate) * up, fused in the load, against the written activations.
  w_out = w                                       # [G, N, K]: h (width N) -> K
  y = api.gmm(gate_up, w_out, tiles, lhs_swiglu=True, out_dtype=jnp.float32, config=cfg,
              interpret=interpret)
  y_want = reference.gmm_reference(reference.silu_mul_rows(gate_up, dtype), w_out, tiles)
  d_gate_up, h_scaled = api.gmm_swiglu_grad(g, w, gate_up, tiles, config=cfg,
                                            interpret=interpret, **kw)
  d_want, h_want = reference.swiglu_grad_reference(g, w, gate_up, tiles, **kw)
  assert d_gate_up.shape == gate_up.shape and d_gate_up.dtype == gate_up.dtype
  assert h_scaled.shape == (tiles.num_rows, gate_up.shape[1] // 2)
  for name, got, want in (("y", y, y_want), ("d_gate_up", d_gate_up, d_want),
                          ("h_scaled", h_scaled, h_want)):
    top = float(jnp.abs(want).max())
    np.testing.assert_allclose(np.asarray(got, np.float32) / top, np.asarray(want) / top,
                               atol=tol, err_msg=name)
  # Padding rows and empty slots: zero in every result.
  pad = np.asarray(reference.row_groups(tiles)) < 0
  if gathered:
    pad |= np.asarray(kw["row_index"]) >= source_rows
  for got in (y, d_gate_up, h_scaled):
    np.testing.assert_array_equal(np.asarray(got, np.float32)[pad], 0.0)


@pytest.mark.parametrize("gathered", [False, True])
def test_swiglu_fused_gmm_and_grad_match_reference(gathered):
  _check_swiglu_kernels(jnp.float32, SIZES, SMALL, 48, 32, 70, gathered, 1e-5, interpret=True)


def test_swiglu_fused_argument_errors():
  tiles, _ = _layout([16, 16], 16)
  m = tiles.num_rows
  w = jnp.zeros((2, 32, 48))
  with pytest.raises(ValueError, match="odd width"):
    api.gmm(jnp.zeros((m, 33)), w, tiles, lhs_swiglu=True, config=SMALL, interpret=True)
  with pytest.raises(ValueError, match=r"gate_up must be \[M, 2N\]"):
    api.gmm_swiglu_grad(jnp.zeros((m, 48)), w, jnp.zeros((m, 32)), tiles, config=SMALL,
                        interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(jnp.bfloat16, 1e-2), (jnp.float32, 1e-5)])
@pytest.mark.parametrize("gathered", [False, True])
def test_gpu_swiglu_fused_gmm_and_grad_match_reference(dtype, tol, gathered):
  """The two SwiGLU fusions on the Triton kernels, at the layer's tiles and a routed
  layout of realistic size (empty, ragged and many-tile groups)."""
  _check_swiglu_kernels(dtype, [0, 300, 1, 700, 0, 129, 2000, 64], default_config(dtype),
                        384, 256, 3000, gathered, tol, interpret=False)
