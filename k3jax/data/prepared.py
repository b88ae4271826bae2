"""Reads a prepared-data directory (`k3jax.data.prepare`): its manifest, tokenizer and documents.

  data = PreparedData("runs/data/stdlib_bpe")
  train = data.source("train")      # Grain random-access source: train[i] is int32 [n_i]
  tok = data.tokenizer()            # the tokenizer copied in at prepare time, digest checked

Only a finished run's directory is accepted: `prepare` writes manifest.json last
and renames the directory into place after it.
"""
from __future__ import annotations

import json
import os
import re

import grain
import numpy as np

from k3jax.data.prepare import FORMAT_VERSION, MANIFEST_FILE, PARTIAL_INFIX, SPLITS
from k3jax.data.tokenizer import BYTES_SPEC, Tokenizer, load_tokenizer

_AGAIN = "run experiments/prepare_data.py again"


class DocumentSource:
  """A Grain random-access data source over one split's array_record shards.

  Item i is document i (shards in manifest order), int32 [n_i] token ids;
  `lengths` [N] int64 are their lengths, read from the split's lengths file.
  """

  def __init__(self, paths: list[str], dtype: str, lengths: np.ndarray):
    self.paths = list(paths)
    self.dtype = np.dtype(dtype).newbyteorder("<")
    self.lengths = lengths
    self._records = grain.sources.ArrayRecordDataSource(self.paths)

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> np.ndarray:
    return np.frombuffer(self._records[index], self.dtype).astype(np.int32)

  def __repr__(self) -> str:
    return f"DocumentSource({self.paths!r}, dtype={self.dtype.name!r})"


def read_manifest(path: str) -> dict:
  """The manifest of the prepared directory `path`, after the checks that need no shard."""
  if not os.path.isdir(path):
    raise ValueError(f"prepared data directory {path!r} does not exist; create it with "
                     f"`python experiments/prepare_data.py --out={path} ...`")
  if re.search(re.escape(PARTIAL_INFIX) + r"\d+$", os.path.normpath(path)):
    raise ValueError(f"{path!r} is the work directory of a prepare run that did not finish (killed or "
                     f"still running); {_AGAIN}, which writes the finished data to the name without "
                     f"{PARTIAL_INFIX}<pid>")
  manifest_path = os.path.join(path, MANIFEST_FILE)
  if not os.path.isfile(manifest_path):
    raise ValueError(f"{path!r} has no {MANIFEST_FILE}: it is not prepared data, or a prepare run was "
                     f"killed before it finished; {_AGAIN}")
  with open(manifest_path, encoding="utf-8") as f:
    manifest = json.load(f)
  version = manifest.get("format_version")
  if version != FORMAT_VERSION:
    raise ValueError(f"{manifest_path} has format_version {version!r}, this k3jax reads version "
                     f"{FORMAT_VERSION}; {_AGAIN} to rewrite it")
  return manifest


class PreparedData:
  """A finished prepared-data directory, checked when opened (manifest version, shard files, counts)."""

  def __init__(self, path: str):
    self.path = path
    self.manifest = read_manifest(path)
    self._sources = {split: self._open(split) for split in SPLITS}

  def _open(self, split: str) -> DocumentSource:
    entry = self.manifest["splits"][split]
    paths = [os.path.join(self.path, name) for name in entry["shards"]]
    for p in paths:
      if not os.path.isfile(p):
        raise ValueError(f"shard {os.path.basename(p)} of the {split} split, listed in {self.path}/"
                         f"{MANIFEST_FILE}, is missing; {_AGAIN} (with --overwrite)")
    lengths_path = os.path.join(self.path, entry["lengths"])
    if not os.path.isfile(lengths_path):
      raise ValueError(f"{entry['lengths']}, the {split} split's document lengths listed in {self.path}/"
                       f"{MANIFEST_FILE}, is missing; {_AGAIN} (with --overwrite)")
    source = DocumentSource(paths, self.manifest["token_dtype"], np.load(lengths_path))
    if len(source) != entry["documents"] or len(source.lengths) != entry["documents"]:
      raise ValueError(f"the {split} shards in {self.path!r} hold {len(source)} documents and its lengths "
                       f"file {len(source.lengths)}, the manifest says {entry['documents']}: the files "
                       f"were changed after prepare; {_AGAIN} "
                       "(with --overwrite)")
    return source

  def _split(self, split: str) -> dict:
    if split not in SPLITS:
      raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return self.manifest["splits"][split]

  def source(self, split: str) -> DocumentSource:
    """The documents of `split` ("train" or "heldout"), int32 ids each."""
    self._split(split)
    return self._sources[split]

  def num_documents(self, split: str) -> int:
    return self._split(split)["documents"]

  def num_tokens(self, split: str) -> int:
    """Tokens in `split`, eos included where it was appended."""
    return self._split(split)["tokens"]

  @property
  def max_id(self) -> int:
    return self.manifest["max_id"]

  @property
  def vocab_size(self) -> int:
    return self.manifest["tokenizer"]["vocab_size"]

  @property
  def tokenizer_sha256(self) -> str:
    return self.manifest["tokenizer"]["sha256"]

  def tokenizer(self) -> Tokenizer:
    """The tokenizer the data was made with (the copy in this directory), its digest checked."""
    file = self.manifest["tokenizer"]["file"]
    tok = load_tokenizer(BYTES_SPEC if file is None else os.path.join(self.path, file))
    if tok.sha256 != self.tokenizer_sha256:
      raise ValueError(f"the tokenizer in {self.path!r} has sha256 {tok.sha256[:12]}..., the manifest "
                       f"says {self.tokenizer_sha256[:12]}...: the file was changed after prepare; {_AGAIN}")
    return tok
