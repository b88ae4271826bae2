"""Plain-jnp references of the grouped matmuls, for tests: row by row, in float32."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gmm.layout import TileMap


def row_groups(tiles: TileMap) -> jnp.ndarray:
  """[M] int32 group of every row (-1 for padding tiles)."""
  return jnp.repeat(tiles.tile_group, tiles.block_m)


def gathered(x_rd, index_m=None, scale_m=None):
  """Rows of x through an optional index (zero rows past x's rows), optionally scaled, f32."""
  x = x_rd.astype(jnp.float32)
  if index_m is not None:
    x = jnp.take(x, index_m, axis=0, mode="fill", fill_value=0)
  if scale_m is not None:
    x = x * scale_m.astype(jnp.float32)[:, None]
  return x


def gmm_reference(lhs, rhs, tiles: TileMap, *, row_index=None, row_scale=None,
                  transpose_rhs=False):
  """[M, N] f32: row m times the weights of its tile's group; zero rows on padding tiles."""
  a = gathered(lhs, row_index, row_scale)
  w = rhs.astype(jnp.float32)
  if transpose_rhs:
    w = jnp.swapaxes(w, 1, 2)
  group = row_groups(tiles)
  w_m = w[jnp.maximum(group, 0)]                       # [M, K, N]
  out = jnp.einsum("mk,mkn->mn", a, w_m, precision="highest")
  return jnp.where((group >= 0)[:, None], out, 0.0)


def tgmm_reference(lhs, rhs, tiles: TileMap, *, lhs_index=None, lhs_scale=None,
                   rhs_index=None, rhs_scale=None):
  """[G, K, N] f32: sum over the rows of each group's tiles of lhs_row^T rhs_row."""
  a = gathered(lhs, lhs_index, lhs_scale)
  b = gathered(rhs, rhs_index, rhs_scale)
  group = row_groups(tiles)
  onehot = (group[:, None] == jnp.arange(tiles.num_groups)[None, :]).astype(jnp.float32)
  return jnp.einsum("mg,mk,mn->gkn", onehot, a, b, precision="highest")


def silu_mul_rows(gate_up, dtype):
  """silu(gate) * up of [.., 2K] rows [gate | up], in float32, rounded to dtype, f32."""
  half = gate_up.shape[-1] // 2
  g, u = gate_up[..., :half].astype(jnp.float32), gate_up[..., half:].astype(jnp.float32)
  return (g * jax.nn.sigmoid(g) * u).astype(dtype).astype(jnp.float32)


def swiglu_grad_reference(g, rhs, gate_up, tiles: TileMap, *, row_index=None, row_scale=None,
                          transpose_rhs=True):
  """(d_gate_up [M, 2N], h_scaled [M, N]) f32, as `api.gmm_swiglu_grad` defines them."""
  dh = gmm_reference(g, rhs, tiles, row_index=row_index, row_scale=row_scale,
                     transpose_rhs=transpose_rhs)
  half = gate_up.shape[-1] // 2
  gate, up = gate_up[:, :half].astype(jnp.float32), gate_up[:, half:].astype(jnp.float32)
  sig = jax.nn.sigmoid(gate)
  d_gate_up = jnp.concatenate([dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig], -1)
  h = silu_mul_rows(gate_up, gate_up.dtype)
  if row_scale is not None:
    h = h * row_scale.astype(jnp.float32)[:, None]
  return d_gate_up, h
