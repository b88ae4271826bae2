"""Orbax checkpoints of the whole TrainState plus the data position, their checksums, and save-on-signal.

A save that fails (a full disk, an I/O error; synchronous or asynchronous) raises
`SaveFailedError` naming the step and the cause. Orbax commits a step by renaming
its temporary directory, so a failed save leaves the committed steps as they were
and deletes none of them.

Every saved step directory holds `k3jax_checksums.json`: the size and SHA-256 of
each file orbax wrote. Restoring verifies it first, so flipped, truncated or
missing bytes are caught before any value reaches the model; the newest
intact checkpoint is restored and every skipped step is logged with its reason.

A state is saved in its own layout. A pipelined model stores its layers
stacked per stage (`k3jax.parallel.stage_storage`); restoring such a
checkpoint under another stage count, or into the plain model (and the
reverse), reads it into host memory, moves the layers to the template's
layout there, and places each array on the template's sharding. Top-level
entries a saved state holds and the template does not (the step RNG that
earlier versions saved) are read on the host and dropped.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from k3jax.parallel import stage_storage
from k3jax.train.cli_errors import SaveFailedError, os_cause

log = logging.getLogger(__name__)
_STATE, _DATA = "state", "data"
CHECKSUM_FILE = "k3jax_checksums.json"
# Orbax's own step metadata is rewritten while a step is committed; the items' files are the content.
_UNHASHED = ("_CHECKPOINT_METADATA", CHECKSUM_FILE)
# Orbax writes a step into `<step><suffix>` and renames it when the save is complete.
_TMP_SUFFIX = ".orbax-checkpoint-tmp"
_HASH_BLOCK = 1 << 22


class CheckpointError(RuntimeError):
  """No checkpoint in a directory could be restored (or the one asked for does not exist)."""


class _Rejected(Exception):
  """One step's checkpoint cannot be used; the message says why."""


def _key_name(entry: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  raise ValueError(f"unsupported pytree path entry {entry!r}")


def to_nested_dict(tree: Any) -> dict:
  """Maps any pytree (nnx.State, optax namedtuples, dataclasses) to a nested dict of its leaves.

  Keys are the path entries as strings, so the saved layout reads like the model
  (`params/layers/0/attn/q_proj/kernel/value`) and does not depend on pytree node classes.
  """
  out: dict = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    node = out
    names = [_key_name(p) for p in path] or ["value"]
    for name in names[:-1]:
      node = node.setdefault(name, {})
    if names[-1] in node:
      raise ValueError(f"two leaves map to the same checkpoint key {'/'.join(names)}")
    node[names[-1]] = leaf
  return out


def from_nested_dict(template: Any, nested: dict) -> Any:
  """Inverse of `to_nested_dict`: fills `template`'s structure with the leaves found in `nested`."""
  leaves = []
  paths, treedef = jax.tree_util.tree_flatten_with_path(template)
  for path, _ in paths:
    node = nested
    for name in [_key_name(p) for p in path] or ["value"]:
      node = node[name]
    leaves.append(node)
  return jax.tree_util.tree_unflatten(treedef, leaves)


def saved_steps(directory: str) -> list[int]:
  """The committed steps under a checkpoint directory, ascending. Creates nothing."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory)
                if name.isdigit() and os.path.isdir(os.path.join(directory, name)))


def _hashed(rel_path: str) -> bool:
  name = os.path.basename(rel_path)
  return not (name in _UNHASHED or name == "commit_success.txt" or name.startswith(CHECKSUM_FILE))


def file_digests(step_dir: str) -> dict[str, list]:
  """{path relative to `step_dir`: [size in bytes, SHA-256 hex]} of every content file of one step."""
  out: dict[str, list] = {}
  for root, dirs, files in os.walk(step_dir):
    dirs.sort()
    for name in sorted(files):
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir)
      if not _hashed(rel):
        continue
      digest, size = hashlib.sha256(), 0
      with open(path, "rb") as f:
        for block in iter(lambda: f.read(_HASH_BLOCK), b""):
          digest.update(block)
          size += len(block)
      out[rel] = [size, digest.hexdigest()]
  return out


def write_checksums(step_dir: str) -> None:
  """Records `file_digests(step_dir)` in `<step_dir>/k3jax_checksums.json` (written atomically)."""
  record = {"format": 1, "files": file_digests(step_dir)}
  tmp = os.path.join(step_dir, CHECKSUM_FILE + ".partial")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1, sort_keys=True)
  os.replace(tmp, os.path.join(step_dir, CHECKSUM_FILE))


def verify_checksums(step_dir: str) -> bool:
  """Compares a step's files with its recorded checksums.

  Returns True when every file matches, False when the step has no checksum
  file (written before checksums existed, or the process died between the
  commit and the record). Raises `_Rejected` naming the first bad file.
  """
  path = os.path.join(step_dir, CHECKSUM_FILE)
  if not os.path.isfile(path):
    return False
  try:
    with open(path, encoding="utf-8") as f:
      recorded = json.load(f)["files"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise _Rejected(f"its checksum file is unreadable ({type(e).__name__})") from None
  actual = file_digests(step_dir)
  for rel, (size, digest) in sorted(recorded.items()):
    if rel not in actual:
      raise _Rejected(f"file {rel} is missing")
    got_size, got_digest = actual[rel]
    if got_size != size:
      raise _Rejected(f"file {rel} has {got_size} bytes, {size} were saved (truncated or overwritten)")
    if got_digest != digest:
      raise _Rejected(f"file {rel} fails its SHA-256 checksum (its bytes changed after the save)")
  extra = sorted(set(actual) - set(recorded))
  if extra:
    raise _Rejected(f"file {extra[0]} was not part of the save")
  return True


def _on_host(metadata: Any) -> Any:
  """A restore target of host arrays for a saved tree's metadata."""
  return jax.tree.map(lambda m: np.empty(m.shape, m.dtype), metadata)


def _place(host: dict, abstract: dict) -> dict:
  """Host arrays onto the shardings of `abstract` (ShapeDtypeStructs of the same tree)."""
  def one(x, a):
    x = np.asarray(x, dtype=a.dtype)
    if x.shape != a.shape:
      raise ValueError(f"saved shape {x.shape} where the template has {a.shape}")
    if a.sharding is None:
      return jnp.asarray(x)
    return jax.make_array_from_callback(a.shape, a.sharding, lambda index: x[index])
  return jax.tree.map(one, host, abstract)


@jax.jit
def _all_finite(leaves: list) -> jax.Array:
  return jnp.stack([jnp.isfinite(x).all() for x in leaves])


def _first_non_finite(tree: Any) -> str | None:
  """Path of the first floating leaf holding a NaN/inf, or None.

  One jitted program checks every leaf. A reduction per leaf would dispatch
  one program per sharded array, each with its own cross-device reduction;
  on CPU devices that share a small thread pool, such programs in flight at
  once can wait on each other's participants forever.
  """
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  floats = [(p, x) for p, x in flat if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
  if not floats:
    return None
  finite = np.asarray(jax.device_get(_all_finite([x for _, x in floats])))
  for (path, _), ok in zip(floats, finite):
    if not bool(ok):
      return "/".join(_key_name(p) for p in path)
  return None


def _short(e: BaseException) -> str:
  """One line of an exception: its type and the first line of its message."""
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  text = lines[0] if lines else ""
  return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


@dataclasses.dataclass
class Restored:
  """The outcome of `Checkpointer.restore_intact`.

  Attributes:
    state: the restored tree, in the template's structure and shardings.
    data_state: the JSON item saved with it (the data-iterator position).
    step: the step restored.
    verified: whether its checksums were checked (False: saved without them).
    skipped: (step, reason) of each newer checkpoint that could not be used.
  """
  state: Any
  data_state: dict[str, Any]
  step: int
  verified: bool
  skipped: list[tuple[int, str]]


class Checkpointer:
  """An orbax CheckpointManager over {"state": TrainState pytree, "data": iterator position (JSON)}.

  Each committed step carries checksums of its files (see the module docstring).
  """

  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = directory
    self.async_save = async_save
    self._sealing: int | None = None  # the step whose checksums the asynchronous commit writes
    self._in_flight: int | None = None  # the step of the save not yet known to have succeeded
    options = dict(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save)
    if async_save:  # checksums go into the step's directory before orbax commits it
      options["async_options"] = ocp.AsyncOptions(post_finalization_callback=self._seal_pending)
    self.manager = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(**options),
        # Handlers named up front, so a step's saved tree can be read before a restore.
        item_handlers={_STATE: ocp.StandardCheckpointHandler(),
                       _DATA: ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    """The newest saved step, or None."""
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    """Every saved step, ascending."""
    return sorted(self.manager.all_steps())

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _seal(self, step: int) -> None:
    if jax.process_index() != 0:
      return
    # While the asynchronous commit runs the files are still in the temporary directory;
    # checksums written there are committed (renamed) together with them. A failed write
    # raises: in the asynchronous commit it keeps the step uncommitted, and either way the
    # disk that refused it would refuse the next write too.
    staged = sorted(glob.glob(glob.escape(self._step_dir(step)) + _TMP_SUFFIX + "*"))
    write_checksums(staged[0] if staged else self._step_dir(step))

  def _seal_pending(self) -> None:
    if self._sealing is not None:
      self._seal(self._sealing)
      self._sealing = None

  def _failed(self, step: int | None, e: Exception) -> SaveFailedError:
    what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
    return SaveFailedError(f"could not save {what} in {self.directory}: {os_cause(e)}")

  def save(self, step: int, state: Any, data_state: dict[str, Any]) -> None:
    """Saves (asynchronously) the state and the data-iterator position under `step`, with checksums.

    Raises:
      SaveFailedError: this save failed (synchronous), or the previous asynchronous one did.
    """
    self.wait()  # one save in flight: `_sealing` names it
    self._sealing = step if self.async_save else None
    self._in_flight = step
    try:
      self.manager.save(step, args=ocp.args.Composite(
          **{_STATE: ocp.args.StandardSave(to_nested_dict(state)), _DATA: ocp.args.JsonSave(data_state)}),
          force=True)
      if not self.async_save:
        self._seal(step)
    except Exception as e:  # orbax and tensorstore raise many types for one failed write
      self._in_flight = None
      raise self._failed(step, e) from e
    if not self.async_save:
      self._in_flight = None

  def check(self) -> None:
    """Raises `SaveFailedError` when the asynchronous save has finished and failed; never waits
    for one still in flight (the training loop calls it before every step)."""
    if self._in_flight is not None and not self.manager.is_saving_in_progress():
      self.wait()

  def _restore_step(self, template: Any, step: int) -> tuple[Any, dict[str, Any], bool]:
    verified = verify_checksums(self._step_dir(step))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        to_nested_dict(template))
    try:
      saved = getattr(self.manager.item_metadata(step)[_STATE], "tree", None)
      if saved is None:
        raise ValueError("no metadata of the saved tree")
      stages = stage_storage.stage_count(abstract)
      moved = stage_storage.stage_count(saved) != stages
      # Another layer layout: read on the host, move the layers there, then place.
      target = _on_host(saved) if moved else dict(abstract, **{
          name: _on_host(tree) for name, tree in saved.items() if name not in abstract})
      restored = self.manager.restore(step, args=ocp.args.Composite(
          **{_STATE: ocp.args.StandardRestore(target), _DATA: ocp.args.JsonRestore()}))
      nested = {name: tree for name, tree in restored[_STATE].items() if name in abstract}
      if moved:
        nested = _place(stage_storage.convert_layout(nested, stages), abstract)
      state = from_nested_dict(template, nested)
      data_state = restored[_DATA]
      if not isinstance(data_state, dict):
        raise ValueError(f"the data item is {type(data_state).__name__}, not a dict")
    except Exception as e:  # orbax raises many types for damaged files; each means "unusable"
      raise _Rejected(f"orbax could not read it ({_short(e)})") from None
    bad = _first_non_finite(state)
    if bad is not None:
      raise _Rejected(f"{bad} holds NaN or inf")
    return state, dict(data_state), verified

  def restore_intact(self, template: Any, step: int | None = None) -> Restored | None:
    """Restores the newest intact checkpoint (or exactly `step`) into `template`'s structure and shardings.

    A checkpoint is intact when its files match their checksums, orbax reads it
    and every floating value is finite. Newer ones that are not are logged and
    listed in `Restored.skipped`. Returns None when there is no checkpoint.

    Raises:
      CheckpointError: `step` is not saved or not intact, or no checkpoint is intact.
    """
    steps = self.all_steps()
    if step is not None and step not in steps:
      have = ", ".join(map(str, steps)) or "none"
      raise CheckpointError(f"there is no checkpoint of step {step} in {self.directory}; "
                            f"saved steps: {have}")
    if not steps:
      return None
    skipped: list[tuple[int, str]] = []
    for s in [step] if step is not None else steps[::-1]:
      try:
        state, data_state, verified = self._restore_step(template, s)
      except _Rejected as e:
        log.warning("checkpoint step %d in %s skipped: %s", s, self.directory, e)
        skipped.append((s, str(e)))
        continue
      if not verified:
        log.warning("checkpoint step %d in %s has no checksum file; restored without verification",
                    s, self.directory)
      return Restored(state, data_state, s, verified, skipped)
    tried = "; ".join(f"step {s}: {why}" for s, why in skipped)
    raise CheckpointError(
        f"no intact checkpoint in {self.directory} (tried {tried}), so the run in "
        f"{os.path.dirname(os.path.abspath(self.directory))} cannot resume. To start it fresh, move "
        f"the checkpoints aside (mv {self.directory} {self.directory}.broken) and run again, or "
        "give a new run directory.")

  def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any]] | None:
    """`restore_intact` returning only (state, data_state), or None when there is no checkpoint."""
    restored = self.restore_intact(template, step)
    return None if restored is None else (restored.state, restored.data_state)

  def set_aside(self, steps: list[int]) -> list[str]:
    """Moves the given steps' directories to `<directory>.rejected/` (kept for inspection, out of
    orbax's sight, so that a resumed run can save those steps again). Returns the new paths."""
    moved = []
    if jax.process_index() == 0:
      aside = self.directory.rstrip(os.sep) + ".rejected"
      os.makedirs(aside, exist_ok=True)
      for s in steps:
        target, n = os.path.join(aside, str(s)), 1
        while os.path.exists(target):
          target, n = os.path.join(aside, f"{s}.{n}"), n + 1
        os.replace(self._step_dir(s), target)
        moved.append(target)
    return moved

  def reload(self) -> None:
    """Re-reads the saved steps from disk (after `set_aside`)."""
    self.manager.reload()

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk.

    Raises:
      SaveFailedError: the pending save failed.
    """
    step, self._in_flight = self._in_flight, None
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # orbax re-raises the background thread's error here
      raise self._failed(step, e) from e

  def close(self) -> None:
    """Finishes pending saves and releases the manager (also when the pending save failed,
    which it then raises as `SaveFailedError`)."""
    try:
      self.wait()
    except SaveFailedError:
      try:
        self.manager.close()
      except Exception as e:  # pylint: disable=broad-except  # the failure being raised says more
        log.warning("closing the checkpoint manager of %s after a failed save: %s", self.directory, _short(e))
      raise
    self.manager.close()


class SignalGuard:
  """Context manager that turns SIGTERM/SIGINT into a flag the loop polls, so it can save first.

  A second signal of the same kind while a save is pending is left to the previous
  handler (for example, a second Ctrl-C interrupts at once).

  With `exit_status`, a signal that arrives before `ready()` (before the first training
  step has been compiled and dispatched: nothing new to save) ends the process within
  moments with that status, after `before_exit` (the lock's release). Python runs signal
  handlers in the main thread between bytecodes, so a handler cannot act while the main
  thread waits in XLA's compiler, one C++ call that can take minutes. CPython's C-level
  handler does write the signal's number to the wakeup fd (`signal.set_wakeup_fd`) at once,
  whatever the main thread is doing, and the compiler releases the GIL: a watchdog thread
  blocked on that pipe wakes and ends the process with `os._exit`. That skips Python's
  clean-up as a SIGKILL would, which the run directory is written to survive at any point
  (config.json replaced atomically, torn metric lines set aside, a stale lock taken over).
  """

  def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT), *,
               exit_status: int | None = None, before_exit: Callable[[], None] | None = None):
    self.signals = signals
    self.received: int | None = None
    self._previous: dict[int, Any] = {}
    self.exit_status, self.before_exit = exit_status, before_exit
    self._early = threading.Lock()  # held while the watchdog decides, so `ready()` cannot interleave
    self._armed = False
    self._pipe: tuple[int, int] | None = None
    self._previous_fd = -1
    self._watchdog: threading.Thread | None = None

  def _handle(self, signum, frame):
    del frame
    if self.received is not None:
      previous = self._previous.get(signum)
      if callable(previous):
        previous(signum, None)
      else:  # SIG_DFL: let the second signal act as if the guard were absent
        signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        os.kill(os.getpid(), signum)
      return
    if not self._armed:  # armed, the watchdog ends the process and says so
      log.warning("received signal %d: saving a checkpoint before exit", signum)
    self.received = signum

  def ready(self) -> None:
    """The first step is under way: from now on a signal stops the loop after a save."""
    with self._early:
      self._armed = False

  def _watch(self, read_fd: int) -> None:
    while data := os.read(read_fd, 64):  # empty: the write end was closed by `__exit__`
      for signum in data:
        if signum in self.signals:
          with self._early:
            if self._armed:
              self._exit_now(signum)

  def _exit_now(self, signum: int) -> None:
    log.warning("received %s before the first training step: nothing new to save, exiting now with "
                "status %d; the same command starts again from the newest checkpoint (or from step 0)",
                signal.Signals(signum).name, self.exit_status)
    if self.before_exit is not None:
      self.before_exit()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(self.exit_status)

  def _start_watchdog(self) -> None:
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the C handler must never block on a full pipe
    self._pipe = (read_fd, write_fd)
    self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    self._armed = True
    self._watchdog = threading.Thread(target=self._watch, args=(read_fd,), name="signal_watchdog",
                                      daemon=True)
    self._watchdog.start()

  def _stop_watchdog(self) -> None:
    signal.set_wakeup_fd(self._previous_fd)
    read_fd, write_fd = self._pipe
    os.close(write_fd)
    self._watchdog.join()
    os.close(read_fd)
    self._pipe = self._watchdog = None

  def __enter__(self) -> "SignalGuard":
    if threading.current_thread() is threading.main_thread():
      for s in self.signals:
        self._previous[s] = signal.signal(s, self._handle)
      if self.exit_status is not None:
        self._start_watchdog()
    return self

  def __exit__(self, *exc) -> None:
    self.ready()
    if self._pipe is not None:
      self._stop_watchdog()
    for s, previous in self._previous.items():
      signal.signal(s, previous)
    self._previous.clear()
