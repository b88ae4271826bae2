"""Tile-level helpers shared by every KDA implementation.

* `pad_time`: right-pads the time axis to a multiple of the chunk.
* `pack_varlen`: maps packed sequences (cu_seqlens) onto a chunk grid in which
  every sequence starts at a chunk boundary, with static shapes.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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


@dataclasses.dataclass(frozen=True)
class RunMasks:
  """Where the state restarts inside the chunks of a fixed-length grid (`segment_ids`).

  A run is a maximal stretch of equal segment ids in a row; the state starts
  each run from zero, except the row's first run, which starts from the
  initial state. With run_i the run of position i of a chunk:

  Attributes:
    run_bnc: [B, Nc, C] int32 run index of each position in its row.
    same_bncc: [B, Nc, C, C] bool, run_i == run_j: the intra-chunk matrices
      A_kk and A_qk keep only same-run pairs (so (I + A_kk)^-1 is
      block-diagonal by run).
    carry_bnc: [B, Nc, C] bool, position i still belongs to the run live
      before the chunk (no run starts in [chunk start, i]): only these rows
      read the incoming state (the w_i S and q_i e^{G_i} S terms).
    last_bnc: [B, Nc, C] bool, run_i == run of the chunk's last position:
      only these rows write the state leaving the chunk, whose carried part
      e^{G_last} S survives only when the last position carries it
      (carry_bnc[..., -1]).
  """
  run_bnc: jax.Array
  same_bncc: jax.Array
  carry_bnc: jax.Array
  last_bnc: jax.Array


def run_index(segment_ids_bt: jax.Array) -> jax.Array:
  """[B, T] int32 run index of each position in its row (0 for the first
  run; +1 wherever the id differs from the previous position's)."""
  ids = jnp.asarray(segment_ids_bt)
  start_bt = jnp.concatenate([jnp.zeros_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]],
                             axis=1)
  return jnp.cumsum(start_bt, axis=1, dtype=jnp.int32)


def run_masks(segment_ids_bt: jax.Array, chunk_size: int) -> RunMasks:
  """The masks of `segment_ids_bt` [B, T] on the grid of ceil(T / C) chunks.

  Padding positions past T continue the row's last run: they carry zero
  gates and zero writes, so they leave its final state as it is.
  """
  run_bt = run_index(segment_ids_bt)
  b, t_len = run_bt.shape
  c = chunk_size
  pad = (-t_len) % c
  run_bt = jnp.pad(run_bt, ((0, 0), (0, pad)), mode="edge")
  run_bnc = run_bt.reshape(b, -1, c)
  # The run live before each chunk: that of the previous chunk's last
  # position (run 0, the initial state's, before the first chunk).
  before_bn = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), run_bnc[:, :-1, -1]], axis=1)
  return RunMasks(run_bnc=run_bnc, same_bncc=run_bnc[..., :, None] == run_bnc[..., None, :],
                  carry_bnc=run_bnc == before_bn[..., None],
                  last_bnc=run_bnc == run_bnc[..., -1:])
