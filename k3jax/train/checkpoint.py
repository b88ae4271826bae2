"""Orbax checkpoints of the whole TrainState plus the data position, and save-on-signal."""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)
_STATE, _DATA = "state", "data"


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


class Checkpointer:
  """An orbax CheckpointManager over {"state": TrainState pytree, "data": iterator position (JSON)}."""

  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = directory
    self.manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=async_save),
        item_names=(_STATE, _DATA))

  def latest_step(self) -> int | None:
    """The newest saved step, or None."""
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_state: dict[str, Any]) -> None:
    """Saves (asynchronously) the state and the data-iterator position under `step`."""
    self.manager.save(step, args=ocp.args.Composite(
        **{_STATE: ocp.args.StandardSave(to_nested_dict(state)), _DATA: ocp.args.JsonSave(data_state)}),
        force=True)

  def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any]] | None:
    """Restores (state, data_state) at `step` (default: latest) into `template`'s structure and shardings.

    Returns None when there is no checkpoint.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        to_nested_dict(template))
    restored = self.manager.restore(step, args=ocp.args.Composite(
        **{_STATE: ocp.args.StandardRestore(abstract), _DATA: ocp.args.JsonRestore()}))
    return from_nested_dict(template, restored[_STATE]), dict(restored[_DATA])

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    """Finishes pending saves and releases the manager."""
    self.manager.wait_until_finished()
    self.manager.close()


class SignalGuard:
  """Context manager that turns SIGTERM/SIGINT into a flag the loop polls, so it can save first.

  A second signal of the same kind while a save is pending is left to the previous
  handler (for example, a second Ctrl-C interrupts at once).
  """

  def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
    self.signals = signals
    self.received: int | None = None
    self._previous: dict[int, Any] = {}

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
    log.warning("received signal %d: saving a checkpoint before exit", signum)
    self.received = signum

  def __enter__(self) -> "SignalGuard":
    if threading.current_thread() is threading.main_thread():
      for s in self.signals:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, previous in self._previous.items():
      signal.signal(s, previous)
    self._previous.clear()
