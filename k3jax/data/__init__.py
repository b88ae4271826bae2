"""Local, deterministic, resumable data: byte corpus, token files, MQAR."""
from __future__ import annotations

from typing import Any

from k3jax.data.batch import make_batch, windows
from k3jax.data.corpus import BYTE_VOCAB_SIZE, ByteCorpus, stdlib_source_dir
from k3jax.data.iterator import BatchIterator, Dataset
from k3jax.data.mqar import MQARDataset, mqar_examples
from k3jax.data.token_file import TokenFileDataset, open_token_file, write_token_file

DATA_KINDS = ("bytes", "token_file", "mqar")


def make_dataset(data_cfg: Any, *, seed: int) -> Dataset:
  """Builds the dataset named by `data_cfg.kind` from a `config.data` ConfigDict."""
  kind = data_cfg.kind
  if kind == "bytes":
    return ByteCorpus(list(data_cfg.paths), patterns=tuple(data_cfg.patterns),
                      heldout_fraction=data_cfg.heldout_fraction, max_bytes=data_cfg.max_bytes)
  if kind == "token_file":
    return TokenFileDataset(data_cfg.token_file, dtype=data_cfg.token_dtype,
                            vocab_size=data_cfg.vocab_size, heldout_path=data_cfg.heldout_token_file,
                            heldout_fraction=data_cfg.heldout_fraction)
  if kind == "mqar":
    return MQARDataset(vocab_size=data_cfg.vocab_size, num_kv_pairs=data_cfg.mqar_num_kv_pairs,
                       num_queries=data_cfg.mqar_num_queries, seed=seed)
  raise ValueError(f"data.kind must be one of {DATA_KINDS}, got {kind!r}")


__all__ = [
    "BYTE_VOCAB_SIZE", "BatchIterator", "ByteCorpus", "DATA_KINDS", "Dataset", "MQARDataset",
    "TokenFileDataset", "make_batch", "make_dataset", "mqar_examples", "open_token_file",
    "stdlib_source_dir", "windows", "write_token_file",
]
