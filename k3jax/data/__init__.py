"""Local, deterministic, resumable data: packed documents (bytes or prepared), token files, MQAR."""
from __future__ import annotations

import math
from typing import Any

from k3jax.data.batch import make_batch, windows
from k3jax.data.corpus import BYTE_VOCAB_SIZE, ByteCorpus, stdlib_source_dir
from k3jax.data.documents import (SEGMENT_KEYS, DocumentIterator, Packing, packed_dataset,
                                  packed_eval_batches)
from k3jax.data.iterator import BatchIterator, Dataset
from k3jax.data.mqar import MQARDataset, mqar_examples
from k3jax.data.prepared import PreparedData
from k3jax.data.token_file import TokenFileDataset, open_token_file, write_token_file
from k3jax.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

DATA_KINDS = ("bytes", "prepared", "token_file", "mqar")
PACKINGS = ("documents", "windows")
# The kinds whose data are documents; the others are one stream (token_file) or synthetic rows (mqar).
DOCUMENT_KINDS = ("bytes", "prepared")


class PreparedDocuments:
  """A prepared-data directory as the trainer's dataset (documents only; held-out loss in nats/token)."""
  eval_metric = "loss"

  def __init__(self, path: str):
    self.data = PreparedData(path)
    self.vocab_size = self.data.vocab_size

  def documents(self, split: str):
    """The documents of "train" or "heldout", int32 ids each (a Grain random-access source)."""
    return self.data.source(split)

  def tokenizer(self) -> Tokenizer:
    return self.data.tokenizer()

  def check_seq_len(self, seq_len: int) -> None:
    del seq_len  # packing takes documents of any length

  @staticmethod
  def metrics_from_loss(mean_nats: float) -> dict[str, float]:
    """Perplexity from the mean cross-entropy in nats per token."""
    return {"perplexity": math.exp(min(mean_nats, 80.0))}


def make_dataset(data_cfg: Any, *, seed: int) -> Any:
  """Builds the dataset named by `data_cfg.kind` from a `config.data` ConfigDict."""
  kind = data_cfg.kind
  if kind == "bytes":
    return ByteCorpus(list(data_cfg.paths), patterns=tuple(data_cfg.patterns),
                      heldout_fraction=data_cfg.heldout_fraction, max_bytes=data_cfg.max_bytes)
  if kind == "prepared":
    return PreparedDocuments(data_cfg.path)
  if kind == "token_file":
    return TokenFileDataset(data_cfg.token_file, dtype=data_cfg.token_dtype,
                            vocab_size=data_cfg.vocab_size, heldout_path=data_cfg.heldout_token_file,
                            heldout_fraction=data_cfg.heldout_fraction)
  if kind == "mqar":
    return MQARDataset(vocab_size=data_cfg.vocab_size, num_kv_pairs=data_cfg.mqar_num_kv_pairs,
                       num_queries=data_cfg.mqar_num_queries, seed=seed)
  raise ValueError(f"data.kind must be one of {DATA_KINDS}, got {kind!r}")


def is_packed(data_cfg: Any) -> bool:
  """Whether `config.data` trains on packed documents (rows with segment ids)."""
  return data_cfg.kind in DOCUMENT_KINDS and data_cfg.packing == "documents"


def packing_of(data_cfg: Any, seq_len: int) -> Packing:
  """The packing options of `config.data` for rows of `seq_len` tokens."""
  return Packing(seq_len=seq_len, max_documents_per_row=data_cfg.max_documents_per_row,
                 bins=data_cfg.packing_bins, prefetch=data_cfg.prefetch)


def model_segments(data_cfg: Any, seq_len: int) -> int | None:
  """The static segment bound the model is called with (None: the model sees no segment ids)."""
  if not (is_packed(data_cfg) and data_cfg.reset_at_boundaries):
    return None
  return packing_of(data_cfg, seq_len).max_segments


def make_iterator(dataset: Any, data_cfg: Any, *, global_batch_size: int, seq_len: int, seed: int,
                  process_index: int = 0, process_count: int = 1):
  """The training iterator: packed documents (`DocumentIterator`) or sampled rows (`BatchIterator`).

  Both yield this process's rows of each global batch and save their position
  with `get_state` / `set_state`; the document iterator also has a per-process
  `grain_state`.
  """
  if is_packed(data_cfg):
    return DocumentIterator(dataset.documents("train"), packing_of(data_cfg, seq_len),
                            global_batch_size=global_batch_size, seed=seed,
                            process_index=process_index, process_count=process_count)
  return BatchIterator(dataset, global_batch_size=global_batch_size, seq_len=seq_len, seed=seed,
                       process_index=process_index, process_count=process_count)


def make_eval_batches(dataset: Any, data_cfg: Any, *, batch_size: int, seq_len: int,
                      num_batches: int) -> list[dict]:
  """The fixed held-out set as global batches [batch_size, seq_len] (packed like training)."""
  if is_packed(data_cfg):
    return packed_eval_batches(dataset.documents("heldout"), packing_of(data_cfg, seq_len),
                               batch_size=batch_size, num_batches=num_batches)
  return dataset.eval_batches(batch_size, seq_len, num_batches)


__all__ = [
    "BYTE_VOCAB_SIZE", "BatchIterator", "ByteCorpus", "ByteTokenizer", "DATA_KINDS", "DOCUMENT_KINDS",
    "Dataset", "DocumentIterator", "MQARDataset", "PACKINGS", "Packing", "PreparedData",
    "PreparedDocuments", "SEGMENT_KEYS", "TokenFileDataset", "Tokenizer", "is_packed",
    "load_tokenizer", "make_batch", "make_dataset", "make_eval_batches", "make_iterator",
    "model_segments", "mqar_examples", "open_token_file", "packed_dataset", "packing_of",
    "stdlib_source_dir", "windows", "write_token_file",
]
