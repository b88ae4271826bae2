"""The data iterator's position in a checkpoint: the batch count, and each data shard's Grain state.

A checkpoint's JSON item holds `{"iterator": {"seed", "position"}}`, and for
packed documents also `{"shards": {"<i>-of-<n>": Grain iterator state}}`: one
entry per data shard (the processes that hold the same rows of the global
batch read the same shard and hold the same state). The entries are keyed by
shard, not by process, so a run resumes on any number of processes that splits
the batch the same way (a pipeline stage per process, then one process, say).
Process 0 writes the item, so every process sends it its shard's state.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
from jax.experimental import multihost_utils

from k3jax.data import DocumentIterator


def _gathered(text: str, nproc: int) -> list[str]:
  """Every process's `text`, in process order (the text itself in a one-process run)."""
  if nproc == 1:
    return [text]
  data = np.frombuffer(text.encode(), np.uint8)
  lengths = multihost_utils.process_allgather(np.array([len(data)], np.int64)).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:len(data)] = data
  rows = multihost_utils.process_allgather(padded).reshape(nproc, -1)
  return [bytes(row[:n]).decode() for row, n in zip(rows, lengths)]


def saved_state(data_it: Any, nproc: int) -> dict[str, Any]:
  """The JSON item of a checkpoint (collective in a multi-process run: every process calls it)."""
  state: dict[str, Any] = {"iterator": data_it.get_state()}
  if isinstance(data_it, DocumentIterator):
    mine = json.dumps({"key": data_it.shard_key, "state": data_it.grain_state()})
    state["shards"] = {e["key"]: e["state"] for e in map(json.loads, _gathered(mine, nproc))}
  return state


def restore_state(data_it: Any, saved: dict[str, Any], where: str) -> None:
  """Moves `data_it` to the position `saved` (a checkpoint's JSON item) holds.

  Raises:
    ValueError: the checkpoint holds no state for this run's data shard, naming what it holds.
  """
  data_it.set_state(saved["iterator"])
  if not isinstance(data_it, DocumentIterator):
    return
  shards = saved.get("shards") or {}
  if data_it.shard_key not in shards:
    held = ", ".join(sorted(shards)) or "none"
    raise ValueError(f"the checkpoint {where} holds the document iterator's state of data shards "
                     f"[{held}], and this run reads shard {data_it.shard_key}: resume with the "
                     "processes splitting the batch as they did (the same parallel layout), or give "
                     "a new run directory")
  data_it.set_grain_state(shards[data_it.shard_key])
