"""The batch layout every dataset yields, and its validation."""
from __future__ import annotations

import numpy as np

# A batch is a dict of host arrays, all [B, T]:
#   inputs  int32   token ids fed to the model
#   targets int32   the id to predict at each position
#   mask    float32 1 where the position counts in the loss/metrics, else 0
BATCH_KEYS = ("inputs", "targets", "mask")


def make_batch(inputs_bt: np.ndarray, targets_bt: np.ndarray,
               mask_bt: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Packs [B, T] inputs/targets (and optional mask, default all ones) into a batch dict."""
  inputs_bt = np.asarray(inputs_bt, dtype=np.int32)
  targets_bt = np.asarray(targets_bt, dtype=np.int32)
  if mask_bt is None:
    mask_bt = np.ones(inputs_bt.shape, np.float32)
  mask_bt = np.asarray(mask_bt, dtype=np.float32)
  if inputs_bt.ndim != 2 or inputs_bt.shape != targets_bt.shape or inputs_bt.shape != mask_bt.shape:
    raise ValueError(
        f"inputs/targets/mask must share one [B, T] shape, got {inputs_bt.shape}, "
        f"{targets_bt.shape}, {mask_bt.shape}")
  return {"inputs": inputs_bt, "targets": targets_bt, "mask": mask_bt}


def windows(stream: np.ndarray, offsets_b: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
  """Cuts [B, seq_len] next-token windows from a 1-D token stream at the given start offsets.

  `inputs[b] = stream[o_b : o_b + T]`, `targets[b] = stream[o_b + 1 : o_b + T + 1]`.
  Works on memory-mapped streams without reading more than the windows.
  """
  idx_bt = np.asarray(offsets_b, np.int64)[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None]
  seq_bt = np.asarray(stream[idx_bt]).astype(np.int32)
  return make_batch(seq_bt[:, :-1], seq_bt[:, 1:])
