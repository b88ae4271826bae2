"""Documents packed into rows through Grain, the trainer's default data path.

    documents -> pieces of at most seq_len targets -> this process's share of a per-epoch
      global shuffle of the pieces -> first-fit packing into rows of seq_len
      -> batches of this process's rows -> background prefetch

A document of n tokens gives n - 1 (input, target) pairs: the pieces of a long
document overlap by one token, so every token but the first is a target exactly
once, and each piece is a document of its own (its state starts from zero). No
target crosses a document. Rows carry `segment_ids` (1, 2, ... per document in
the row, 0 for padding) and `positions` (each token's index in its piece);
`mask` is 1 on every non-padding position.

The shuffle is over pieces, not documents: a document longer than a row would
otherwise fill consecutive rows and batches with its own pieces, and a short
run would see few documents (a byte-level run of 1200 rows of 512 bytes on
the stdlib sources read 34 to 60 of the 545 documents, over three seeds, and
its held-out loss trailed random windows'). The
pieces are laid out from the documents' lengths (`source.lengths` where the
source has them; a prepared directory stores them), so nothing is read to
plan an epoch; a piece reads its document and keeps its slice.

Per process: the pieces of one epoch are shuffled globally (seeded, without
replacement, a new order each epoch) and process p of P takes every P-th of
them, so the processes read disjoint pieces and together one epoch.
Processes that hold the same rows of the global batch (pipeline stages) pass
the same shard and read the same rows. The iterator's whole position is
Grain's state plus the batch count; restoring it replays exactly the batches
an unbroken run would have seen.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Sequence

import grain
import numpy as np

from k3jax.data.batch import make_batch

# Batch keys of packed rows beyond `batch.BATCH_KEYS`, both int32 [B, T].
SEGMENT_KEYS = ("segment_ids", "positions")


@dataclasses.dataclass(frozen=True)
class Packing:
  """How documents become rows.

  Attributes:
    seq_len: T, tokens per row.
    max_documents_per_row: the most documents (pieces) first-fit puts in one
      row; the model's static segment bound is this plus one (the padding run).
    bins: rows filled at once by first-fit (Grain's `num_packing_bins`): more
      bins pack tighter and mix neighbouring epochs at their edge.
    prefetch: batches a background thread prepares ahead (0: none).
  """
  seq_len: int
  max_documents_per_row: int = 8
  bins: int = 64
  prefetch: int = 2

  def __post_init__(self):
    for name in ("seq_len", "max_documents_per_row", "bins"):
      if getattr(self, name) < 1:
        raise ValueError(f"packing {name}={getattr(self, name)} must be >= 1")
    if self.prefetch < 0:
      raise ValueError(f"packing prefetch={self.prefetch} must be >= 0")

  @property
  def max_segments(self) -> int:
    """Runs of equal segment ids a row can hold: its documents and one padding run."""
    return self.max_documents_per_row + 1


def piece(ids_n: np.ndarray, start: int, seq_len: int) -> dict[str, np.ndarray]:
  """The next-token piece of a document [n] from `start`: inputs ids[start : e] and targets
  ids[start + 1 : e + 1], e = min(start + T, n - 1)."""
  end = min(start + seq_len, len(ids_n) - 1)
  ids = np.asarray(ids_n[start:end + 1], np.int32)  # the slice only: documents can be long
  return {"inputs": ids[:-1], "targets": ids[1:]}


def document_pieces(ids_n: np.ndarray, seq_len: int) -> list[dict[str, np.ndarray]]:
  """Splits one document [n] into next-token pieces of at most `seq_len` pairs each, starting
  at 0, T, 2T, ...; a document shorter than 2 tokens gives none."""
  return [piece(ids_n, s, seq_len) for s in range(0, len(ids_n) - 1, seq_len)]


def piece_table(lengths_n: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(document [P], start [P]) int64 of every piece of documents of `lengths_n` tokens, in
  document order (`document_pieces`' pieces)."""
  lengths_n = np.asarray(lengths_n, np.int64)
  counts_n = np.maximum(lengths_n - 1, 0) // seq_len + (np.maximum(lengths_n - 1, 0) % seq_len > 0)
  document_p = np.repeat(np.arange(len(lengths_n), dtype=np.int64), counts_n)
  first_p = np.repeat(np.cumsum(counts_n) - counts_n, counts_n)
  start_p = (np.arange(len(document_p), dtype=np.int64) - first_p) * seq_len
  return document_p, start_p


class _Pieces:
  """Random access to the pieces of `source`'s documents: item p is piece p's dict."""

  def __init__(self, source: Sequence[np.ndarray], seq_len: int):
    lengths = getattr(source, "lengths", None)
    if lengths is None:  # a plain list: read every document once to plan
      lengths = [len(source[i]) for i in range(len(source))]
    self.source, self.seq_len = source, seq_len
    self.document_p, self.start_p = piece_table(lengths, seq_len)

  def __len__(self) -> int:
    return len(self.document_p)

  def __getitem__(self, p: int) -> dict[str, np.ndarray]:
    return piece(self.source[int(self.document_p[p])], int(self.start_p[p]), self.seq_len)


def _rows_to_batch(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Grain's packed features -> the trainer's batch dict (inputs, targets, mask, segment_ids, positions)."""
  segment_ids = packed["inputs_segment_ids"].astype(np.int32)
  batch = make_batch(packed["inputs"], packed["targets"], (segment_ids > 0).astype(np.float32))
  batch["segment_ids"] = segment_ids
  batch["positions"] = packed["inputs_positions"].astype(np.int32)
  return batch


def packed_dataset(source: Sequence[np.ndarray], packing: Packing, *, rows: int, seed: int,
                   shard_index: int = 0, shard_count: int = 1, shuffle: bool = True,
                   epochs: int | None = None) -> grain.IterDataset:
  """The Grain pipeline over `source` (random access, items int [n] documents).

  Args:
    source: documents; `len` and `__getitem__` (a Grain data source or a list), and
      `lengths` [N] where it has them.
    packing: row length and packing options.
    rows: batch rows this process yields.
    seed: seeds the per-epoch document order and the order of packed rows.
    shard_index, shard_count: this process's share of each epoch's order.
    shuffle: False keeps the source order and row order (held-out sets).
    epochs: passes over the documents; None repeats forever.

  Returns:
    An IterDataset of batches {inputs, targets, mask, segment_ids, positions}, each [rows, T].
  """
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count})")
  table = _Pieces(source, packing.seq_len)
  if not len(table):
    raise ValueError(f"the {len(source)} documents hold no (input, target) pair (each has fewer than "
                     "2 tokens)")
  pieces = grain.MapDataset.source(table)
  if shuffle:
    pieces = pieces.seed(seed).shuffle()
  # Sliced after the shuffle, so each epoch's one global order is split between the processes.
  # No read threads: a piece costs microseconds, so a pool only adds overhead; the prefetch
  # thread at the end overlaps the whole pipeline with training.
  pieces = pieces[shard_index::shard_count].repeat(epochs).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  length = {"inputs": packing.seq_len, "targets": packing.seq_len}
  packed = grain.experimental.FirstFitPackIterDataset(
      pieces, length_struct=length, num_packing_bins=packing.bins, seed=seed, shuffle_bins=shuffle,
      max_sequences_per_bin=packing.max_documents_per_row)
  batches = packed.batch(rows, drop_remainder=True).map(_rows_to_batch)
  if packing.prefetch:
    batches = grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=packing.prefetch)
  return batches


def _release(started: list) -> None:
  """Closes and drops the Grain iterator `started` holds, if any."""
  while started:
    iterator = started.pop()
    close = getattr(iterator, "close", None)
    if close is not None:
      close()


class DocumentIterator:
  """This process's rows of each training batch of packed documents; resumable exactly.

  `get_state()` is the position every process shares; `grain_state()` is the
  Grain position of this process's data shard (`shard_key`, "<i>-of-<n>"),
  which the processes holding the same rows share. The trainer saves both
  (`k3jax.train.data_state`).
  """

  def __init__(self, source: Sequence[np.ndarray], packing: Packing, *, global_batch_size: int,
               seed: int, process_index: int = 0, process_count: int = 1):
    if global_batch_size % process_count:
      raise ValueError(f"global batch size {global_batch_size} is not divisible by "
                       f"the process count {process_count}")
    self.seed = seed
    self.position = 0
    self.shard_key = f"{process_index}-of-{process_count}"
    self.rows = global_batch_size // process_count
    self._rows = slice(process_index * self.rows, (process_index + 1) * self.rows)
    self._dataset = packed_dataset(source, packing, rows=self.rows, seed=seed,
                                   shard_index=process_index, shard_count=process_count)
    self._started: list = []  # Grain's iterator once made; a list the exit hook can empty

  @property
  def _iterator(self):
    """Grain's iterator, made on first use: its prefetch thread starts then."""
    if not self._started:
      self._started.append(iter(self._dataset))
      # At exit, before module teardown (where Grain's own finaliser fails noisily), stop the
      # thread and drop the iterator.
      weakref.finalize(self, _release, self._started)
    return self._started[0]

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = next(self._iterator)
    self.position += 1
    return batch

  def local_rows(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's rows of a global batch [global_batch_size, ...] (the held-out set's)."""
    return {k: v[self._rows] for k, v in batch.items()}

  def get_state(self) -> dict[str, int]:
    """{"seed", "position"}: the batches taken so far, the same on every process."""
    return {"seed": int(self.seed), "position": int(self.position)}

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores the shared position saved by `get_state` (Grain's own comes by `set_grain_state`)."""
    if int(state["seed"]) != self.seed:
      raise ValueError(f"data state was saved with seed {state['seed']}, this run uses seed {self.seed}")
    self.position = int(state["position"])

  def grain_state(self) -> dict[str, Any]:
    """This process's Grain iterator state (JSON-serialisable)."""
    return self._iterator.get_state()

  def set_grain_state(self, state: dict[str, Any]) -> None:
    """Moves this process's Grain iterator to a state saved by `grain_state`."""
    self._iterator.set_state(state)

  def close(self) -> None:
    """Stops the prefetch thread and drops Grain's iterator (also done at exit); the
    iterator is not used after this."""
    _release(self._started)


def packed_eval_batches(source: Sequence[np.ndarray], packing: Packing, *, batch_size: int,
                        num_batches: int) -> list[dict[str, np.ndarray]]:
  """The fixed held-out set: `source`'s documents in order, packed, the first `num_batches`
  global batches (the documents repeat when fewer fill them).

  Raises:
    ValueError: the documents hold no (input, target) pair at all.
  """
  packing = dataclasses.replace(packing, prefetch=0)
  iterator = iter(packed_dataset(source, packing, rows=batch_size, seed=0, shuffle=False))
  return [next(iterator) for _ in range(num_batches)]
