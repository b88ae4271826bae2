"""`experiments/train.py` under real I/O faults and signals, in real processes: a read-only run
directory (fresh, finished, continued), a disk that fills up during the run (the run stops with
EXIT_SAVE_FAILED, and a rerun with room resumes from the newest intact checkpoint), and SIGTERM
while the first steps compile (the process ends at once with EXIT_PREEMPTED).

The faults are real file systems: a tmpfs of a few MiB, and a bind mount remounted read-only (root
ignores permission bits, a read-only mount it does not). Each mount lives in a mount namespace of
its own (`unshare -m`; `unshare -rm`, a user namespace, for a normal user), so nothing outside the
test sees it; where the system allows neither, those tests skip and say why.
"""
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from k3jax.train import cli_errors
from k3jax.train import workdir_lock
from tests.test_train_cli import ROOT, SHRUNK, TRAIN, _env, _error_paragraph, _train

_CONFIG = "--config=" + os.path.join(ROOT, "configs", "tiny.py")
# Checkpoints at steps 2, 4, 6, ... of ~0.8 MB each on the shrunk model: a 2 MiB disk holds two.
_FILLS_UP = ["--config.num_steps=10", "--config.checkpoint_every=2", "--config.keep_checkpoints=10"]
_SMALL_DISK = "2m"


def _unshare_prefix() -> tuple[list[str] | None, str]:
  """The command prefix that runs a shell in a new mount namespace where it may mount, or None
  and the reason it cannot."""
  prefix = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
  try:
    probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt || "
                            "mount -t tmpfs -o size=1m tmpfs /tmp"], capture_output=True, text=True,
                           timeout=30)
  except (OSError, subprocess.TimeoutExpired) as e:
    return None, f"cannot run {' '.join(prefix)}: {e}"
  if probe.returncode != 0:
    return None, (f"{' '.join(prefix)} cannot mount a tmpfs here ({probe.stderr.strip()}); unprivileged "
                  "user namespaces may be disabled, so no read-only or full file system can be made")
  return prefix, ""


_PREFIX, _WHY = _unshare_prefix()
needs_mounts = pytest.mark.skipif(_PREFIX is None, reason=_WHY)


def _in_namespace(script: str, timeout: int = 600) -> subprocess.CompletedProcess:
  """Runs a shell script in a mount namespace of its own; its mounts vanish when it ends."""
  return subprocess.run([*_PREFIX, "sh", "-c", script], capture_output=True, text=True, env=_env(),
                        cwd=ROOT, timeout=timeout)


def _train_command(workdir, *args) -> str:
  return " ".join(shlex.quote(a) for a in [sys.executable, TRAIN, _CONFIG, f"--workdir={workdir}", *args])


def _records(workdir, split="train") -> list[int]:
  path = os.path.join(workdir, "metrics.jsonl")
  steps = []
  for line in open(path, encoding="utf-8"):
    try:
      record = json.loads(line)
    except ValueError:  # a line torn by the full disk
      continue
    if record["split"] == split:
      steps.append(record["step"])
  return steps


def _steps(workdir) -> list[int]:
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def _tree(path) -> dict:
  """{relative path: (size, mtime_ns)} of everything under `path`."""
  out = {}
  for root, dirs, files in os.walk(path):
    for name in dirs + files:
      full = os.path.join(root, name)
      st = os.lstat(full)
      out[os.path.relpath(full, path)] = (st.st_size if name in files else 0, st.st_mtime_ns)
  return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A run directory that reached num_steps=2 (its checkpoint is step 2)."""
  workdir = tmp_path_factory.mktemp("finished") / "run"
  result = _train(workdir, *SHRUNK, "--config.num_steps=2", timeout=600)
  assert result.returncode == cli_errors.EXIT_FINISHED, result.stderr
  return workdir


@needs_mounts
def test_read_only_run_directory(tmp_path, finished_run):
  """Finished: `nothing to do`, status 0. Continued or fresh: one paragraph naming the directory
  and the fix, status 2. Nothing changes in either directory."""
  empty, out = tmp_path / "empty", tmp_path / "out"
  empty.mkdir()
  out.mkdir()
  before = _tree(finished_run)
  runs = {"finished": (finished_run, ["--config.num_steps=2"]),
          "continued": (finished_run, ["--config.num_steps=3"]),
          "fresh": (empty / "run", ["--config.num_steps=2"])}
  script = [f"mount --bind {d} {d} && mount -o remount,bind,ro {d} || exit 9" for d in (finished_run, empty)]
  for name, (workdir, args) in runs.items():
    script.append(f"{_train_command(workdir, *SHRUNK, *args)} >{out}/{name}.out 2>{out}/{name}.err; "
                  f"echo $? >{out}/{name}.rc")
  result = _in_namespace("\n".join(script))
  assert result.returncode == 0, result.stderr

  def outcome(name):
    return (int((out / f"{name}.rc").read_text()), (out / f"{name}.out").read_text(),
            (out / f"{name}.err").read_text())

  rc, stdout, stderr = outcome("finished")
  assert rc == cli_errors.EXIT_FINISHED, stderr
  assert "nothing to do" in stdout.strip().splitlines()[-1], stdout
  for name, workdir in (("continued", finished_run), ("fresh", empty / "run")):
    rc, _, stderr = outcome(name)
    assert rc == cli_errors.EXIT_INPUT_ERROR, stderr
    paragraph = _error_paragraph(stderr)
    assert f"the run directory {workdir} cannot be written: Read-only file system (EROFS)" in paragraph
    assert "Give a writable --workdir" in paragraph and "remount it read-write" in paragraph
  assert _tree(finished_run) == before
  assert not os.listdir(empty)


@needs_mounts
@pytest.mark.parametrize("async_save", [True, False])
def test_full_disk_stops_the_run_and_the_rerun_resumes(tmp_path, async_save):
  """The save that does not fit stops the run with EXIT_SAVE_FAILED and one paragraph; no step
  begins once the failure is known (an asynchronous save is checked before every step, so the
  steps that ran while it was written are the only ones past it); the committed checkpoints stay,
  and the same command on a disk with room resumes from the newest and finishes."""
  mnt, copy = tmp_path / "disk", tmp_path / "copy"
  mnt.mkdir()
  args = [*SHRUNK, *_FILLS_UP, f"--config.async_checkpoints={async_save}"]
  # The run directory is copied out before the namespace, and its tmpfs, go away.
  full = _in_namespace(f"mount -t tmpfs -o size={_SMALL_DISK} tmpfs {mnt} || exit 9\n"
                       f"{_train_command(mnt / 'run', *args)}; rc=$?; cp -a {mnt}/run {copy}; exit $rc")
  assert full.returncode == cli_errors.EXIT_SAVE_FAILED, full.stderr
  paragraph = _error_paragraph(full.stderr)
  assert "No space left on device (ENOSPC)" in paragraph, paragraph
  failed = int(paragraph.split("could not save the checkpoint of step ")[1].split(" ")[0])
  stopped = int(paragraph.split("The run stopped after step ")[1].split(":")[0])
  kept = int(paragraph.split("The newest checkpoint kept is step ")[1].split(" ")[0])
  assert kept < failed <= stopped < 10, paragraph
  if not async_save:
    assert stopped == failed  # the save runs before the next step
  assert max(_records(copy)) <= stopped
  assert _steps(copy)[-1] == kept and kept >= 2  # the disk held a checkpoint before it filled up
  assert not (copy / workdir_lock.LOCK_FILE).exists()

  if not async_save:
    return  # one rerun shows the resume; the two modes leave the same committed steps behind
  rerun = _train(copy, *args, timeout=600)
  assert rerun.returncode == cli_errors.EXIT_FINISHED, rerun.stderr
  assert f"resumed from step {kept} in {copy / 'checkpoints'} (checksums verified)" in rerun.stderr
  assert rerun.stdout.strip().splitlines()[-1].startswith(f"step 10 of 10 (resumed from step {kept})")
  assert _steps(copy)[-1] == 10
  assert sorted(_records(copy)) == list(range(1, 11))  # one record per step, the redone ones once


def test_sigterm_while_compiling_exits_at_once(tmp_path):
  """SIGTERM before the first step (here while the step-0 evaluation and the training step
  compile) ends the process within moments with EXIT_PREEMPTED, saving nothing and releasing the
  lock; it does not wait for the compilation to finish."""
  workdir = tmp_path / "run"
  # Without the tests' compilation cache: the signal must arrive while the programs compile.
  proc = subprocess.Popen([sys.executable, TRAIN, _CONFIG, f"--workdir={workdir}", *SHRUNK,
                           "--config.num_steps=5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=_env(shared_cache=False), cwd=ROOT)
  try:
    seen = []
    for line in proc.stderr:  # "model: ..." comes right before the compilations start
      seen.append(line)
      if "model: " in line and "parameters" in line:
        break
    else:
      pytest.fail("the trainer ended before it built the model:\n" + "".join(seen))
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stderr = proc.stderr.read()
    proc.wait(timeout=120)
    elapsed = time.monotonic() - sent
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == cli_errors.EXIT_PREEMPTED, stderr
  assert "received SIGTERM before the first training step" in stderr, stderr
  # 0.03-0.09 s on a 2-core CPU; the bound leaves room for a loaded machine, far below a compilation.
  assert elapsed < 10, f"{elapsed:.1f} s from SIGTERM to exit"
  assert _records(workdir) == []  # no training step ran
  assert _steps(workdir) == []
  assert not (workdir / workdir_lock.LOCK_FILE).exists()


@needs_mounts
def test_full_disk_for_the_metric_records_stops_the_run(tmp_path):
  """A disk too small for the metric records (24 KiB; no checkpoint before step 80): the record
  that does not fit, in metrics.jsonl or in TensorBoard's events (written by a thread of their
  own), stops the run with EXIT_SAVE_FAILED at the next step, where a dead TensorBoard writer
  thread once left the trainer blocked forever."""
  mnt, copy = tmp_path / "disk", tmp_path / "copy"
  mnt.mkdir()
  full = _in_namespace(f"mount -t tmpfs -o size=24k tmpfs {mnt} || exit 9\n"
                       f"{_train_command(mnt / 'run', *SHRUNK, '--config.num_steps=80')}; rc=$?; "
                       f"cp -a {mnt}/run {copy}; exit $rc", timeout=300)
  assert full.returncode == cli_errors.EXIT_SAVE_FAILED, full.stderr
  paragraph = _error_paragraph(full.stderr)
  assert f"could not write the metric records (metrics.jsonl, tb/) in {mnt / 'run'}: No space left on " \
         "device (ENOSPC)" in paragraph, paragraph
  assert "No checkpoint was saved" in paragraph and "starts over" in paragraph
  stopped = int(paragraph.split("The run stopped after step ")[1].split(":")[0])
  assert max(_records(copy)) <= stopped < 80
  assert _steps(copy) == []
