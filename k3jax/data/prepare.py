"""Tokenizes documents once into a prepared-data directory that the trainer reads by document.

Layout of `<out>/` (read by `k3jax.data.prepared.PreparedData`):

  train-00000-of-00001.array_record    one record per document: its ids, little-endian
  heldout-00000-of-00001.array_record  uint16 when the vocabulary fits, else uint32
  train-lengths.npy, heldout-lengths.npy  int64 tokens of each document, in the order the
                                       shards hold them (the loader cuts pieces without reading)
  tokenizer.json (or .model)           the tokenizer, copied (none for bytes)
  manifest.json                        written last; counts, tokenizer digest, options

A document is a text file, one JSONL line's field or one parquet row's column.
It goes to the held-out split by a stable hash of its key (`corpus.is_heldout`):
the file's path relative to its input root, plus `:<line>` or `:<row>` (from 1).
The same inputs and options give byte-identical files. Everything is written to
`<out>.partial-<pid>` and renamed to `<out>` at the end, so a killed run leaves
no directory that the reader accepts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import multiprocessing
import os
import re
import shutil
from typing import Iterator, Sequence

import numpy as np
from array_record.python import array_record_module
from tqdm.auto import tqdm

from k3jax.data.corpus import is_heldout, list_documents
from k3jax.data.tokenizer import Tokenizer, read_text

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: per-split document lengths
MANIFEST_FILE = "manifest.json"
SPLITS = ("train", "heldout")
PARTIAL_INFIX = ".partial-"
# One record per chunk: the trainer's global shuffle reads single documents at random.
_WRITER_OPTIONS = "group_size:1"
_DEFAULT_PATTERNS = {"text": ("*.py",), "jsonl": ("*.jsonl",), "parquet": ("*.parquet",)}
_CHUNKSIZE = 16  # documents per task sent to a worker


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
  """What `prepare` reads and how it splits and writes it; all of it goes into the manifest.

  Attributes:
    patterns: base-name globs kept when walking input directories (files named
      directly are always read); None: "*.py" for text, "*.jsonl", "*.parquet".
    jsonl_field: read JSONL files, one document per line, from this string field.
    parquet_column: read parquet files, one document per row, from this string column.
    heldout_fraction: share of documents held out, in (0, 1).
    shards: array_record files per split (fewer when a split has fewer documents).
    add_eos: append the tokenizer's eos to every document; None: when it has one.
  """
  patterns: tuple[str, ...] | None = None
  jsonl_field: str | None = None
  parquet_column: str | None = None
  heldout_fraction: float = 0.05
  shards: int = 1
  add_eos: bool | None = None

  @property
  def input_format(self) -> str:
    return "jsonl" if self.jsonl_field else "parquet" if self.parquet_column else "text"

  def resolved(self, tokenizer: Tokenizer) -> PrepareOptions:
    """These options checked, with the defaults that depend on the input kind or tokenizer filled in."""
    if self.jsonl_field and self.parquet_column:
      raise ValueError(f"give either jsonl_field ({self.jsonl_field!r}) or parquet_column "
                       f"({self.parquet_column!r}), not both: one run reads one input kind")
    if not 0.0 < self.heldout_fraction < 1.0:
      raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
    if self.shards < 1:
      raise ValueError(f"shards must be >= 1, got {self.shards}")
    if self.add_eos and tokenizer.eos_id is None:
      raise ValueError(f"add_eos is set but the {tokenizer.kind} tokenizer has no eos token; "
                       "drop add_eos or use a tokenizer with an eos (e.g. <eos> or </s>)")
    patterns = tuple(self.patterns) if self.patterns else _DEFAULT_PATTERNS[self.input_format]
    add_eos = tokenizer.eos_id is not None if self.add_eos is None else self.add_eos
    return dataclasses.replace(self, patterns=patterns, add_eos=add_eos)


def token_dtype(vocab_size: int) -> str:
  """The narrowest stored id type that holds every id below `vocab_size`."""
  return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_name(split: str, index: int, count: int) -> str:
  return f"{split}-{index:05d}-of-{count:05d}.array_record"


def lengths_name(split: str) -> str:
  return f"{split}-lengths.npy"


def partial_dir(out: str) -> str:
  """Where a run writes before the final rename to `out`."""
  return f"{out}{PARTIAL_INFIX}{os.getpid()}"


def _jsonl_documents(path: str, name: str, field: str) -> Iterator[tuple[str, str | None]]:
  with open(path, "r", encoding="utf-8", errors="replace") as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{line_no}"
      try:
        record = json.loads(line)
      except ValueError as e:
        raise ValueError(f"{where} is not valid JSON ({e}); fix or drop the line") from None
      if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where} has no field {field!r} (it has {keys}); pass the field that "
                         "holds the text as --jsonl_field")
      text = record[field]
      if text is not None and not isinstance(text, str):
        raise ValueError(f"{where}: field {field!r} holds a {type(text).__name__}, not a string")
      yield f"{name}:{line_no}", text


def _parquet_documents(path: str, name: str, column: str) -> Iterator[tuple[str, str | None]]:
  try:
    import pyarrow.parquet as pq  # optional: only parquet input needs it (the `data` extra)
  except ImportError:
    raise ValueError("parquet input needs pyarrow: pip install pyarrow (or pip install -e \".[data]\")") from None
  parquet = pq.ParquetFile(path)
  if column not in parquet.schema_arrow.names:
    raise ValueError(f"{path} has no column {column!r} (it has {parquet.schema_arrow.names}); pass the "
                     "column that holds the text as --parquet_column")
  row = 0
  for batch in parquet.iter_batches(columns=[column], batch_size=1024):
    for text in batch.column(0).to_pylist():
      row += 1
      if text is not None and not isinstance(text, str):
        raise ValueError(f"{path} row {row}: column {column!r} holds a {type(text).__name__}, not a string")
      yield f"{name}:{row}", text


def iter_documents(inputs: Sequence[str], options: PrepareOptions) -> Iterator[tuple[str, str | None, bool]]:
  """(key, text or None, had invalid UTF-8) of every document, in a fixed order (sorted files)."""
  files = list_documents(list(inputs), tuple(options.patterns))
  if not files:
    raise ValueError(f"no files matching {tuple(options.patterns)} under {list(inputs)}; give other "
                     "inputs or --patterns")
  for path, name in files:
    if options.input_format == "text":
      text, replaced = read_text(path)
      yield name, text, replaced
    elif options.input_format == "jsonl":
      yield from ((key, text, False) for key, text in _jsonl_documents(path, name, options.jsonl_field))
    else:
      yield from ((key, text, False) for key, text in _parquet_documents(path, name, options.parquet_column))


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
  global _worker_tokenizer
  _worker_tokenizer = tokenizer


def _encode_task(item: tuple[str, str]) -> tuple[str, np.ndarray]:
  key, text = item
  return key, _worker_tokenizer.encode(text)


def _encoded(tokenizer: Tokenizer, items: Iterator[tuple[str, str]], workers: int) -> Iterator[tuple[str, np.ndarray]]:
  """(key, ids int32 [N]) per item, in input order, encoded by `workers` processes."""
  if workers == 1:
    yield from ((key, tokenizer.encode(text)) for key, text in items)
    return
  # spawn, not fork: the parent may run threads (JAX, the tokenizers library's pool) that fork would break.
  with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer,)) as pool:
    yield from pool.imap(_encode_task, items, chunksize=_CHUNKSIZE)


class _SplitWriter:
  """Writes one split's documents round-robin over up to `shards` files, opened as they are needed."""

  def __init__(self, directory: str, split: str, shards: int, dtype: str):
    self.directory, self.split, self.shards = directory, split, shards
    self.dtype = np.dtype(dtype).newbyteorder("<")
    self.writers: list = []
    self.lengths: list[list[int]] = []  # per shard, in write order
    self.documents = 0
    self.tokens = 0

  def _tmp_path(self, index: int) -> str:
    return os.path.join(self.directory, f"{self.split}-{index:05d}.tmp")

  def write(self, ids: np.ndarray) -> None:
    index = self.documents % self.shards
    if index == len(self.writers):
      self.writers.append(array_record_module.ArrayRecordWriter(self._tmp_path(index), _WRITER_OPTIONS))
      self.lengths.append([])
    self.writers[index].write(ids.astype(self.dtype).tobytes())
    self.lengths[index].append(len(ids))
    self.documents += 1
    self.tokens += len(ids)

  def close(self) -> tuple[list[str], str]:
    """Closes the files, names them `<split>-i-of-n.array_record` and writes the documents'
    lengths in the shards' order; returns (shard names, lengths file name)."""
    names = []
    for index, writer in enumerate(self.writers):
      writer.close()
      names.append(shard_name(self.split, index, len(self.writers)))
      os.replace(self._tmp_path(index), os.path.join(self.directory, names[-1]))
    lengths = lengths_name(self.split)
    np.save(os.path.join(self.directory, lengths),
            np.asarray([n for shard in self.lengths for n in shard], np.int64))
    return names, lengths


def _checked_ids(key: str, ids: np.ndarray, tokenizer: Tokenizer) -> np.ndarray:
  """The document's ids after the one range check every id gets."""
  if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tokenizer.vocab_size):
    bad = int(ids.max()) if int(ids.max()) >= tokenizer.vocab_size else int(ids.min())
    raise ValueError(f"document {key!r}: token id {bad} is outside the {tokenizer.kind} tokenizer's "
                     f"vocabulary [0, {tokenizer.vocab_size}) ({tokenizer.file_name}); the tokenizer "
                     "is inconsistent: retrain it or pass another tokenizer")
  return ids


def _non_empty(inputs, options: PrepareOptions, counts: dict) -> Iterator[tuple[str, str]]:
  """(key, text) of the documents with text, counting the others and the invalid UTF-8 ones."""
  for key, text, replaced in iter_documents(inputs, options):
    counts["invalid_utf8_documents"] += replaced
    if text:
      yield key, text
    else:
      counts["empty_texts"] += 1


def _write_documents(encoded, writers: dict[str, _SplitWriter], tokenizer: Tokenizer,
                     options: PrepareOptions, counts: dict) -> None:
  """Checks each encoded document, appends eos if asked and writes it to its split."""
  eos = np.array([tokenizer.eos_id] if options.add_eos else [], np.int32)
  for key, ids in encoded:
    if not ids.size:
      counts["empty_encodings"] += 1
      continue
    ids = _checked_ids(key, ids, tokenizer)
    counts["max_id"] = max(counts["max_id"], int(ids.max()), int(eos.max(initial=-1)))
    split = "heldout" if is_heldout(key, options.heldout_fraction) else "train"
    writers[split].write(np.concatenate([ids, eos]))


def _write_splits(inputs, tokenizer: Tokenizer, options: PrepareOptions, directory: str,
                  workers: int, show_progress: bool) -> dict:
  """Encodes and writes every document; returns the manifest's counts."""
  dtype = token_dtype(tokenizer.vocab_size)
  writers = {split: _SplitWriter(directory, split, options.shards, dtype) for split in SPLITS}
  # With a pool, `_non_empty` runs in the pool's feeder thread: it alone counts the first two keys.
  counts = {"invalid_utf8_documents": 0, "empty_texts": 0, "empty_encodings": 0, "max_id": -1}
  # closing: an error stops the worker pool at once, not when the traceback is freed.
  # leave=False: the bar is gone before the binary prints its summary or its error paragraph;
  # disable=None: no bar where stderr is not a terminal (a log file).
  with contextlib.closing(_encoded(tokenizer, _non_empty(inputs, options, counts), workers)) as encoded, \
       tqdm(encoded, desc="encode", unit="doc", leave=False, disable=None if show_progress else True,
            dynamic_ncols=True) as bar:
    _write_documents(bar, writers, tokenizer, options, counts)
  _check_splits(writers, options)
  counts["splits"] = {}
  for split, writer in writers.items():
    shards, lengths = writer.close()
    counts["splits"][split] = {"documents": writer.documents, "tokens": writer.tokens,
                               "shards": shards, "lengths": lengths}
  return counts


def _check_splits(writers: dict[str, _SplitWriter], options: PrepareOptions) -> None:
  for split, writer in writers.items():
    if not writer.documents:
      total = sum(w.documents for w in writers.values())
      raise ValueError(f"the {split} split is empty: all {total} non-empty documents fell in the other "
                       f"split at heldout_fraction={options.heldout_fraction}; add more documents or "
                       "change the held-out fraction (--heldout_fraction)")


def _manifest(inputs, tokenizer: Tokenizer, options: PrepareOptions, counts: dict) -> dict:
  return {
      "format_version": FORMAT_VERSION,
      "tokenizer": {"kind": tokenizer.kind, "file": tokenizer.file_name, "sha256": tokenizer.sha256,
                    "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id,
                    "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id},
      "token_dtype": token_dtype(tokenizer.vocab_size),
      "splits": counts["splits"],
      "max_id": counts["max_id"],
      "heldout_fraction": options.heldout_fraction,
      "add_eos": options.add_eos,
      "empty_documents": counts["empty_texts"] + counts["empty_encodings"],
      "invalid_utf8_documents": counts["invalid_utf8_documents"],
      "sources": list(inputs),
      "options": {"input_format": options.input_format, "patterns": list(options.patterns),
                  "jsonl_field": options.jsonl_field, "parquet_column": options.parquet_column,
                  "shards": options.shards},
  }


def write_json_atomically(path: str, record: dict) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(json.dumps(record, indent=2, sort_keys=True) + "\n")
  os.replace(tmp, path)


def _warn_stale_partials(out: str) -> None:
  """Logs the partial directories of earlier runs that are no longer running (a kill leaves them)."""
  for path in sorted(glob.glob(glob.escape(out) + PARTIAL_INFIX + "*")):
    match = re.search(r"\.partial-(\d+)$", path)
    if match and not _pid_running(int(match.group(1))):
      log.warning("%s is left by an unfinished prepare run (pid %s, not running); delete it", path,
                  match.group(1))


def _pid_running(pid: int) -> bool:
  try:
    os.kill(pid, 0)  # signal 0: only asks whether the process exists
  except ProcessLookupError:
    return False
  except PermissionError:  # it exists, under another user
    pass
  return True


def _publish(partial: str, out: str, overwrite: bool) -> None:
  """Renames the finished `partial` directory to `out`, replacing an old `out` only when asked."""
  if not os.path.exists(out):
    os.rename(partial, out)
    return
  old = f"{out}.old-{os.getpid()}"
  os.rename(out, old)
  os.rename(partial, out)
  shutil.rmtree(old)


def _checked_args(inputs, out, workers: int | None, overwrite: bool) -> tuple[list[str], str, int]:
  """(input paths, out without a trailing separator, workers), or a ValueError naming the fix."""
  workers = (os.cpu_count() or 1) if workers is None else workers
  if workers < 1:
    raise ValueError(f"workers must be >= 1, got {workers}")
  inputs = [os.fspath(inputs)] if isinstance(inputs, (str, os.PathLike)) else [os.fspath(p) for p in inputs]
  if not inputs:
    raise ValueError("no inputs given; pass files or directories to read")
  out = os.fspath(out).rstrip(os.sep)
  if os.path.exists(out) and not overwrite:
    raise ValueError(f"{out!r} exists; pass --overwrite to replace it, or choose another --out")
  return inputs, out, workers


def prepare(inputs: Sequence[str] | str, tokenizer: Tokenizer, out: str, options: PrepareOptions = PrepareOptions(),
            *, workers: int | None = None, overwrite: bool = False, show_progress: bool = True) -> dict:
  """Tokenizes `inputs` (files or directories) into the prepared-data directory `out`; returns its manifest.

  Args:
    inputs: files and directories; directories are walked for `options.patterns`.
    tokenizer: any `k3jax.data.tokenizer.Tokenizer`.
    out: the directory to create; an existing one is refused unless `overwrite`.
    options: input kind, split and layout (recorded in the manifest).
    workers: encoding processes (default os.cpu_count(); 1 encodes in this process).
  """
  inputs, out, workers = _checked_args(inputs, out, workers, overwrite)
  options = options.resolved(tokenizer)
  _warn_stale_partials(out)
  partial = partial_dir(out)
  shutil.rmtree(partial, ignore_errors=True)
  os.makedirs(partial)
  try:
    counts = _write_splits(inputs, tokenizer, options, partial, workers, show_progress)
    tokenizer.save_to(partial)
    manifest = _manifest(inputs, tokenizer, options, counts)
    write_json_atomically(os.path.join(partial, MANIFEST_FILE), manifest)  # last: it marks the data complete
    _publish(partial, out, overwrite)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise
  return manifest
