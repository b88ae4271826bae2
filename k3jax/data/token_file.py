"""Memory-mapped token files (flat uint16/uint32 arrays) for users' own tokenized corpora."""
from __future__ import annotations

import math
import os

import numpy as np

from k3jax.data.batch import windows

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def open_token_file(path: str, dtype: str) -> np.ndarray:
  """Memory-maps a raw little-endian token file as a read-only 1-D array [N]."""
  if dtype not in TOKEN_DTYPES:
    raise ValueError(f"token file dtype must be one of {sorted(TOKEN_DTYPES)}, got {dtype!r}")
  if not os.path.isfile(path):
    raise ValueError(f"token file {path!r} does not exist")
  size = os.path.getsize(path)
  itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
  if size == 0:
    raise ValueError(f"token file {path!r} is empty")
  if size % itemsize:
    raise ValueError(f"token file {path!r} has {size} bytes, not a multiple of {itemsize} ({dtype})")
  return np.memmap(path, dtype=np.dtype(TOKEN_DTYPES[dtype]).newbyteorder("<"), mode="r")


def write_token_file(path: str, tokens, dtype: str) -> None:
  """Writes a 1-D array of token ids [N] as a raw little-endian `dtype` file, checking the range."""
  if dtype not in TOKEN_DTYPES:
    raise ValueError(f"token file dtype must be one of {sorted(TOKEN_DTYPES)}, got {dtype!r}")
  tokens = np.asarray(tokens)
  if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must be a 1-D integer array, got {tokens.dtype}{tokens.shape}")
  info = np.iinfo(TOKEN_DTYPES[dtype])
  if tokens.size and (tokens.min() < 0 or tokens.max() > info.max):
    raise ValueError(f"token ids span [{tokens.min()}, {tokens.max()}], outside {dtype} [0, {info.max}]")
  tokens.astype(np.dtype(TOKEN_DTYPES[dtype]).newbyteorder("<")).tofile(path)


class TokenFileDataset:
  """Random windows from a training token file; a fixed held-out set from a second file or the tail.

  If `heldout_path` is empty, the last `heldout_fraction` of the training file is
  held out and training windows never touch it.
  """
  eval_metric = "loss"

  def __init__(self, path: str, *, dtype: str = "uint16", vocab_size: int,
               heldout_path: str = "", heldout_fraction: float = 0.01):
    if vocab_size <= 0:
      raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    self.vocab_size = vocab_size
    tokens = open_token_file(path, dtype)
    if heldout_path:
      self.train, self.heldout = tokens, open_token_file(heldout_path, dtype)
    else:
      if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
      cut = len(tokens) - int(math.ceil(len(tokens) * heldout_fraction))
      self.train, self.heldout = tokens[:cut], tokens[cut:]

  def check_seq_len(self, seq_len: int) -> None:
    """Raises if either split is too short to cut a window of `seq_len` + 1 tokens."""
    for label, stream in (("train", self.train), ("held-out", self.heldout)):
      if len(stream) < seq_len + 1:
        raise ValueError(f"{label} tokens: {len(stream)} < seq_len + 1 = {seq_len + 1}")

  def _checked(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    top = int(max(batch["inputs"].max(), batch["targets"].max()))
    if top >= self.vocab_size:
      raise ValueError(f"token id {top} in the token file is >= vocab_size {self.vocab_size}")
    return batch

  def sample(self, rng: np.random.Generator, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    """Random training windows [batch_size, seq_len]; only the windows are read from disk."""
    offsets = rng.integers(0, len(self.train) - seq_len, size=batch_size)
    return self._checked(windows(self.train, offsets, seq_len))

  def eval_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[dict[str, np.ndarray]]:
    """Fixed held-out windows, evenly spaced over the held-out tokens."""
    n = batch_size * num_batches
    offsets = np.linspace(0, len(self.heldout) - seq_len - 1, n).astype(np.int64)
    return [self._checked(windows(self.heldout, offsets[i * batch_size:(i + 1) * batch_size], seq_len))
            for i in range(num_batches)]

  @staticmethod
  def metrics_from_loss(mean_nats: float) -> dict[str, float]:
    """Perplexity from the mean cross-entropy in nats per token."""
    return {"perplexity": math.exp(min(mean_nats, 80.0))}
