"""Held-out loss by position in the document, each document run alone from its first token.

Every arm of the documents sweep is scored the same way: a row holds one
held-out document's first `seq_len + 1` tokens (padding after a shorter one),
so position t of a row is token t of its document and nothing precedes it, as
when a model meets a new document at inference. The rows carry segment ids
(the document, then padding), so packed rows with the reset would score the
same (`tests/test_segments.py`).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from k3jax.data import make_batch, make_dataset

# Positions [0, FIRST) are a document's opening, where earlier text could leak in.
FIRST = 64
# The segment bound of a row: the document and the padding after it.
_RUNS_PER_ROW = 2


def documents_alone(documents, seq_len: int, num_rows: int) -> dict[str, np.ndarray]:
  """Rows [num_rows, seq_len] of the first documents with 2 or more tokens, each alone.

  Keys: inputs, targets, mask (1 on a document's pairs) and segment_ids (1 there, 0 after).
  """
  rows = []
  for i in range(len(documents)):
    ids = np.asarray(documents[i][:seq_len + 1], np.int32)
    if len(ids) > 1:
      rows.append(ids)
    if len(rows) == num_rows:
      break
  if not rows:
    raise ValueError("no held-out document has 2 or more tokens")
  seq = np.zeros((len(rows), seq_len + 1), np.int32)
  mask = np.zeros((len(rows), seq_len), np.float32)
  for r, ids in enumerate(rows):
    seq[r, :len(ids)] = ids
    mask[r, :len(ids) - 1] = 1.0
  batch = make_batch(seq[:, :-1], seq[:, 1:], mask)
  batch["segment_ids"] = mask.astype(np.int32)
  return batch


@functools.partial(jax.jit, static_argnums=0)
def _nll_bt(graphdef, state, inputs_bt, segment_ids_bt, targets_bt):
  model = nnx.merge(graphdef, state)
  logits_btv, _ = model(inputs_bt, segment_ids=segment_ids_bt, max_segments=_RUNS_PER_ROW,
                        deterministic=True)
  return optax.softmax_cross_entropy_with_integer_labels(logits_btv, targets_bt)


def loss_by_position(model, config: Any, *, num_rows: int = 64, batch_rows: int = 16,
                     first: int = FIRST) -> dict[str, float]:
  """Mean held-out nats per token over positions [0, first) and [first, seq_len) of each document.

  Args:
    model: a trained `HybridLM`.
    config: its trainer config (data source and seq_len).
    num_rows: held-out documents scored (the first ones with 2 or more tokens).
    batch_rows: rows per model call.

  Returns:
    {"first", "rest", "all": mean nats; "tokens_first", "tokens_rest": counts}.
  """
  dataset = make_dataset(config.data, seed=config.seed)
  batch = documents_alone(dataset.documents("heldout"), config.seq_len, num_rows)
  graphdef, state = nnx.split(model)
  nll = np.concatenate([
      np.asarray(_nll_bt(graphdef, state, batch["inputs"][i:i + batch_rows],
                         batch["segment_ids"][i:i + batch_rows], batch["targets"][i:i + batch_rows]))
      for i in range(0, len(batch["inputs"]), batch_rows)])
  mask = batch["mask"]
  opening = np.zeros_like(mask)
  opening[:, :first] = 1.0
  parts = {"first": mask * opening, "rest": mask * (1.0 - opening), "all": mask}
  out = {name: float((nll * m).sum() / max(m.sum(), 1.0)) for name, m in parts.items()}
  out["tokens_first"], out["tokens_rest"] = float(parts["first"].sum()), float(parts["rest"].sum())
  return out
