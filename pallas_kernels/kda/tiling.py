"""Tile-level helpers shared by every KDA implementation.

* `check_lower_bound`: the safety condition of the dense diagonal path.
* `pad_time`: right-pads the time axis to a multiple of the chunk.
* `pack_varlen`: maps packed sequences (cu_seqlens) onto a chunk grid in which
  every sequence starts at a chunk boundary, with static shapes.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

# Largest exponent a dense diagonal factor may reach. float32 and bfloat16
# overflow above exp(88.72); 85 leaves a factor of ~40 for the operands'
# own magnitude (unit-norm k times beta <= 1 in practice).
MAX_EXP_ARG = 85.0


def safe_tile_len(lower_bound: float) -> int:
  """Longest diagonal tile for which `lower_bound` keeps the dense path finite."""
  if lower_bound >= 0:
    raise ValueError(f"lower_bound must be negative, got {lower_bound}")
  return int(math.floor(MAX_EXP_ARG / abs(lower_bound))) + 1


def check_lower_bound(lower_bound: float | None, tile_len: int) -> None:
  """Raises ValueError unless `|lower_bound| * (tile_len - 1) <= MAX_EXP_ARG`.

  A dense diagonal tile of length L anchored at its first row multiplies a
  column operand by up to exp(|g_min| * (L - 1)); above ~88.7 that is inf in
  float32 and bfloat16.
  """
  if lower_bound is None:
    raise ValueError(
        "diagonal='dense' needs lower_bound (g_min of the gate "
        "g = g_min * sigmoid(.)); pass it, or use diagonal='pairwise' for an "
        "unbounded gate.")
  lower_bound = float(lower_bound)
  if not lower_bound < 0:
    raise ValueError(f"lower_bound must be negative, got {lower_bound}")
  if tile_len < 1:
    raise ValueError(f"tile length must be >= 1, got {tile_len}")
  exponent = abs(lower_bound) * (tile_len - 1)
  if exponent > MAX_EXP_ARG:
    raise ValueError(
        f"lower_bound={lower_bound} is unsafe for a dense diagonal tile of "
        f"length {tile_len}: |lower_bound| * (tile_len - 1) = {exponent:.1f} "
        f"exceeds the safe limit {MAX_EXP_ARG} (exp overflows float32/bf16 at "
        f"~88.7). Use a tile of at most {safe_tile_len(lower_bound)} rows, a "
        f"bound of at least {-MAX_EXP_ARG / max(tile_len - 1, 1):.3f}, or "
        "diagonal='pairwise'.")


def pad_time(x: jax.Array, multiple: int, axis: int = 1) -> jax.Array:
  """Right-pads `axis` of `x` with zeros up to a multiple of `multiple`."""
  length = x.shape[axis]
  pad = (-length) % multiple
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


@dataclasses.dataclass(frozen=True)
class VarlenLayout:
  """Where packed tokens live on a chunk grid (all arrays have static shapes).

  Attributes:
    src_index_n: [num_chunks * C] int32, the packed-token index each grid slot
      reads, or `total_len` (a zero row appended by the caller) for padding.
    dst_index_t: [T] int32, the grid slot of each packed token.
    chunk_seq_n: [num_chunks] int32, the sequence id of each chunk (N for
      unused trailing chunks).
    chunk_first_n: [num_chunks] bool, True where a chunk starts a sequence.
    last_chunk_s: [N] int32, the grid chunk that ends each sequence (for
      final states). An empty sequence points at its start chunk and must be
      masked with `empty_s`.
    empty_s: [N] bool, True for zero-length sequences.
  """
  src_index_n: jax.Array
  dst_index_t: jax.Array
  chunk_seq_n: jax.Array
  chunk_first_n: jax.Array
  last_chunk_s: jax.Array
  empty_s: jax.Array
  num_chunks: int


def pack_varlen(cu_seqlens: jax.Array, total_len: int, chunk_size: int) -> VarlenLayout:
  """Lays N packed sequences onto a chunk grid, each starting at a chunk edge.

  Works with traced `cu_seqlens`: the grid has the static upper bound
  ceil(T / C) + N chunks.

  Args:
    cu_seqlens: [N + 1] int, cumulative sequence lengths, starting at 0 and
      ending at `total_len`.
    total_len: T, the packed length.
    chunk_size: C.
  """
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  if cu.ndim != 1 or cu.shape[0] < 2:
    raise ValueError(f"cu_seqlens must be 1-D with >= 2 entries, got shape {cu.shape}")
  num_seqs = cu.shape[0] - 1
  c = chunk_size
  num_chunks = -(-total_len // c) + num_seqs
  lens_s = cu[1:] - cu[:-1]
  chunks_s = (lens_s + c - 1) // c
  chunk_start_s = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(chunks_s)[:-1]])

  # Token t of sequence s sits at grid slot chunk_start_s * C + (t - cu[s]).
  t = jnp.arange(total_len, dtype=jnp.int32)
  seq_t = jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1
  dst_index_t = chunk_start_s[seq_t] * c + (t - cu[seq_t])
  src_index_n = jnp.full((num_chunks * c,), total_len, jnp.int32).at[dst_index_t].set(t)

  chunk = jnp.arange(num_chunks, dtype=jnp.int32)
  chunk_end_s = chunk_start_s + chunks_s
  chunk_seq_n = jnp.searchsorted(chunk_end_s, chunk, side="right").astype(jnp.int32)
  chunk_first_n = jnp.zeros((num_chunks,), bool).at[chunk_start_s].set(chunks_s > 0)
  empty_s = chunks_s == 0
  last_chunk_s = jnp.where(empty_s, chunk_start_s, chunk_end_s - 1)
  return VarlenLayout(src_index_n, dst_index_t, chunk_seq_n, chunk_first_n,
                      jnp.minimum(last_chunk_s, num_chunks - 1), empty_s, num_chunks)
