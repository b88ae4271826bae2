"""Metric writers: one JSONL line per record and TensorBoard scalars (tensorboardX)."""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

import numpy as np


def _to_float(v: Any) -> float | None:
  try:
    f = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return f


SUPERSEDED_FILE = "metrics.superseded.jsonl"


def drop_superseded(workdir: str, last_kept_step: int) -> int:
  """Moves the records past `last_kept_step` out of `<workdir>/metrics.jsonl`; returns how many lines moved.

  A run that resumes from the checkpoint of step s redoes the steps after s,
  so their old records (and lines torn by a kill) are superseded: they are
  appended to `<workdir>/metrics.superseded.jsonl`, a backup, and the file
  keeps the records of steps <= s. `last_kept_step=-1` (a fresh start) moves
  every line. The backup is written before the file is replaced, so a kill
  in between loses nothing.
  """
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    return 0
  kept, dropped = [], []
  with open(path, encoding="utf-8", errors="replace") as f:
    for line in f:
      if not line.strip():
        continue
      line = line.rstrip("\n") + "\n"
      try:
        whole = int(json.loads(line)["step"]) <= last_kept_step
      except (ValueError, TypeError, KeyError):
        whole = False  # not a whole record
      (kept if whole else dropped).append(line)
  if not dropped:
    return 0
  with open(os.path.join(workdir, SUPERSEDED_FILE), "a", encoding="utf-8") as f:
    f.writelines(dropped)
    f.flush()
    os.fsync(f.fileno())
  tmp = path + ".partial"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(kept)
  os.replace(tmp, path)
  return len(dropped)


class MetricWriter:
  """Writes `{"step", "split", ...}` records to `<workdir>/metrics.jsonl` and TensorBoard under `<workdir>/tb`.

  The writer appends. The trainer first calls `drop_superseded` on resume, so
  that each (split, step) has one record; `purge_step` tells TensorBoard to
  drop its events from that step on. Pass `enabled=False` on non-zero processes.
  A failed write raises OSError, TensorBoard's too (at the next `write`: its
  events are written by a background thread).
  """

  def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True,
               purge_step: int | None = None):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._jsonl = None
    self._tb = None
    self._tb_errors = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(self.path, "a", encoding="utf-8")
    if _ends_mid_line(self.path):  # a record torn by a kill: start the next one on its own line
      self._jsonl.write("\n")
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter  # imported lazily: heavy, and optional for readers
      except ImportError:
        logging.warning("tensorboardX is not installed: metrics go to %s only", self.path)
      else:
        self._tb = SummaryWriter(os.path.join(workdir, "tb"), purge_step=purge_step)
        self._tb_errors = _keep_worker_errors(self._tb)

  def write(self, step: int, split: str, metrics: dict[str, Any]) -> None:
    """Writes one record; non-finite numbers are written as null in JSON and skipped in TensorBoard."""
    if not self.enabled:
      return
    if self._tb_errors is not None and self._tb_errors.error is not None:
      raise self._tb_errors.error
    record: dict[str, Any] = {"step": int(step), "split": split}
    for k, v in sorted(metrics.items()):
      f = _to_float(v)
      if f is None:
        continue
      record[k] = f if math.isfinite(f) else None
      if self._tb is not None and math.isfinite(f):
        self._tb.add_scalar(f"{split}/{k}", f, int(step))
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()

  def close(self) -> None:
    """Flushes and closes both writers."""
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


class _KeptErrors:
  """Stands in for tensorboardX's event file in its writer thread: keeps the first OSError of a
  write instead of letting it end the thread. A dead thread leaves its bounded queue full, and
  the next `add_scalar` would then block forever (a full disk hung the trainer so); kept, the
  error is raised by the next `MetricWriter.write`."""

  def __init__(self, events):
    self.events = events
    self.error: OSError | None = None

  def write_event(self, event) -> None:
    if self.error is None:
      try:
        self.events.write_event(event)
      except OSError as e:
        self.error = e

  def flush(self) -> None:
    if self.error is None:
      try:
        self.events.flush()
      except OSError as e:
        self.error = e

  def __getattr__(self, name: str) -> Any:
    return getattr(self.events, name)


def _keep_worker_errors(tb) -> _KeptErrors | None:
  """Wraps the event file of a SummaryWriter's writer thread in `_KeptErrors` (None where this
  tensorboardX has no such thread)."""
  worker = getattr(getattr(getattr(tb, "file_writer", None), "event_writer", None), "_worker", None)
  if worker is None or not hasattr(worker, "_record_writer"):
    return None
  worker._record_writer = _KeptErrors(worker._record_writer)  # pylint: disable=protected-access
  return worker._record_writer  # pylint: disable=protected-access


def _ends_mid_line(path: str) -> bool:
  """Whether a non-empty file's last byte is not a newline."""
  with open(path, "rb") as f:
    f.seek(0, os.SEEK_END)
    if f.tell() == 0:
      return False
    f.seek(-1, os.SEEK_END)
    return f.read(1) != b"\n"


def read_jsonl(path: str, split: str | None = None) -> list[dict[str, Any]]:
  """Reads a metrics file, keeping the last record per (split, step), sorted by step.

  The trainer leaves one record per (split, step) (see `drop_superseded`);
  keeping the last one also reads files that other writers appended to. Lines
  that are not whole records (torn when a run was killed mid-write) are
  skipped with a warning.
  """
  latest: dict[tuple[str, int], dict[str, Any]] = {}
  torn = []
  with open(path, encoding="utf-8", errors="replace") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
        key = (rec["split"], rec["step"])
      except (ValueError, TypeError, KeyError):
        torn.append(number)
        continue
      if split is None or rec["split"] == split:
        latest[key] = rec
  if torn:
    logging.warning("%s: skipped %d line(s) that are not whole records (line %s)", path, len(torn),
                    ", ".join(map(str, torn[:5])) + (", ..." if len(torn) > 5 else ""))
  return sorted(latest.values(), key=lambda r: (r["step"], r["split"]))
