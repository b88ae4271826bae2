"""Tokenizers: round trips, special ids, digests, copies, offline BPE training and its binary."""
import hashlib
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from k3jax.data.tokenizer import (ByteTokenizer, HFTokenizer, SentencePieceTokenizer, load_tokenizer,
                                  train_bpe)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["def main():\n    return 0\n", "héllo  wörld\n\t日本語 🎉 ×", ""]
_LINES = ["def f(x):\n    return x + 1\n", "the quick brown fox jumps over the lazy dog\n",
          "héllo wörld, naïve café 日本語\n", "for i in range(10):\n    print(i)\n"]


def write_corpus(root, n: int = 6) -> list[str]:
  """`n` small text files under `root` (ASCII and unicode lines); returns their paths, sorted."""
  os.makedirs(root, exist_ok=True)
  paths = []
  for i in range(n):
    path = os.path.join(root, f"doc_{i}.txt")
    with open(path, "w", encoding="utf-8") as f:
      f.write("".join(_LINES[(i + j) % len(_LINES)] for j in range(12)))
    paths.append(path)
  return paths


def tiny_bpe(tmp_dir, name: str = "tokenizer.json", **kwargs) -> HFTokenizer:
  """A 300-token byte-level BPE trained on `write_corpus` files."""
  files = write_corpus(os.path.join(tmp_dir, "bpe_corpus"))
  return train_bpe(files, vocab_size=300, out_path=os.path.join(tmp_dir, name), show_progress=False, **kwargs)


@pytest.fixture(scope="module")
def tokenizers_by_kind(tmp_path_factory):
  """{"bytes", "hf", "sentencepiece" (when installed)}: one tokenizer of each kind."""
  tmp = str(tmp_path_factory.mktemp("tok"))
  out = {"bytes": ByteTokenizer(), "hf": tiny_bpe(tmp)}
  try:
    import sentencepiece as spm
  except ImportError:
    return out
  corpus = os.path.join(tmp, "sp.txt")
  with open(corpus, "w", encoding="utf-8") as f:
    f.write("".join(_LINES * 20))
  # Identity normalisation, kept whitespace and byte fallback make decode(encode(x)) == x.
  spm.SentencePieceTrainer.train(input=corpus, model_prefix=os.path.join(tmp, "sp"), vocab_size=320,
                                 model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                 remove_extra_whitespaces=False, add_dummy_prefix=False, pad_id=0,
                                 bos_id=1, eos_id=2, unk_id=3, minloglevel=2, num_threads=1)
  out["sentencepiece"] = SentencePieceTokenizer(os.path.join(tmp, "sp.model"))
  return out


def _get(tokenizers_by_kind, kind):
  if kind not in tokenizers_by_kind:
    pytest.skip(f"{kind} is not installed")
  return tokenizers_by_kind[kind]


@pytest.mark.parametrize("kind", ["bytes", "hf", "sentencepiece"])
def test_round_trips(tokenizers_by_kind, kind):
  tok = _get(tokenizers_by_kind, kind)
  for text in TEXTS:
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert ids.size == 0 or (ids.min() >= 0 and ids.max() < tok.vocab_size)
    assert tok.decode(ids) == text
  batch = tok.encode_batch(TEXTS)
  assert len(batch) == len(TEXTS)
  for ids, text in zip(batch, TEXTS):
    np.testing.assert_array_equal(ids, tok.encode(text))
  again = pickle.loads(pickle.dumps(tok))  # what a worker process receives
  np.testing.assert_array_equal(again.encode(TEXTS[1]), tok.encode(TEXTS[1]))


@pytest.mark.parametrize("kind, ids", [("bytes", (None, None, 0)), ("hf", (1, 2, 0)),
                                       ("sentencepiece", (1, 2, 0))])
def test_special_ids(tokenizers_by_kind, kind, ids):
  tok = _get(tokenizers_by_kind, kind)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == ids
  assert tok.kind == kind
  assert tok.vocab_size == {"bytes": 256, "hf": 300, "sentencepiece": 320}[kind]


def test_hf_special_ids_by_other_names(tmp_path):
  tok = tiny_bpe(str(tmp_path), special_tokens=("<s>", "</s>"))
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, None)
  assert tok.decode(tok.encode("a</s>b")) == "a</s>b"


def test_sha256_and_save_to(tokenizers_by_kind, tmp_path):
  digests = {kind: tok.sha256 for kind, tok in tokenizers_by_kind.items()}
  assert len(set(digests.values())) == len(digests)
  assert digests["bytes"] == ByteTokenizer().sha256 and len(digests["bytes"]) == 64
  assert ByteTokenizer().file_name is None and ByteTokenizer().save_to(str(tmp_path)) is None
  for kind, tok in tokenizers_by_kind.items():
    if kind == "bytes":
      continue
    with open(tok.path, "rb") as f:
      assert tok.sha256 == hashlib.sha256(f.read()).hexdigest()
    copy = tok.save_to(str(tmp_path))
    assert copy == os.path.join(str(tmp_path), tok.file_name)
    reloaded = load_tokenizer(copy)
    assert type(reloaded) is type(tok) and reloaded.sha256 == tok.sha256
    assert tok.save_to(str(tmp_path)) == copy  # copying onto itself leaves it as it is


def test_load_tokenizer(tokenizers_by_kind, tmp_path):
  assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
  assert isinstance(load_tokenizer(tokenizers_by_kind["hf"].path), HFTokenizer)
  with pytest.raises(ValueError, match="does not exist; train one with .*train_tokenizer.py"):
    load_tokenizer(str(tmp_path / "missing.json"))
  with pytest.raises(ValueError, match=r"unknown kind \(suffix '.txt'\).*'bytes'"):
    load_tokenizer(str(tmp_path / "vocab.txt"))
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(ValueError, match="not a HF tokenizers tokenizer.json"):
    load_tokenizer(str(tmp_path / "bad.json"))


def test_missing_sentencepiece_names_the_install(tmp_path, monkeypatch):
  (tmp_path / "x.model").write_bytes(b"\0")
  monkeypatch.setitem(sys.modules, "sentencepiece", None)  # makes `import sentencepiece` fail
  with pytest.raises(ValueError, match="pip install sentencepiece"):
    load_tokenizer(str(tmp_path / "x.model"))


def test_train_bpe_is_deterministic_and_checks_its_arguments(tmp_path):
  a, b = tiny_bpe(str(tmp_path), "a.json"), tiny_bpe(str(tmp_path), "b.json")
  assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
  assert a.sha256 == b.sha256
  assert sorted(os.listdir(tmp_path)) == ["a.json", "b.json", "bpe_corpus"]  # no temp file left
  files = write_corpus(str(tmp_path / "c"))
  with pytest.raises(ValueError, match=r"vocab_size 100 is below .* = 259; give a vocab_size >= 259"):
    train_bpe(files, vocab_size=100, out_path=str(tmp_path / "x.json"), show_progress=False)
  with pytest.raises(ValueError, match="do not exist"):
    train_bpe([str(tmp_path / "nope.txt")], vocab_size=300, out_path=str(tmp_path / "x.json"))


def run_binary(name: str, *args: str) -> subprocess.CompletedProcess:
  """Runs experiments/<name> with this interpreter (the venv's python)."""
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", name), *args],
                        capture_output=True, text=True, timeout=120, check=False)


def assert_one_error_line(result: subprocess.CompletedProcess, match: str) -> None:
  assert result.returncode == 2, result.stderr
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  assert match in lines[0], lines[0]


def test_train_tokenizer_binary(tmp_path):
  write_corpus(str(tmp_path / "in"))
  out = tmp_path / "tok" / "tokenizer.json"
  ok = run_binary("train_tokenizer.py", f"--input={tmp_path / 'in'}", "--patterns=*.txt", "--vocab_size=300",
                  f"--out={out}")
  assert ok.returncode == 0, ok.stderr
  assert f"wrote {out}: 300 tokens from 6 files" in ok.stdout
  assert load_tokenizer(str(out)).vocab_size == 300
  assert_one_error_line(run_binary("train_tokenizer.py", "--vocab_size=abc", f"--out={out}"), "--vocab_size")
  assert_one_error_line(run_binary("train_tokenizer.py", f"--input={tmp_path / 'in'}", "--patterns=*.txt",
                                   "--vocab_size=100", f"--out={out}"), "give a vocab_size >= 259")
  assert_one_error_line(run_binary("train_tokenizer.py", f"--input={tmp_path / 'in'}", f"--out={out}"),
                        "no files matching ['*.py']")
