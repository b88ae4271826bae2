"""Checkpoint integrity: checksums recorded at save, damaged steps skipped on restore with
their reason, the newest intact step restored, and a clear error when none is."""
import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.train import checkpoint as ckpt_lib
from k3jax.train.metrics import read_jsonl
from k3jax.train.trainer import train_and_evaluate
from tests.test_train import _StandIn, _shrunk_tiny, _stop_at


def _tree(scale):
  return {"w": jnp.arange(20000.0) * scale, "b": jnp.full((3,), scale, jnp.float32),
          "count": jnp.asarray(int(scale), jnp.int32)}


def _saved(directory, steps=(1, 2), *, async_save=False):
  mgr = ckpt_lib.Checkpointer(str(directory), async_save=async_save, max_to_keep=5)
  for s in steps:
    mgr.save(s, _tree(s), {"position": s})
  mgr.close()
  return str(directory)


def _biggest_file(step_dir):
  files = [os.path.join(root, f) for root, _, names in os.walk(os.path.join(step_dir, "state"))
           for f in names]
  return max(files, key=os.path.getsize)


def _flip_bytes(path, start=64, count=512):
  data = bytearray(open(path, "rb").read())
  for i in range(start, min(start + count, len(data))):
    data[i] ^= 0xFF
  with open(path, "wb") as f:
    f.write(data)


def _restore(directory):
  mgr = ckpt_lib.Checkpointer(directory, async_save=False)
  try:
    return mgr.restore_intact(_tree(0))
  finally:
    mgr.close()


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_record_checksums_that_verify(tmp_path, async_save):
  directory = _saved(tmp_path, async_save=async_save)
  assert sorted(os.listdir(directory)) == ["1", "2"]  # nothing else at orbax's level
  record = json.load(open(os.path.join(directory, "2", ckpt_lib.CHECKSUM_FILE)))
  assert any(rel.startswith("state/") for rel in record["files"])
  assert any(rel.startswith("data/") for rel in record["files"])
  restored = _restore(directory)
  assert restored.step == 2 and restored.verified and restored.skipped == []
  np.testing.assert_array_equal(restored.state["w"], np.arange(20000.0) * 2)
  assert restored.data_state == {"position": 2}


def test_bit_flipped_checkpoint_is_detected_and_the_previous_step_restored(tmp_path, caplog):
  directory = _saved(tmp_path)
  _flip_bytes(_biggest_file(os.path.join(directory, "2")))
  with caplog.at_level(logging.WARNING, logger="k3jax.train.checkpoint"):
    restored = _restore(directory)
  assert restored.step == 1 and restored.verified
  np.testing.assert_array_equal(restored.state["w"], np.arange(20000.0))
  [(step, reason)] = restored.skipped
  assert step == 2 and "SHA-256" in reason
  assert "checkpoint step 2" in caplog.text and "skipped" in caplog.text


def _truncate(step_dir):
  path = _biggest_file(step_dir)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _empty_data_item(step_dir):
  for root, _, names in os.walk(os.path.join(step_dir, "data")):
    for name in names:
      open(os.path.join(root, name), "w").close()


def _delete_state_file(step_dir):
  os.remove(_biggest_file(step_dir))


def _delete_data_item_and_checksums(step_dir):
  # Without the checksum record only orbax's own read can tell; it must still fall back.
  import shutil
  shutil.rmtree(os.path.join(step_dir, "data"))
  os.remove(os.path.join(step_dir, ckpt_lib.CHECKSUM_FILE))


@pytest.mark.parametrize("damage,reason", [
    (_truncate, "truncated"), (_empty_data_item, "bytes"), (_delete_state_file, "missing"),
    (_delete_data_item_and_checksums, "orbax could not read it")])
def test_truncated_emptied_or_missing_files_fall_back(tmp_path, damage, reason):
  directory = _saved(tmp_path)
  damage(os.path.join(directory, "2"))
  restored = _restore(directory)
  assert restored.step == 1
  assert restored.skipped[0][0] == 2 and reason in restored.skipped[0][1]
  assert len(restored.skipped[0][1].splitlines()) == 1  # one line, not an orbax traceback


def test_checkpoint_without_checksums_restores_unverified(tmp_path, caplog):
  directory = _saved(tmp_path)
  os.remove(os.path.join(directory, "2", ckpt_lib.CHECKSUM_FILE))
  with caplog.at_level(logging.WARNING, logger="k3jax.train.checkpoint"):
    restored = _restore(directory)
  assert restored.step == 2 and not restored.verified and restored.skipped == []
  assert "without verification" in caplog.text


def test_no_intact_checkpoint_names_the_directory_the_steps_and_the_fix(tmp_path):
  directory = _saved(tmp_path / "checkpoints")
  for s in ("1", "2"):
    _flip_bytes(_biggest_file(os.path.join(directory, s)))
  with pytest.raises(ckpt_lib.CheckpointError) as info:
    _restore(directory)
  message = str(info.value)
  assert directory in message and str(tmp_path) in message
  assert "step 2:" in message and "step 1:" in message and "SHA-256" in message
  assert f"mv {directory} {directory}.broken" in message
  assert "\n" not in message


def test_a_step_that_is_not_saved_lists_the_saved_ones(tmp_path):
  directory = _saved(tmp_path, steps=(3, 5))
  mgr = ckpt_lib.Checkpointer(directory, async_save=False)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"no checkpoint of step 4 .*saved steps: 3, 5"):
    mgr.restore_intact(_tree(0), step=4)
  assert mgr.restore_intact(_tree(0), step=3).step == 3
  mgr.close()


def test_non_finite_values_are_rejected_on_restore(tmp_path):
  mgr = ckpt_lib.Checkpointer(str(tmp_path), async_save=False)
  mgr.save(1, _tree(1), {"position": 1})
  mgr.save(2, {**_tree(2), "b": jnp.asarray([1.0, jnp.nan, 2.0])}, {"position": 2})
  restored = mgr.restore_intact(_tree(0))
  mgr.close()
  assert restored.step == 1 and restored.skipped == [(2, "b holds NaN or inf")]


def test_trainer_resumes_from_the_newest_intact_checkpoint_exactly(tmp_path, caplog):
  c = _shrunk_tiny(num_steps=5, checkpoint_every=1, eval_every=0, keep_checkpoints=3)
  model_fn = lambda rngs: _StandIn(256, 16, rngs=rngs)
  full = train_and_evaluate(c, str(tmp_path / "full"), model_fn=model_fn)
  run = tmp_path / "run"
  first = train_and_evaluate(c, str(run), model_fn=model_fn, hooks=[_stop_at(3)])
  assert first["interrupted"] and sorted(os.listdir(run / "checkpoints")) == ["1", "2", "3"]
  _flip_bytes(_biggest_file(str(run / "checkpoints" / "3")))
  with caplog.at_level(logging.WARNING):
    second = train_and_evaluate(c, str(run), model_fn=model_fn)
  assert second["resumed_from"] == 2 and second["step"] == 5
  assert second["skipped_checkpoints"][0][0] == 3
  assert "checkpoint step 3" in caplog.text and "SHA-256" in caplog.text
  # The damaged step was moved aside (and saved again by the resumed run).
  assert os.listdir(run / "checkpoints.rejected") == ["3"]
  losses = lambda d: [(r["step"], r["loss"]) for r in read_jsonl(str(d / "metrics.jsonl"), "train")]
  assert losses(run) == losses(tmp_path / "full")
  assert second["eval"] == full["eval"]
