"""Prepared data: text/JSONL/parquet in, array_record + manifest out, read back by document.

Covers the counts, the held-out split by document, byte-identical reruns, the id
check, empty splits, the reader's refusals and a prepare run killed mid-way.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from k3jax.data.corpus import is_heldout
from k3jax.data.prepare import FORMAT_VERSION, PrepareOptions, prepare
from k3jax.data.prepared import PreparedData
from k3jax.data.tokenizer import ByteTokenizer
from tests.test_tokenizer import ROOT, assert_one_error_line, run_binary, tiny_bpe

FRACTION = 0.3
_WORDS = ["alpha", "beta", "héllo", "wörld", "日本", "def", "return", "x", "(", ")", ":", "\n", "    "]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  return tiny_bpe(str(tmp_path_factory.mktemp("bpe")))


def _text(rng, n_words: int) -> str:
  return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n_words))


def _write_text_docs(root) -> dict[str, str]:
  """30 documents under `root` (two of them empty) and a file the patterns skip; {key: text}."""
  rng = np.random.default_rng(0)
  docs = {}
  for i in range(30):
    key = os.path.join(f"pkg{i % 3}", f"doc_{i}.txt")
    docs[key] = "" if i in (4, 17) else _text(rng, int(rng.integers(5, 60)))
    os.makedirs(os.path.join(root, f"pkg{i % 3}"), exist_ok=True)
    with open(os.path.join(root, key), "w", encoding="utf-8") as f:
      f.write(docs[key])
  with open(os.path.join(root, "notes.md"), "w", encoding="utf-8") as f:
    f.write("not read\n")
  return docs


def _expected(docs: dict[str, str | None], tok, *, eos: bool = True) -> dict[str, list[np.ndarray]]:
  """{split: ids of its non-empty documents in the order of `docs`}, as prepare should write them."""
  out = {"train": [], "heldout": []}
  for key in docs:  # in the order prepare reads them
    if docs[key]:
      ids = np.concatenate([tok.encode(docs[key]), [tok.eos_id] if eos else []]).astype(np.int32)
      out["heldout" if is_heldout(key, FRACTION) else "train"].append(ids)
  return out


def _read_back(path) -> dict[str, list[np.ndarray]]:
  data = PreparedData(str(path))
  return {split: [data.source(split)[i] for i in range(len(data.source(split)))] for split in ("train", "heldout")}


def _assert_same_documents(got: dict, want: dict) -> None:
  for split in ("train", "heldout"):
    assert len(got[split]) == len(want[split]), split
    for a, b in zip(got[split], want[split]):
      assert a.dtype == np.int32
      np.testing.assert_array_equal(a, b)


def test_text_files(tmp_path, bpe):
  docs = _write_text_docs(tmp_path / "in")
  want = _expected(dict(sorted(docs.items())), bpe)  # files are read in sorted-name order
  assert want["train"] and want["heldout"]
  manifest = prepare([str(tmp_path / "in")], bpe, str(tmp_path / "out"),
                     PrepareOptions(patterns=("*.txt",), heldout_fraction=FRACTION), workers=2,
                     show_progress=False)
  on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
  assert on_disk == manifest
  for split in ("train", "heldout"):
    assert manifest["splits"][split] == {"documents": len(want[split]), "tokens": sum(map(len, want[split])),
                                         "shards": [f"{split}-00000-of-00001.array_record"],
                                         "lengths": f"{split}-lengths.npy"}
  assert manifest["empty_documents"] == 2 and manifest["add_eos"] is True
  assert manifest["max_id"] == max(int(x.max()) for s in want.values() for x in s)
  assert manifest["tokenizer"] == {"kind": "hf", "file": "tokenizer.json", "sha256": bpe.sha256,
                                   "vocab_size": 300, "bos_id": 1, "eos_id": 2, "pad_id": 0}
  assert manifest["token_dtype"] == "uint16" and manifest["format_version"] == FORMAT_VERSION
  assert manifest["sources"] == [str(tmp_path / "in")] and manifest["options"]["patterns"] == ["*.txt"]
  assert sorted(os.listdir(tmp_path / "out")) == [
      "heldout-00000-of-00001.array_record", "heldout-lengths.npy", "manifest.json", "tokenizer.json",
      "train-00000-of-00001.array_record", "train-lengths.npy"]
  _assert_same_documents(_read_back(tmp_path / "out"), want)
  data = PreparedData(str(tmp_path / "out"))
  for split in ("train", "heldout"):  # the lengths the loader plans pieces from, in source order
    source = data.source(split)
    assert source.lengths.tolist() == [len(source[i]) for i in range(len(source))]
  assert data.tokenizer().sha256 == bpe.sha256 == data.tokenizer_sha256
  assert (data.vocab_size, data.max_id) == (300, manifest["max_id"])
  assert data.num_documents("heldout") == len(want["heldout"])
  assert data.num_tokens("train") == manifest["splits"]["train"]["tokens"]


def test_output_is_deterministic_and_sharded(tmp_path, bpe):
  docs = _write_text_docs(tmp_path / "in")
  options = PrepareOptions(patterns=("*.txt",), heldout_fraction=FRACTION, shards=3)
  for name, workers in (("a", 1), ("b", 2)):  # the worker count does not change a byte
    prepare(str(tmp_path / "in"), bpe, str(tmp_path / name), options, workers=workers, show_progress=False)
  names = sorted(os.listdir(tmp_path / "a"))
  assert names == sorted(os.listdir(tmp_path / "b"))
  for name in names:
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
  want = _expected(dict(sorted(docs.items())), bpe)
  manifest = PreparedData(str(tmp_path / "a")).manifest
  for split in ("train", "heldout"):
    count = min(3, len(want[split]))
    assert manifest["splits"][split]["shards"] == [f"{split}-{i:05d}-of-{count:05d}.array_record"
                                                   for i in range(count)]
    # Documents go round-robin over the shards; the source reads shard after shard.
    want[split] = [want[split][i] for k in range(count) for i in range(k, len(want[split]), count)]
    # The lengths file follows the same order.
    assert PreparedData(str(tmp_path / "a")).source(split).lengths.tolist() == list(map(len, want[split]))
  _assert_same_documents(_read_back(tmp_path / "a"), want)


def test_jsonl(tmp_path, bpe):
  rows = {"a.jsonl": ["héllo wörld", "", None, "def x(): return 1"], "sub/b.jsonl": ["beta"] * 12}
  docs = {}
  for name, texts in rows.items():
    os.makedirs(os.path.dirname(tmp_path / "in" / name), exist_ok=True)
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)]
    lines.insert(1, "")  # a blank line is no document, but it keeps its number
    (tmp_path / "in" / name).write_text("\n".join(lines) + "\n")
    docs.update({f"{name}:{n}": json.loads(line)["text"] for n, line in enumerate(lines, 1) if line})
  manifest = prepare([str(tmp_path / "in")], bpe, str(tmp_path / "out"),
                     PrepareOptions(jsonl_field="text", heldout_fraction=FRACTION), workers=1, show_progress=False)
  want = _expected(docs, bpe)
  assert manifest["empty_documents"] == 2 and manifest["options"]["input_format"] == "jsonl"
  assert [manifest["splits"][s]["documents"] for s in ("train", "heldout")] == [len(want["train"]),
                                                                              len(want["heldout"])]
  _assert_same_documents(_read_back(tmp_path / "out"), want)
  (tmp_path / "in" / "c.jsonl").write_text('{"body": "x"}\n')
  with pytest.raises(ValueError, match=r"c.jsonl:1 has no field 'text' \(it has \['body'\]\).*--jsonl_field"):
    prepare([str(tmp_path / "in")], bpe, str(tmp_path / "out2"), PrepareOptions(jsonl_field="text"),
            workers=1, show_progress=False)


def test_parquet(tmp_path, bpe):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  rng = np.random.default_rng(1)
  texts = [_text(rng, 8) for _ in range(20)]
  texts[3], texts[11] = None, ""
  (tmp_path / "in").mkdir()
  pq.write_table(pa.table({"content": texts, "n": list(range(20))}), str(tmp_path / "in" / "x.parquet"),
                 row_group_size=7)
  manifest = prepare([str(tmp_path / "in")], bpe, str(tmp_path / "out"),
                     PrepareOptions(parquet_column="content", heldout_fraction=FRACTION, add_eos=False),
                     workers=1, show_progress=False)
  docs = {f"x.parquet:{row}": t for row, t in enumerate(texts, 1)}
  assert manifest["empty_documents"] == 2 and manifest["add_eos"] is False
  _assert_same_documents(_read_back(tmp_path / "out"), _expected(docs, bpe, eos=False))
  with pytest.raises(ValueError, match=r"no column 'text' \(it has \['content', 'n'\]\).*--parquet_column"):
    prepare([str(tmp_path / "in")], bpe, str(tmp_path / "out2"), PrepareOptions(parquet_column="text"),
            workers=1, show_progress=False)


class _SmallVocab(ByteTokenizer):
  """A tokenizer that claims fewer ids than it emits: bytes with a vocabulary of 100."""
  vocab_size = 100


def test_an_id_outside_the_vocabulary_is_rejected(tmp_path):
  (tmp_path / "in").mkdir()
  (tmp_path / "in" / "good.txt").write_text("abc")
  (tmp_path / "in" / "bad.txt").write_text("xyz")
  with pytest.raises(ValueError, match=r"document 'bad.txt': token id 122 is outside the bytes tokenizer's "
                     r"vocabulary \[0, 100\)"):
    prepare([str(tmp_path / "in")], _SmallVocab(), str(tmp_path / "out"), PrepareOptions(patterns=("*.txt",)),
            workers=1, show_progress=False)
  assert sorted(os.listdir(tmp_path)) == ["in"]  # neither <out> nor a partial directory is left


def test_empty_split_and_bad_options(tmp_path, bpe):
  (tmp_path / "in").mkdir()
  (tmp_path / "in" / "a.txt").write_text("the only document")
  assert not is_heldout("a.txt", 0.05)
  run = lambda options, out="out", **kw: prepare([str(tmp_path / "in")], bpe, str(tmp_path / out), options,
                                                 workers=1, show_progress=False, **kw)
  with pytest.raises(ValueError, match=r"the heldout split is empty: all 1 non-empty documents .* add more "
                     r"documents or change the held-out fraction"):
    run(PrepareOptions(patterns=("*.txt",)))
  with pytest.raises(ValueError, match=r"heldout_fraction must be in \(0, 1\), got 1.0"):
    run(PrepareOptions(heldout_fraction=1.0))
  with pytest.raises(ValueError, match="not both"):
    run(PrepareOptions(jsonl_field="t", parquet_column="t"))
  with pytest.raises(ValueError, match="tokenizer has no eos"):
    prepare([str(tmp_path / "in")], ByteTokenizer(), str(tmp_path / "out"), PrepareOptions(add_eos=True))
  with pytest.raises(ValueError, match=r"no files matching \('\*.py',\)"):
    run(PrepareOptions())
  assert sorted(os.listdir(tmp_path)) == ["in"]
  (tmp_path / "in" / "f.txt").write_text("a second document")
  assert is_heldout("f.txt", 0.5) and not is_heldout("h.txt", 0.5)
  first = run(PrepareOptions(patterns=("*.txt",), heldout_fraction=0.5))
  with pytest.raises(ValueError, match="exists; pass --overwrite"):
    run(PrepareOptions(patterns=("*.txt",), heldout_fraction=0.5))
  (tmp_path / "in" / "h.txt").write_text("a third document")
  second = run(PrepareOptions(patterns=("*.txt",), heldout_fraction=0.5), overwrite=True)
  assert first["splits"] != second["splits"] == PreparedData(str(tmp_path / "out")).manifest["splits"]
  assert sorted(os.listdir(tmp_path)) == ["in", "out"]


def test_reader_refusals(tmp_path, bpe):
  (tmp_path / "in").mkdir()
  for i in range(8):
    (tmp_path / "in" / f"d{i}.txt").write_text(f"document {i}")
  prepare([str(tmp_path / "in")], bpe, str(tmp_path / "out"), PrepareOptions(patterns=("*.txt",), heldout_fraction=0.5),
          workers=1, show_progress=False)
  with pytest.raises(ValueError, match="does not exist; create it with .*prepare_data.py"):
    PreparedData(str(tmp_path / "nowhere"))
  with pytest.raises(ValueError, match="has no manifest.json.*run experiments/prepare_data.py again"):
    PreparedData(str(tmp_path / "in"))
  with pytest.raises(ValueError, match="split must be one of"):
    PreparedData(str(tmp_path / "out")).source("test")
  manifest_path = tmp_path / "out" / "manifest.json"
  manifest = json.loads(manifest_path.read_text())
  manifest_path.write_text(json.dumps({**manifest, "format_version": 99}))
  with pytest.raises(ValueError, match=f"format_version 99, this k3jax reads version {FORMAT_VERSION}"):
    PreparedData(str(tmp_path / "out"))
  manifest_path.write_text(json.dumps(manifest))
  with open(tmp_path / "out" / "tokenizer.json", "a") as f:
    f.write(" ")
  with pytest.raises(ValueError, match="the file was changed after prepare"):
    PreparedData(str(tmp_path / "out")).tokenizer()
  os.remove(tmp_path / "out" / "heldout-lengths.npy")
  with pytest.raises(ValueError, match="heldout-lengths.npy, the heldout split's document lengths.* is missing"):
    PreparedData(str(tmp_path / "out"))
  os.remove(tmp_path / "out" / "heldout-00000-of-00001.array_record")
  with pytest.raises(ValueError, match="shard heldout-00000-of-00001.array_record of the heldout split.* is missing"):
    PreparedData(str(tmp_path / "out"))


def _write_big_corpus(root, n_files: int = 150) -> None:
  """About 5.5 MB of text: a few seconds of encoding with the 300-token BPE on 2 cores."""
  root.mkdir()
  block = _text(np.random.default_rng(2), 8000)
  for i in range(n_files):
    (root / f"doc_{i:04d}.txt").write_text(f"# document {i}\n{block}")


def _wait_for(predicate, timeout_s: float, proc: subprocess.Popen) -> None:
  deadline = time.monotonic() + timeout_s
  while not predicate():
    assert proc.poll() is None, proc.communicate()
    assert time.monotonic() < deadline, "prepare_data.py did not start writing in time"
    time.sleep(0.02)


def test_a_killed_run_leaves_nothing_the_reader_accepts(tmp_path, bpe):
  _write_big_corpus(tmp_path / "in")
  out = tmp_path / "out"
  args = [f"--input={tmp_path / 'in'}", "--patterns=*.txt", f"--tokenizer={bpe.path}", f"--out={out}",
          "--workers=2"]
  proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "experiments", "prepare_data.py"), *args],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  partial = f"{out}.partial-{proc.pid}"
  _wait_for(lambda: glob.glob(os.path.join(partial, "train-*.tmp")), 60, proc)  # documents are being written
  os.kill(proc.pid, signal.SIGKILL)
  proc.communicate(timeout=30)
  assert not out.exists()
  assert glob.glob(f"{out}*") == [partial] and not os.path.exists(os.path.join(partial, "manifest.json"))
  with pytest.raises(ValueError, match="did not finish"):
    PreparedData(partial)
  with pytest.raises(ValueError, match="does not exist"):
    PreparedData(str(out))
  again = run_binary("prepare_data.py", *args)
  assert again.returncode == 0, again.stderr
  assert f"{partial} is left by an unfinished prepare run" in again.stderr
  data = PreparedData(str(out))
  assert data.num_documents("train") + data.num_documents("heldout") == 150
  assert data.tokenizer().sha256 == bpe.sha256


def test_prepare_data_binary_errors(tmp_path):
  out = f"--out={tmp_path / 'out'}"
  assert_one_error_line(run_binary("prepare_data.py", "--shards=abc", out), "--shards")
  assert_one_error_line(run_binary("prepare_data.py", "--heldout_fraction=2", out),
                        "heldout_fraction must be in (0, 1), got 2.0")
  assert_one_error_line(run_binary("prepare_data.py", f"--tokenizer={tmp_path / 'tok.json'}", out),
                        "does not exist; train one")
  assert_one_error_line(run_binary("prepare_data.py", "--tokenizer=bytes", "--add_eos", out), "no eos")
  assert not os.path.exists(tmp_path / "out")
  (tmp_path / "in").mkdir()
  (tmp_path / "in" / "a.txt").write_text("x")
  assert_one_error_line(run_binary("prepare_data.py", f"--input={tmp_path / 'in'}", "--patterns=*.txt", out),
                        "the heldout split is empty")
