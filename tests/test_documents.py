"""Packed documents through Grain: pieces, packing with segment ids, epochs without replacement,
per-process shards that form the global batch, and exact resume through the trainer's checkpoint."""
import collections

import numpy as np
import pytest

from k3jax.data.documents import (DocumentIterator, Packing, document_pieces, packed_dataset,
                                  packed_eval_batches, piece_table)
from k3jax.train import data_state
from k3jax.train.checkpoint import Checkpointer

T = 16


def _documents(n: int = 40, seed: int = 0) -> list[np.ndarray]:
  """Documents of 1 to 50 tokens; token ids encode (document, index) so every pair is traceable."""
  rng = np.random.default_rng(seed)
  return [1000 * (d + 1) + np.arange(int(rng.integers(1, 51)), dtype=np.int32) for d in range(n)]


def _pairs(batch) -> list[tuple[int, int]]:
  """Every (input, target) pair of a batch's non-padding positions."""
  keep = batch["mask"] > 0
  return list(zip(batch["inputs"][keep].tolist(), batch["targets"][keep].tolist()))


def test_pieces_make_every_token_but_the_first_a_target_once():
  ids = np.arange(40, dtype=np.int32)
  pieces = document_pieces(ids, T)
  assert [len(p["inputs"]) for p in pieces] == [16, 16, 7]
  targets = np.concatenate([p["targets"] for p in pieces])
  np.testing.assert_array_equal(targets, ids[1:])
  for p in pieces:
    np.testing.assert_array_equal(p["targets"], p["inputs"] + 1)
  assert document_pieces(ids[:1], T) == [] and len(document_pieces(ids[:2], T)) == 1


def test_rows_carry_segments_positions_and_no_target_crosses_a_document():
  docs = _documents()
  packing = Packing(seq_len=T, max_documents_per_row=3, bins=4, prefetch=0)
  batches = list(packed_dataset(docs, packing, rows=4, seed=1, epochs=1))
  assert batches
  for b in batches:
    assert set(b) == {"inputs", "targets", "mask", "segment_ids", "positions"}
    assert all(v.shape == (4, T) for v in b.values())
    seg = b["segment_ids"]
    np.testing.assert_array_equal(b["mask"], (seg > 0).astype(np.float32))
    assert seg.max() <= 3
    # A target is its input's successor in the same document: nothing crosses a document.
    for x, y in _pairs(b):
      assert y == x + 1 and x // 1000 == y // 1000
    # Positions count from 0 at each document's first token, and ids are contiguous runs.
    for row_seg, row_pos in zip(seg, b["positions"]):
      starts = np.flatnonzero(np.diff(np.concatenate([[-1], row_seg])) != 0)
      for s in starts:
        if row_seg[s]:
          assert row_pos[s] == 0
      assert len(set(row_seg[row_seg > 0].tolist())) == len([s for s in starts if row_seg[s]])


def test_one_epoch_sees_every_pair_once_in_a_seeded_order():
  docs = _documents()
  want = collections.Counter((x, x + 1) for d in docs for x in d[:-1].tolist())
  packing = Packing(seq_len=T, max_documents_per_row=4, bins=8, prefetch=0)
  # One row per batch, so no row of the epoch is dropped as a remainder.
  seen = collections.Counter(p for b in packed_dataset(docs, packing, rows=1, seed=3, epochs=1)
                             for p in _pairs(b))
  assert seen == want
  first = lambda seed: [tuple(b["inputs"].ravel()) for b in packed_dataset(docs, packing, rows=1, seed=seed, epochs=1)]
  assert first(3) == first(3) and first(3) != first(4)


def test_pieces_are_shuffled_across_documents():
  # One 400-token document and many short ones: its 25 pieces do not fill consecutive rows.
  docs = [np.arange(400, dtype=np.int32) + 1000] + [2000 * (d + 1) + np.arange(10, dtype=np.int32)
                                                   for d in range(40)]
  packing = Packing(seq_len=T, max_documents_per_row=1, bins=1, prefetch=0)
  owner = [b["inputs"][0, 0] < 2000 for b in packed_dataset(docs, packing, rows=1, seed=0, epochs=1)]
  assert sum(owner) == 25 and len(owner) == 65
  longest_run = max(len(r) for r in "".join("L" if o else "s" for o in owner).split("s"))
  assert longest_run < 10


def test_piece_table_matches_the_pieces():
  lengths = np.array([0, 1, 2, 17, 33, 16], np.int64)
  doc_p, start_p = piece_table(lengths, T)
  want = [(d, s) for d, n in enumerate(lengths) for s in range(0, max(n - 1, 0), T)]
  assert list(zip(doc_p.tolist(), start_p.tolist())) == want


def test_epochs_are_reshuffled():
  docs = [d for d in _documents(30) if len(d) > 1]
  packing = Packing(seq_len=T, max_documents_per_row=1, bins=1, prefetch=0)
  rows = [b["inputs"][0, 0] // 1000 for b in packed_dataset(docs, packing, rows=1, seed=0, epochs=2)]
  per_epoch = sum(len(document_pieces(d, T)) for d in docs)
  assert len(rows) == 2 * per_epoch  # one piece per row
  epochs = [list(dict.fromkeys(rows[:per_epoch])), list(dict.fromkeys(rows[per_epoch:]))]
  want = sorted(d[0] // 1000 for d in docs)
  assert sorted(epochs[0]) == want and sorted(epochs[1]) == want and epochs[0] != epochs[1]


def test_process_shards_are_disjoint_and_form_the_global_batch():
  docs = _documents(60)
  packing = Packing(seq_len=T, max_documents_per_row=4, bins=4, prefetch=0)
  iters = [DocumentIterator(docs, packing, global_batch_size=8, seed=5, process_index=p, process_count=2)
           for p in range(2)]
  # Within an epoch the two read disjoint pieces (a token is an input once per epoch).
  shards = [{x for _ in range(6) for x, _ in _pairs(next(it))} for it in iters]
  assert shards[0] and shards[1] and not shards[0] & shards[1]
  # Each process yields its own rows (4 of 8).
  batch = next(iters[0])
  assert batch["inputs"].shape == (4, T) and iters[0].local_rows({"x": np.arange(8)})["x"].tolist() == [0, 1, 2, 3]
  assert iters[1].local_rows({"x": np.arange(8)})["x"].tolist() == [4, 5, 6, 7]
  for it in iters:
    it.close()


def test_resume_through_a_checkpoint_replays_the_same_batches(tmp_path):
  docs = _documents(80)
  packing = Packing(seq_len=T, max_documents_per_row=3, bins=8, prefetch=2)
  unbroken = DocumentIterator(docs, packing, global_batch_size=4, seed=7)
  expected = [next(unbroken) for _ in range(12)]
  unbroken.close()

  first = DocumentIterator(docs, packing, global_batch_size=4, seed=7)
  for _ in range(5):
    next(first)
  ckpt = Checkpointer(str(tmp_path / "ck"), async_save=False)
  state = {"w": np.zeros(3, np.float32)}
  ckpt.save(5, state, data_state.saved_state(first, nproc=1))
  ckpt.close()
  first.close()

  # A new process: the position comes from the files alone, as after a kill.
  restored = Checkpointer(str(tmp_path / "ck"), async_save=False).restore_intact(state)
  assert restored.step == 5 and list(restored.data_state["shards"]) == ["0-of-1"]
  again = DocumentIterator(docs, packing, global_batch_size=4, seed=7)
  data_state.restore_state(again, restored.data_state, "of step 5")
  assert again.position == 5
  for want in expected[5:]:
    got = next(again)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
  again.close()
  with pytest.raises(ValueError, match="seed"):
    DocumentIterator(docs, packing, global_batch_size=4, seed=8).set_state(restored.data_state["iterator"])
  # Another split of the batch over processes reads another shard, which the checkpoint lacks.
  other = DocumentIterator(docs, packing, global_batch_size=4, seed=7, process_index=1, process_count=2)
  with pytest.raises(ValueError, match=r"data shards \[0-of-1\], and this run reads shard 1-of-2"):
    data_state.restore_state(other, restored.data_state, "of step 5")
  other.close()


def test_eval_batches_are_fixed_and_fill_even_from_few_documents():
  docs = _documents(3)
  packing = Packing(seq_len=T, max_documents_per_row=2, bins=2)
  a = packed_eval_batches(docs, packing, batch_size=4, num_batches=3)
  b = packed_eval_batches(docs, packing, batch_size=4, num_batches=3)
  assert len(a) == 3 and all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))
  with pytest.raises(ValueError, match="no \\(input, target\\) pair"):
    packed_eval_batches([np.array([5], np.int32)], packing, batch_size=2, num_batches=1)


def test_packing_options_are_checked():
  with pytest.raises(ValueError, match="max_documents_per_row=0"):
    Packing(seq_len=T, max_documents_per_row=0)
  with pytest.raises(ValueError, match="prefetch=-1"):
    Packing(seq_len=T, prefetch=-1)
  assert Packing(seq_len=T, max_documents_per_row=5).max_segments == 6
