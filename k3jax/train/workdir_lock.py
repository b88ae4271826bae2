"""One trainer per run directory: `<workdir>/train.lock`, held with `flock` while a run writes there.

The file records its owner (pid, host, start time, command line) so that a
refused trainer can name it. The kernel drops an `flock` when its process
ends, however it ends, so a lock file left by a killed trainer is stale by
construction: the next trainer takes it over and logs whose it was. A run
directory that cannot be written (read-only media, no permission) is refused
with `WorkdirNotWritableError`, a full disk with `SaveFailedError`. Readers
(`experiments/generate.py`, `metrics.read_jsonl`, notebooks) take no lock.
Nothing here imports JAX.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
from typing import Any

from k3jax.train.cli_errors import InputError, SaveFailedError, os_cause

log = logging.getLogger(__name__)
LOCK_FILE = "train.lock"
_ATTEMPTS = 5  # a lock file replaced between open() and flock() is opened again
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class WorkdirLockedError(InputError):
  """Another live trainer holds the run directory's lock."""


class WorkdirNotWritableError(InputError):
  """The run directory cannot be written (read-only file system, no permission); nothing was written."""


def lock_path(workdir: str) -> str:
  return os.path.join(workdir, LOCK_FILE)


def _owner_record() -> dict[str, Any]:
  return {"pid": os.getpid(), "host": socket.gethostname(), "argv": sys.argv,
          "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def _read_owner(fd: int) -> dict[str, Any] | None:
  os.lseek(fd, 0, os.SEEK_SET)
  raw = b""
  while chunk := os.read(fd, 1 << 16):
    raw += chunk
  try:
    owner = json.loads(raw.decode("utf-8"))
  except ValueError:  # empty (an owner between its flock and its write) or torn
    return None
  return owner if isinstance(owner, dict) else None


def describe(owner: dict[str, Any] | None) -> str:
  """`pid 123 on host h (started ...: python experiments/train.py ...)`, or a stand-in when unknown."""
  if not owner:
    return "a process that has not yet recorded itself"
  text = f"pid {owner.get('pid')} on host {owner.get('host')}"
  details = [str(owner["started"])] if owner.get("started") else []
  if owner.get("argv"):
    details.append(" ".join(map(str, owner["argv"])))
  return text + (f" (started {': '.join(details)})" if details else "")


def _locked_message(workdir: str, owner: dict[str, Any] | None) -> str:
  pid = owner.get("pid") if owner else None
  stop = f"stop it (kill {pid}, which saves a checkpoint first)" if pid else "stop it"
  return (f"the run directory {workdir} is in use by another trainer: {describe(owner)}; lock file "
          f"{lock_path(workdir)}. Wait for that run to finish or {stop}, then run again; or give "
          "another --workdir.")


def _try_flock(fd: int, kind: int) -> bool:
  try:
    fcntl.flock(fd, kind | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      return False
    raise
  return True


def check_free(workdir: str) -> None:
  """Raises `WorkdirLockedError` when a live trainer holds `workdir`'s lock; writes nothing.

  Lets a second trainer refuse before it spends time on data and compilation.
  """
  try:
    fd = os.open(lock_path(workdir), os.O_RDONLY)
  except FileNotFoundError:
    return
  try:
    if not _try_flock(fd, fcntl.LOCK_SH):
      raise WorkdirLockedError(_locked_message(workdir, _read_owner(fd)))
  finally:
    os.close(fd)  # closing drops the probe's shared lock


class WorkdirLock:
  """The exclusive lock of one run directory, as a context manager (`with WorkdirLock(workdir):`)."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = lock_path(workdir)
    self._fd: int | None = None

  def acquire(self) -> "WorkdirLock":
    """Takes the lock (creating the directory's lock file), taking over a stale one with a warning.

    Raises:
      WorkdirLockedError: a live process holds it; the message names that process.
      WorkdirNotWritableError: the directory cannot be written (read-only media, permissions).
      SaveFailedError: another write failure (a full disk).
    """
    try:
      return self._acquire()
    except OSError as e:
      raise _write_error(self.workdir, self.path, e) from e

  def _acquire(self) -> "WorkdirLock":
    os.makedirs(self.workdir, exist_ok=True)
    for _ in range(_ATTEMPTS):
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      if not _try_flock(fd, fcntl.LOCK_EX):
        owner = _read_owner(fd)
        os.close(fd)
        raise WorkdirLockedError(_locked_message(self.workdir, owner))
      try:
        same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:  # its owner removed it between our open() and flock()
        same_file = False
      if not same_file:
        os.close(fd)
        continue
      previous = _read_owner(fd)
      if previous:  # written by a process that no longer holds the lock: it died without releasing
        log.warning("took over the stale lock %s of %s: that process is gone", self.path, describe(previous))
      os.ftruncate(fd, 0)
      os.lseek(fd, 0, os.SEEK_SET)
      os.write(fd, json.dumps(_owner_record()).encode("utf-8"))
      os.fsync(fd)
      self._fd = fd
      return self
    raise WorkdirLockedError(f"could not take the lock {self.path}: it was replaced {_ATTEMPTS} times "
                             "while this trainer tried; another trainer is starting there")

  def release(self) -> None:
    """Removes the lock file and drops the lock (in that order, so no one locks a removed file)."""
    if self._fd is None:
      return
    try:
      os.unlink(self.path)
    except FileNotFoundError:
      pass
    os.close(self._fd)
    self._fd = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def _write_error(workdir: str, path: str, e: OSError) -> Exception:
  """The error for a lock file that could not be created or written, naming the directory and the fix."""
  if e.errno in _NOT_WRITABLE:
    copy = (f" (to continue this run, copy it there first: cp -a {workdir} NEW_DIR)"
            if os.path.isdir(workdir) and os.listdir(workdir) else "")
    return WorkdirNotWritableError(
        f"the run directory {workdir} cannot be written: {os_cause(e)}. The trainer writes its lock "
        f"{LOCK_FILE}, config.json, metrics and checkpoints there, so it changed nothing and stopped. "
        f"Give a writable --workdir{copy}, or make the directory writable (remount it read-write, or "
        "fix its permissions).")
  return SaveFailedError(f"could not write the lock file {path} ({os_cause(e)}); nothing was trained. Free "
                         f"space where {workdir} lives (df -h {workdir}) and run the same command again.")
