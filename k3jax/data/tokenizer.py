"""Tokenizers behind one interface (bytes, HF `tokenizers`, sentencepiece), and offline BPE training.

Every tokenizer reads a local file, or none for bytes: nothing is downloaded.
`encode` never adds bos/eos (prepared data appends eos itself, so that every
kind is treated alike); `sha256` identifies the exact vocabulary, so prepared
data and a run can check that they were made with the same one.

  tok = load_tokenizer("runs/tok/tokenizer.json")   # or "bytes", or "x.model"
  ids = tok.encode("def main():")                    # int32 [N]
  assert tok.decode(ids) == "def main():"
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
from typing import Sequence

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

BYTES_SPEC = "bytes"
BYTE_VOCAB = 256
# The byte tokenizer has no file; its digest is that of this tag, so it still differs from every file's.
_BYTES_TAG = b"k3jax byte tokenizer v1: ids are the UTF-8 bytes, vocabulary 256, no bos/eos, pad 0"
# HF special-token names tried, in order, for each role.
_SPECIAL_NAMES = {
    "bos": ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>"),
    "eos": ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>"),
    "pad": ("<pad>", "<|pad|>"),
}
DEFAULT_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
SUFFIXES = {".json": "hf", ".model": "sentencepiece"}


class Tokenizer:
  """What every tokenizer offers; a subclass sets the attributes and encodes/decodes one text.

  Attributes:
    kind: "bytes", "hf" or "sentencepiece".
    vocab_size: every id is in [0, vocab_size).
    bos_id / eos_id / pad_id: the special ids, or None where the vocabulary has none.
  """
  kind: str
  vocab_size: int
  bos_id: int | None = None
  eos_id: int | None = None
  pad_id: int | None = None

  def encode(self, text: str) -> np.ndarray:
    """The ids of `text`, int32 [N], without bos/eos."""
    raise NotImplementedError

  def decode(self, ids) -> str:
    """The text of ids [N] (any integer sequence)."""
    raise NotImplementedError

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """`encode` of each text: a list of int32 [N_i]."""
    return [self.encode(t) for t in texts]

  @property
  def file_name(self) -> str | None:
    """The base name of the tokenizer's file; None for bytes."""
    return None

  @property
  def sha256(self) -> str:
    """Hex digest of the tokenizer file's bytes."""
    raise NotImplementedError

  def save_to(self, directory: str) -> str | None:
    """Copies the tokenizer file into `directory`; returns the copy's path (None for bytes)."""
    return None

  def __repr__(self) -> str:
    return f"{type(self).__name__}(kind={self.kind!r}, vocab_size={self.vocab_size}, file={self.file_name!r})"


class ByteTokenizer(Tokenizer):
  """Ids are the UTF-8 bytes of the text (the byte corpus's vocabulary); pad is 0, the NUL byte."""
  kind = BYTES_SPEC
  vocab_size = BYTE_VOCAB
  pad_id = 0

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    # Ids cut mid-character (a window's edge) decode to U+FFFD rather than raising.
    return bytes(np.asarray(ids, np.int64).astype(np.uint8).tolist()).decode("utf-8", errors="replace")

  @property
  def sha256(self) -> str:
    return hashlib.sha256(_BYTES_TAG).hexdigest()


class _FileTokenizer(Tokenizer):
  """A tokenizer read from one file, which `save_to` copies and `sha256` digests."""

  def __init__(self, path: str):
    if not os.path.isfile(path):
      raise ValueError(f"tokenizer file {path!r} does not exist; train one with "
                       f"`python experiments/train_tokenizer.py --out={path}` or give another path")
    self.path = path

  @property
  def file_name(self) -> str:
    return os.path.basename(self.path)

  @functools.cached_property
  def sha256(self) -> str:
    with open(self.path, "rb") as f:
      return hashlib.file_digest(f, "sha256").hexdigest()

  def save_to(self, directory: str) -> str:
    target = os.path.join(directory, self.file_name)
    if not (os.path.exists(target) and os.path.samefile(target, self.path)):
      shutil.copyfile(self.path, target)
    return target

  def __reduce__(self):
    # Native tokenizer objects reload from the file, e.g. in a worker process.
    return type(self), (self.path,)


class HFTokenizer(_FileTokenizer):
  """A HF `tokenizers` tokenizer.json; bos/eos/pad are the special tokens named e.g. <bos>, </s>, <pad>."""
  kind = "hf"

  def __init__(self, path: str):
    super().__init__(path)
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises a bare Exception on a malformed file
      raise ValueError(f"tokenizer file {path!r} is not a HF tokenizers tokenizer.json ({e}); "
                       "give a file saved by tokenizers.Tokenizer.save") from None
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.bos_id, self.eos_id, self.pad_id = (self._special_id(r) for r in ("bos", "eos", "pad"))

  def _special_id(self, role: str) -> int | None:
    for name in _SPECIAL_NAMES[role]:
      token_id = self._tok.token_to_id(name)
      if token_id is not None:
        return token_id
    return None

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    # One call: the Rust side spreads the batch over its threads.
    return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids) -> str:
    return self._tok.decode(np.asarray(ids, np.int64).tolist(), skip_special_tokens=False)


def _import_sentencepiece():
  try:
    import sentencepiece  # optional: only .model tokenizers need it (the `data` extra)
  except ImportError:
    raise ValueError("sentencepiece tokenizers (.model) need the sentencepiece package: "
                     "pip install sentencepiece (or pip install -e \".[data]\")") from None
  return sentencepiece


class SentencePieceTokenizer(_FileTokenizer):
  """A sentencepiece .model file; its bos/eos/pad ids where the model defines them (-1 means none)."""
  kind = "sentencepiece"

  def __init__(self, path: str):
    super().__init__(path)
    spm = _import_sentencepiece()
    try:
      self._sp = spm.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as e:
      raise ValueError(f"tokenizer file {path!r} is not a sentencepiece model ({e}); "
                       "give a .model file written by sentencepiece.SentencePieceTrainer") from None
    self.vocab_size = self._sp.get_piece_size()
    self.bos_id, self.eos_id, self.pad_id = (
        i if i >= 0 else None for i in (self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()))

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text), np.int32)

  def decode(self, ids) -> str:
    return self._sp.decode(np.asarray(ids, np.int64).tolist())


def load_tokenizer(spec: str) -> Tokenizer:
  """"bytes", a HF tokenizer.json (suffix .json) or a sentencepiece model (suffix .model)."""
  if spec == BYTES_SPEC:
    return ByteTokenizer()
  suffix = os.path.splitext(spec)[1]
  if suffix not in SUFFIXES:
    raise ValueError(f"tokenizer {spec!r} has an unknown kind (suffix {suffix!r}); give 'bytes', a HF "
                     "tokenizer.json (.json) or a sentencepiece model (.model)")
  return HFTokenizer(spec) if SUFFIXES[suffix] == "hf" else SentencePieceTokenizer(spec)


def read_text(path: str) -> tuple[str, bool]:
  """A file's text and whether it held invalid UTF-8, replaced by U+FFFD (the same way every time)."""
  with open(path, "rb") as f:
    data = f.read()
  try:
    return data.decode("utf-8"), False
  except UnicodeDecodeError:
    return data.decode("utf-8", errors="replace"), True


def _check_bpe_args(files: list[str], vocab_size: int, special_tokens: Sequence[str],
                    min_frequency: int) -> None:
  if not files:
    raise ValueError("train_bpe got no files; give at least one text file")
  missing = [f for f in files if not os.path.isfile(f)]
  if missing:
    raise ValueError(f"train_bpe: {len(missing)} files do not exist, e.g. {missing[0]!r}; give existing files")
  floor = BYTE_VOCAB + len(special_tokens)
  if vocab_size < floor:
    raise ValueError(f"vocab_size {vocab_size} is below the {BYTE_VOCAB} byte symbols plus "
                     f"{len(special_tokens)} special tokens = {floor}; give a vocab_size >= {floor}")
  if min_frequency < 1:
    raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")


def train_bpe(files: Sequence[str], *, vocab_size: int, out_path: str,
              special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS, min_frequency: int = 2,
              show_progress: bool = True) -> HFTokenizer:
  """Trains a byte-level BPE on `files` (UTF-8 text) and writes its tokenizer.json to `out_path` atomically.

  Every byte is in the initial alphabet and the ByteLevel decoder inverts the
  ByteLevel pre-tokenizer, so `decode(encode(x)) == x` for any text. The same
  files (in the same order) give the same file, byte for byte.
  """
  files = [os.fspath(f) for f in files]
  _check_bpe_args(files, vocab_size, special_tokens, min_frequency)
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                special_tokens=list(special_tokens), show_progress=show_progress,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  # From texts, not paths: the library's own reader stops at the first file with invalid UTF-8.
  tok.train_from_iterator((read_text(f)[0] for f in files), trainer, length=len(files))
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  # A reader never sees a half-written file: write beside it, then rename over it.
  tmp = f"{out_path}.tmp-{os.getpid()}"
  try:
    tok.save(tmp)
    os.replace(tmp, out_path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return HFTokenizer(out_path)
