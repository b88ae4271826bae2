"""Byte-level text corpus over local files, split by document into train and held-out.

Every byte is a token (vocabulary 256); documents are joined with a NUL byte,
which does not occur in source text. The default corpus is the Python standard
library's own source tree, located at run time, so real text exists on every
machine with no download.
"""
from __future__ import annotations

import fnmatch
import math
import os
import sysconfig
import zlib

import numpy as np

from k3jax.data.batch import windows
from k3jax.data.tokenizer import ByteTokenizer

BYTE_VOCAB_SIZE = 256
DOC_SEPARATOR = 0
# Directories never read: installed third-party code and caches are not the stdlib.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", ".git"})


def stdlib_source_dir() -> str:
  """The directory holding the running Python's standard-library sources."""
  path = sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__)
  if not os.path.isdir(path):
    path = os.path.dirname(os.__file__)
  return path


def list_documents(paths: list[str] | tuple[str, ...], patterns: tuple[str, ...]) -> list[tuple[str, str]]:
  """Lists (absolute path, stable name) of matching files under `paths`, sorted by name.

  A path may be a file (taken as is) or a directory (walked recursively in sorted
  order, keeping files whose base name matches one of `patterns`). The stable
  name is the path relative to its root, so the split does not depend on where
  the tree is installed.
  """
  docs = []
  for root in paths:
    if not os.path.exists(root):
      raise ValueError(f"corpus path {root!r} does not exist")
    if os.path.isfile(root):
      docs.append((os.path.abspath(root), os.path.basename(root)))
      continue
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
      for name in sorted(filenames):
        if any(fnmatch.fnmatch(name, p) for p in patterns):
          full = os.path.join(dirpath, name)
          docs.append((full, os.path.relpath(full, root)))
  docs.sort(key=lambda d: d[1])
  return docs


def is_heldout(name: str, heldout_fraction: float) -> bool:
  """Deterministic document split: a stable hash of the name, not a random draw."""
  return (zlib.crc32(name.encode("utf-8")) % 10_000) < round(heldout_fraction * 10_000)


class StreamDocuments:
  """Random access to the documents of a NUL-joined stream (views, no copies): a Grain source.

  Document i is `stream[starts[i] : starts[i + 1] - 1]` (the separator left out).
  """

  def __init__(self, stream: np.ndarray, starts: np.ndarray):
    self.stream, self.starts = stream, starts

  def __len__(self) -> int:
    return len(self.starts) - 1

  def __getitem__(self, i: int) -> np.ndarray:
    return self.stream[self.starts[i]:self.starts[i + 1] - 1]

  @property
  def lengths(self) -> np.ndarray:
    """[N] int64, each document's length."""
    return np.diff(self.starts) - 1


class ByteCorpus:
  """Train and held-out byte streams over local text files, and their documents.

  Attributes:
    train: uint8 [N_train] concatenated training documents.
    heldout: uint8 [N_heldout] concatenated held-out documents.
    train_names / heldout_names: the documents in each split.
  """
  vocab_size = BYTE_VOCAB_SIZE
  eval_metric = "bpb"

  def __init__(self, paths: list[str] | tuple[str, ...] | None = None, *,
               patterns: tuple[str, ...] = ("*.py",), heldout_fraction: float = 0.05,
               max_bytes: int = 0):
    """Reads the corpus.

    Args:
      paths: files/directories to read; None or empty means the stdlib source tree.
      patterns: base-name globs kept when walking directories.
      heldout_fraction: share of documents (by stable name hash) held out, in (0, 1).
      max_bytes: if > 0, stop reading once the two splits hold this many bytes
        in total (documents are visited in sorted-name order, so this is deterministic).
    """
    if not 0.0 < heldout_fraction < 1.0:
      raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    paths = list(paths) if paths else [stdlib_source_dir()]
    docs = list_documents(paths, tuple(patterns))
    if not docs:
      raise ValueError(f"no files matching {tuple(patterns)} under {paths}")
    parts = {False: [], True: []}
    names = {False: [], True: []}
    total = 0
    for full, name in docs:
      with open(full, "rb") as f:
        data = f.read()
      if not data:
        continue
      held = is_heldout(name, heldout_fraction)
      parts[held].append(np.frombuffer(data, np.uint8))
      names[held].append(name)
      total += len(data) + 1
      if max_bytes and total >= max_bytes and parts[False] and parts[True]:
        break
    for held, label in ((False, "train"), (True, "held-out")):
      if not parts[held]:
        raise ValueError(
            f"the {label} split of the corpus under {paths} is empty ({len(docs)} matching "
            f"files, {sum(len(p) for p in parts[not held])} bytes in the other split); "
            "add documents or change heldout_fraction")
    self.train_names, self.heldout_names = names[False], names[True]
    self.train, self._train_starts = self._join(parts[False])
    self.heldout, self._heldout_starts = self._join(parts[True])

  @staticmethod
  def _join(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The NUL-joined stream and each document's start offset, then the stream's end."""
    sep = np.array([DOC_SEPARATOR], np.uint8)
    starts = np.concatenate([[0], np.cumsum([len(a) + 1 for a in arrays])]).astype(np.int64)
    return np.concatenate([x for a in arrays for x in (a, sep)]), starts

  @staticmethod
  def tokenizer() -> ByteTokenizer:
    """Every byte is a token."""
    return ByteTokenizer()

  def documents(self, split: str) -> StreamDocuments:
    """The documents of "train" or "heldout", each a uint8 view [n] of its bytes."""
    if split not in ("train", "heldout"):
      raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if split == "train":
      return StreamDocuments(self.train, self._train_starts)
    return StreamDocuments(self.heldout, self._heldout_starts)

  def check_seq_len(self, seq_len: int) -> None:
    """Raises if either split is too short to cut a window of `seq_len` + 1 bytes."""
    for label, stream in (("train", self.train), ("held-out", self.heldout)):
      if len(stream) < seq_len + 1:
        raise ValueError(f"{label} split has {len(stream)} bytes, fewer than seq_len + 1 = {seq_len + 1}")

  def sample(self, rng: np.random.Generator, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    """Random training windows: a batch of [batch_size, seq_len]."""
    offsets = rng.integers(0, len(self.train) - seq_len, size=batch_size)
    return windows(self.train, offsets, seq_len)

  def eval_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[dict[str, np.ndarray]]:
    """The fixed held-out evaluation set: windows evenly spaced over the held-out stream."""
    n = batch_size * num_batches
    offsets = np.linspace(0, len(self.heldout) - seq_len - 1, n).astype(np.int64)
    return [windows(self.heldout, offsets[i * batch_size:(i + 1) * batch_size], seq_len)
            for i in range(num_batches)]

  @staticmethod
  def metrics_from_loss(mean_nats: float) -> dict[str, float]:
    """Bits per byte from the mean cross-entropy in nats per byte."""
    return {"bpb": mean_nats / math.log(2.0)}
