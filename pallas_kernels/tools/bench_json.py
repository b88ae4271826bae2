"""A benchmark's rows as JSON, with what it takes to reproduce them and to read them.

The scripts under experiments/bench print markdown tables; with `--json=PATH`
they also write the same rows here, together with the command line, the
device, the commit of the tree and what the rows are measured against (the
peer or the base). docs/data/*.json hold the published tables in this form
and experiments/render_docs.py draws the figures from them. `Tables` prints
a table a row at a time and keeps its rows; `parse_table` reads a table
printed whole.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import shlex
import subprocess
import sys

import jax


def _git(*args: str) -> str | None:
  """Output of a git command in the current directory, None outside a repository or without git."""
  try:
    out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip()


def commit() -> str | None:
  """HEAD's hash, with "+dirty" when tracked files differ from it (a copied tree has none)."""
  head = _git("rev-parse", "HEAD")
  if head is None:
    return None
  changed = _git("status", "--porcelain", "--untracked-files=no")
  return head + ("+dirty" if changed else "")


def finite_or_none(node):
  """The tree with NaN and infinities as None (strict JSON has neither)."""
  if isinstance(node, dict):
    return {k: finite_or_none(v) for k, v in node.items()}
  if isinstance(node, (list, tuple)):
    return [finite_or_none(v) for v in node]
  if isinstance(node, float) and not math.isfinite(node):
    return None
  return node


def record(tables: dict, *, peer_or_base: str, **extra) -> dict:
  """{"command", "gpu", "platform", "jax", "commit", "created", "peer_or_base", "tables", ...}."""
  device = jax.devices()[0]
  return finite_or_none({
      "command": "python " + shlex.join(sys.argv), "gpu": device.device_kind,
      "platform": device.platform, "jax": jax.__version__, "commit": commit(),
      "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
      "peer_or_base": peer_or_base, **extra, "tables": tables})


def write(path: str, tables: dict, *, peer_or_base: str, **extra) -> None:
  """Writes `record(...)` to `path` (directories made as needed) and says so on stdout."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(record(tables, peer_or_base=peer_or_base, **extra), f, indent=1, allow_nan=False)
    f.write("\n")
  print(f"wrote {path}", flush=True)


def cell(text: str):
  """A printed cell as JSON: a number where it is one, else the text ("1.00 / 1.35" stays text)."""
  try:
    return float(text)
  except ValueError:
    return text


def _cells(line: str) -> list[str]:
  return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_table(text: str) -> dict:
  """{"columns", "rows"} of a markdown table printed whole (header, separator, rows); lines
  not starting with "|" are passed over."""
  lines = [line for line in text.splitlines() if line.strip().startswith("|")]
  columns = _cells(lines[0])
  return {"columns": columns,
          "rows": [dict(zip(columns, map(cell, _cells(line)))) for line in lines[2:]]}


class Tables:
  """Markdown tables printed a row at a time and kept, as `write` takes them, for `--json`.

  `tables` is {name: {"columns": [...], "rows": [{column: cell}]}}; a row
  belongs to the table started last.
  """

  def __init__(self):
    self.tables: dict = {}

  def start(self, name: str, columns) -> None:
    """Prints the header row of table `name` (the heading above it is the caller's)."""
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|", flush=True)
    self.tables[name] = {"columns": list(columns), "rows": []}

  def row(self, cells) -> None:
    """Prints one row of the table started last and keeps its cells."""
    texts = [str(c) for c in cells]
    print("| " + " | ".join(texts) + " |", flush=True)
    table = next(reversed(self.tables.values()))
    table["rows"].append(dict(zip(table["columns"], map(cell, texts))))
