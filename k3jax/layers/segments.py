"""Documents packed in a row: the runs of equal segment ids, and the masks the layers need.

A batch of packed rows carries `segment_ids` int32 [B, T]: equal nonzero ids
form one contiguous document, 0 marks padding. Every maximal run of equal ids
in a row (a padding run included) is its own segment, so a row's layout is
its run starts. Static shapes need a bound M on the runs of any row
(`max_segments`); a row with more runs keeps its first M - 1 and merges the
rest into the last one (its documents then see each other), and is counted
in `overflow_b` so the caller can report it.

    segments = Segments.from_ids(segment_ids_bt, max_segments)
    KDA:       offsets_bm where the convs restart, run_bt as chunk_kda's segment_ids
    attention: attention_mask_b1tt(), or offsets_bm as cuDNN's packed layout (packed_attention)
    MoE:       token_mask_bt() (padding takes no expert)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Where the trainer's bound comes from, named in the error of a traced call without one.
_TRAINER_BOUND = "data.max_documents_per_row + 1"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
  """The runs of equal segment ids of a batch of packed rows (a pytree of arrays).

  Attributes:
    ids_bt: [B, T] int32 segment ids (0: padding).
    run_bt: [B, T] int32 run index of each token in its row, in [0, M); runs
      past the M-th count as the last one. The masks compare runs, not ids,
      so two runs of one id in a row stay apart.
    offsets_bm: [B, M + 1] int32 per-row cu_seqlens: the start of each run,
      then T for the unused entries (rises from 0 to T).
    overflow_b: [B] bool, rows with more than M runs.
  """

  ids_bt: jax.Array
  run_bt: jax.Array
  offsets_bm: jax.Array
  overflow_b: jax.Array

  @classmethod
  def from_ids(cls, segment_ids_bt, max_segments: int | None = None) -> "Segments":
    """Builds the layout of `segment_ids_bt` [B, T] int with at most `max_segments` runs a row.

    `max_segments` None counts the runs of concrete ids exactly; traced ids
    need it given (static shapes).
    """
    ids = jnp.asarray(segment_ids_bt)
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer) or ids.shape[1] < 1:
      raise ValueError(f"segment_ids must be an int array [B, T] with T >= 1, got "
                       f"{ids.dtype}{ids.shape}")
    if max_segments is None:
      max_segments = count_max_runs(segment_ids_bt)
    if isinstance(max_segments, bool) or not isinstance(max_segments, int) or max_segments < 1:
      raise ValueError(f"max_segments={max_segments!r}; must be a static int >= 1")
    ids = ids.astype(jnp.int32)
    batch, length = ids.shape
    start_bt = jnp.concatenate([jnp.ones((batch, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    runs_bt = jnp.cumsum(start_bt, axis=1, dtype=jnp.int32) - 1
    # Starts of runs past the M-th write nowhere (index M + 1 is out of range).
    slot_bt = jnp.where(start_bt & (runs_bt < max_segments), runs_bt, max_segments + 1)
    rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    offsets_bm = jnp.full((batch, max_segments + 1), length, jnp.int32).at[rows, slot_bt].set(
        positions, mode="drop")
    return cls(ids_bt=ids, run_bt=jnp.minimum(runs_bt, max_segments - 1), offsets_bm=offsets_bm,
               overflow_b=runs_bt[:, -1] >= max_segments)

  @classmethod
  def of_left_padding(cls, valid_bt: jax.Array) -> "Segments":
    """The runs of left-padded prompts (valid_bt [B, T] bool, False on the padding): at
    most two a row, the padding (id 0), then the prompt."""
    return cls.from_ids(jnp.asarray(valid_bt).astype(jnp.int32), 2)

  @property
  def max_segments(self) -> int:
    """M, the static bound on runs per row."""
    return self.offsets_bm.shape[-1] - 1

  def token_mask_bt(self) -> jax.Array:
    """[B, T] bool, True for document tokens, False for padding (id 0)."""
    return self.ids_bt != 0

  def attention_mask_b1tt(self) -> jax.Array:
    """[B, 1, T, T] bool: query t may attend key s when s <= t and both lie in one run."""
    same = self.run_bt[:, None, :, None] == self.run_bt[:, None, None, :]
    length = self.run_bt.shape[1]
    return same & jnp.tril(jnp.ones((length, length), bool))

  def overflow_rows(self) -> jax.Array:
    """Rows with more runs than M, a float32 scalar (0 when every row fits)."""
    return jnp.sum(self.overflow_b.astype(jnp.float32))


def count_max_runs(segment_ids_bt) -> int:
  """The most runs of equal ids in any row of concrete `segment_ids_bt` [B, T]."""
  if isinstance(segment_ids_bt, jax.core.Tracer):
    raise ValueError("segment_ids are traced, so the runs per row cannot be counted: pass "
                     f"max_segments=... (a static bound; the trainer passes {_TRAINER_BOUND})")
  ids = np.asarray(segment_ids_bt)
  return int(1 + np.max(np.sum(ids[:, 1:] != ids[:, :-1], axis=1), initial=0))


def for_tokens(tokens_bt: jax.Array, segment_ids_bt, max_segments: int | None):
  """`Segments.from_ids` for a batch of tokens [B, T]; None without segment ids
  (`max_segments` is then unused)."""
  if segment_ids_bt is None:
    return None
  if tuple(jnp.shape(segment_ids_bt)) != tuple(tokens_bt.shape):
    raise ValueError(f"segment_ids shape {tuple(jnp.shape(segment_ids_bt))} must equal the "
                     f"tokens' {tuple(tokens_bt.shape)}")
  return Segments.from_ids(segment_ids_bt, max_segments)


def overflow_aux(segments: Segments | None) -> dict:
  """The aux entry `segments/overflow_rows` (rows past max_segments); {} without segments."""
  if segments is None:
    return {}
  return {"segments/overflow_rows": segments.overflow_rows()}
