"""Data: byte corpus split and determinism, token files, MQAR, resumable iterator."""
import math
import os

import numpy as np
import pytest

from k3jax.data import (BatchIterator, ByteCorpus, MQARDataset, TokenFileDataset, mqar_examples,
                        open_token_file, stdlib_source_dir, windows, write_token_file)
from k3jax.data.corpus import DOC_SEPARATOR, is_heldout


def _write_docs(root, n=40, seed=0):
  rng = np.random.default_rng(seed)
  for i in range(n):
    sub = root / f"pkg{i % 3}"
    sub.mkdir(parents=True, exist_ok=True)
    text = "".join(chr(c) for c in rng.integers(32, 127, size=int(rng.integers(50, 300))))
    (sub / f"mod_{i}.py").write_text(f"# doc {i}\n{text}\n")
  root.mkdir(parents=True, exist_ok=True)
  (root / "notes.txt").write_text("not a python file\n")


def test_corpus_split_is_deterministic_and_disjoint(tmp_path):
  _write_docs(tmp_path)
  a = ByteCorpus([str(tmp_path)], heldout_fraction=0.25)
  b = ByteCorpus([str(tmp_path)], heldout_fraction=0.25)
  np.testing.assert_array_equal(a.train, b.train)
  np.testing.assert_array_equal(a.heldout, b.heldout)
  assert a.train_names and a.heldout_names
  assert not set(a.train_names) & set(a.heldout_names)
  assert sorted(a.train_names + a.heldout_names) == sorted(
      os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs
      if f.endswith(".py"))
  # Every held-out document's bytes are absent from the training stream.
  train_bytes = a.train.tobytes()
  for name in a.heldout_names:
    assert (tmp_path / name).read_bytes() not in train_bytes
  # Streams are documents joined by the separator, so sizes add up exactly.
  size = lambda names: sum(len((tmp_path / n).read_bytes()) + 1 for n in names)
  assert len(a.train) == size(a.train_names) and len(a.heldout) == size(a.heldout_names)
  assert a.train[-1] == DOC_SEPARATOR


def test_split_does_not_depend_on_install_location(tmp_path):
  _write_docs(tmp_path / "x")
  _write_docs(tmp_path / "elsewhere" / "y")
  a = ByteCorpus([str(tmp_path / "x")], heldout_fraction=0.3)
  b = ByteCorpus([str(tmp_path / "elsewhere" / "y")], heldout_fraction=0.3)
  assert a.heldout_names == b.heldout_names
  assert all(is_heldout(n, 0.3) for n in a.heldout_names)


def test_default_corpus_is_the_stdlib():
  root = stdlib_source_dir()
  assert os.path.isfile(os.path.join(root, "os.py"))
  c = ByteCorpus(max_bytes=2_000_000)
  assert len(c.train) + len(c.heldout) >= 2_000_000
  assert not set(c.train_names) & set(c.heldout_names)
  assert c.train.dtype == np.uint8 and c.vocab_size == 256


def test_corpus_errors(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    ByteCorpus([str(tmp_path / "missing")])
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="no files matching"):
    ByteCorpus([str(tmp_path / "empty")])
  (tmp_path / "one").mkdir()
  (tmp_path / "one" / "a.py").write_text("x = 1\n")
  with pytest.raises(ValueError, match="split of the corpus .* is empty"):
    ByteCorpus([str(tmp_path / "one")])
  with pytest.raises(ValueError, match="heldout_fraction"):
    ByteCorpus([str(tmp_path / "one")], heldout_fraction=1.5)


def test_windows_are_next_token_pairs():
  stream = np.arange(100, dtype=np.uint8)
  b = windows(stream, np.array([0, 7, 90]), 9)
  np.testing.assert_array_equal(b["inputs"][1], np.arange(7, 16))
  np.testing.assert_array_equal(b["targets"][1], np.arange(8, 17))
  np.testing.assert_array_equal(b["targets"][2], np.arange(91, 100))


def test_iterator_is_deterministic_and_resumable(tmp_path):
  _write_docs(tmp_path)
  c = ByteCorpus([str(tmp_path)], heldout_fraction=0.25)
  it = BatchIterator(c, global_batch_size=4, seq_len=32, seed=3)
  full = [next(it) for _ in range(6)]
  resumed = BatchIterator(c, global_batch_size=4, seq_len=32, seed=3)
  resumed.set_state({"seed": 3, "position": 4})
  np.testing.assert_array_equal(next(resumed)["inputs"], full[4]["inputs"])
  assert resumed.get_state() == {"seed": 3, "position": 5}
  assert not np.array_equal(full[0]["inputs"], full[1]["inputs"])
  other = BatchIterator(c, global_batch_size=4, seq_len=32, seed=4)
  assert not np.array_equal(next(other)["inputs"], full[0]["inputs"])
  with pytest.raises(ValueError, match="seed"):
    resumed.set_state({"seed": 9, "position": 0})
  # Two processes each get their half of the same global batch.
  halves = [BatchIterator(c, global_batch_size=4, seq_len=32, seed=3, process_index=p, process_count=2)
            for p in range(2)]
  np.testing.assert_array_equal(np.concatenate([next(h)["inputs"] for h in halves]), full[0]["inputs"])


def test_eval_set_is_fixed_and_from_heldout(tmp_path):
  _write_docs(tmp_path)
  c = ByteCorpus([str(tmp_path)], heldout_fraction=0.25)
  e1, e2 = c.eval_batches(2, 16, 3), c.eval_batches(2, 16, 3)
  held = c.heldout.tobytes()
  for x, y in zip(e1, e2):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
    for row in x["inputs"]:
      assert row.astype(np.uint8).tobytes() in held
  assert c.metrics_from_loss(math.log(2.0))["bpb"] == pytest.approx(1.0)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_reader(tmp_path, dtype):
  tokens = np.random.default_rng(0).integers(0, 1000, size=5000).astype(dtype)
  path = tmp_path / f"tok.{dtype}"
  write_token_file(str(path), tokens, dtype)
  mm = open_token_file(str(path), dtype)
  assert isinstance(mm, np.memmap)
  np.testing.assert_array_equal(np.asarray(mm), tokens)
  ds = TokenFileDataset(str(path), dtype=dtype, vocab_size=1000, heldout_fraction=0.1)
  assert len(ds.train) == 4500 and len(ds.heldout) == 500
  b = ds.sample(np.random.default_rng(1), 8, 64)
  for row_in, row_tg in zip(b["inputs"], b["targets"]):
    start = int(np.flatnonzero(np.lib.stride_tricks.sliding_window_view(tokens[:4500], 64).__eq__(row_in).all(1))[0])
    np.testing.assert_array_equal(row_tg, tokens[start + 1:start + 65])
  for eb in ds.eval_batches(4, 64, 2):
    assert eb["inputs"].shape == (4, 64)
    assert np.isin(eb["inputs"], tokens[4500:]).all()
  small = TokenFileDataset(str(path), dtype=dtype, vocab_size=10, heldout_fraction=0.1)
  with pytest.raises(ValueError, match="vocab_size"):
    small.sample(np.random.default_rng(0), 2, 8)


def test_token_file_errors(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    open_token_file(str(tmp_path / "nope.bin"), "uint16")
  (tmp_path / "empty.bin").write_bytes(b"")
  with pytest.raises(ValueError, match="empty"):
    open_token_file(str(tmp_path / "empty.bin"), "uint16")
  (tmp_path / "odd.bin").write_bytes(b"abc")
  with pytest.raises(ValueError, match="multiple of 2"):
    open_token_file(str(tmp_path / "odd.bin"), "uint16")
  with pytest.raises(ValueError, match="dtype"):
    open_token_file(str(tmp_path / "odd.bin"), "int8")
  with pytest.raises(ValueError, match="outside uint16"):
    write_token_file(str(tmp_path / "big.bin"), np.array([1, 70000]), "uint16")


def test_mqar_examples_answer_every_query():
  b = mqar_examples(np.random.default_rng(0), 16, 64, vocab_size=128, num_kv_pairs=8)
  for x, y, m in zip(b["inputs"], b["targets"], b["mask"]):
    pairs = {int(x[2 * i]): int(x[2 * i + 1]) for i in range(8)}
    assert len(pairs) == 8, "keys are distinct"
    assert all(1 <= k < 64 for k in pairs) and all(64 <= v < 128 for v in pairs.values())
    qpos = np.flatnonzero(m)
    assert len(qpos) == 8 and (qpos >= 16).all()
    for p in qpos:
      assert pairs[int(x[p])] == int(y[p])
    np.testing.assert_array_equal(y[:-1], x[1:])


def test_mqar_heldout_is_fixed_and_separate():
  ds = MQARDataset(vocab_size=256, num_kv_pairs=16, seed=0)
  e1, e2 = ds.eval_batches(8, 64, 2), ds.eval_batches(8, 64, 2)
  np.testing.assert_array_equal(e1[1]["inputs"], e2[1]["inputs"])
  it = BatchIterator(ds, global_batch_size=8, seq_len=64, seed=0)
  train_rows = {r.tobytes() for _ in range(20) for r in next(it)["inputs"]}
  assert not train_rows & {r.tobytes() for b in e1 for r in b["inputs"]}
  with pytest.raises(ValueError, match="distinct keys"):
    mqar_examples(np.random.default_rng(0), 1, 64, vocab_size=10, num_kv_pairs=8)
  with pytest.raises(ValueError, match="cannot hold"):
    mqar_examples(np.random.default_rng(0), 1, 10, vocab_size=256, num_kv_pairs=8)
