"""Deterministic, resumable batch iterator whose whole position is two integers."""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

_TRAIN_STREAM = 0


class Dataset(Protocol):
  """What the iterator and trainer need from a dataset."""
  vocab_size: int
  eval_metric: str

  def sample(self, rng: np.random.Generator, batch_size: int, seq_len: int) -> dict[str, np.ndarray]: ...

  def eval_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[dict[str, np.ndarray]]: ...


class BatchIterator:
  """Yields training batches; batch i depends only on (seed, i), so resuming is setting i.

  Every process draws the same global batch and keeps its own contiguous rows,
  so multi-host data is consistent with no communication.
  """

  def __init__(self, dataset: Dataset, *, global_batch_size: int, seq_len: int, seed: int,
               process_index: int = 0, process_count: int = 1):
    if global_batch_size % process_count:
      raise ValueError(f"global batch size {global_batch_size} is not divisible by "
                       f"the process count {process_count}")
    self.dataset = dataset
    self.global_batch_size = global_batch_size
    self.seq_len = seq_len
    self.seed = seed
    self.position = 0
    self._rows = slice(process_index * global_batch_size // process_count,
                       (process_index + 1) * global_batch_size // process_count)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self.seed, _TRAIN_STREAM, self.position])
    batch = self.dataset.sample(rng, self.global_batch_size, self.seq_len)
    self.position += 1
    return self.local_rows(batch)

  def local_rows(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's rows of a global batch [global_batch_size, ...] (as `next` yields them)."""
    return {k: v[self._rows] for k, v in batch.items()}

  def close(self) -> None:
    """Nothing runs in the background (the same interface as the document iterator)."""

  def get_state(self) -> dict[str, int]:
    """The checkpointable position: {"seed", "position"}."""
    return {"seed": int(self.seed), "position": int(self.position)}

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores a position saved by `get_state`; the seed must match this iterator's."""
    if int(state["seed"]) != self.seed:
      raise ValueError(f"data state was saved with seed {state['seed']}, this run uses seed {self.seed}")
    if int(state["position"]) < 0:
      raise ValueError(f"data position must be >= 0, got {state['position']}")
    self.position = int(state["position"])
