"""Executes the ablation notebooks on their committed `quick` setting (tiny CPU runs); any cell error fails.

The README's notebook command runs its notebook, as the README gives it, and must write an
executed copy holding the tables and figures. The `full` setting then runs on a summary of
those quick runs, in the same kernel as the quick pass where that pass was not the README's
command (a kernel start and the imports saved); every `full` run in a kernel of its own is
`test_notebook_renders_the_committed_gpu_results`. The quick runs are tiny, so their time is
XLA's compile time: the kernels compile with JAX_DISABLE_MOST_OPTIMIZATIONS (a third less CPU
for the runs).
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from k3jax.ablations import summary
from tests import compile_cache

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = ("decay_ablation", "router_ablation", "residual_ablation")
FIGURES = {"decay_ablation": 3, "router_ablation": 1, "residual_ablation": 2}  # figure cells of each
README_NOTEBOOK = "router_ablation"  # the notebook that the README's command executes


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path, monkeypatch):
  book = nbformat.read(path_of(name), as_version=4)
  setting_cells = [c for c in book.cells if c.cell_type == "code" and 'SETTING = "quick"' in c.source]
  assert setting_cells, f"{name}: the committed notebook must run the quick setting"
  assert all(not c.get("outputs") for c in book.cells if c.cell_type == "code"), f"{name}: outputs not stripped"
  # The kernel inherits this environment: runs go to a fresh directory, one CPU device.
  monkeypatch.setenv("ABLATION_OUT", str(tmp_path / "runs"))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  # One persistent cache for the kernels (and trainer runs) of this test process: programs they
  # share compile once.
  for key, value in compile_cache.env().items():
    monkeypatch.setenv(key, value)
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel draws inline PNGs
  # The "full" setting reads a summary.json and the run directories: the quick runs', written
  # between the two passes (the quick setting reads neither variable).
  monkeypatch.setenv("ABLATION_SUMMARY", str(tmp_path / "summary.json"))
  monkeypatch.setenv("ABLATION_RUNS", str(tmp_path / "runs"))
  full = nbformat.read(path_of(name), as_version=4)
  for cell in full.cells:
    cell.source = cell.source.replace('SETTING = "quick"', 'SETTING = "full"')
  if name == README_NOTEBOOK:
    _run_readme_command(tmp_path)
    _summarise_quick_runs(tmp_path)
    _execute(full, name)
  else:
    _execute(book, name, then=(lambda: _summarise_quick_runs(tmp_path), full))


def _summarise_quick_runs(tmp_path):
  """Writes tmp_path/summary.json from the records of the quick runs under tmp_path/runs."""
  records = []
  for path in glob.glob(str(tmp_path / "runs" / "**" / "ablation_summary.json"), recursive=True):
    with open(path, encoding="utf-8") as f:
      records.append(json.load(f))
  assert records
  summary.write_summary(summary.make_summary(records, setting="quick"), str(tmp_path / "summary.json"))


def readme_notebook_command() -> str:
  """The README's notebook command (continuation lines joined), without its `pip install` part."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    blocks = re.findall(r"```bash\n(.*?)```", f.read(), flags=re.S)
  commands = [b.replace("\\\n", " ") for b in blocks if "jupyter-execute" in b]
  assert len(commands) == 1, "the README must give one notebook command"
  parts = [p.strip() for p in commands[0].split("#")[0].split("&&")]
  assert parts[0].startswith("pip install -e") and "notebooks" in parts[0], parts[0]
  return " && ".join(parts[1:])


def _run_readme_command(tmp_path):
  """Runs the README's command in a copy of the repository's notebooks folder; checks the executed copy."""
  shutil.copytree(os.path.join(ROOT, "notebooks"), tmp_path / "checkout" / "notebooks")
  env = {**os.environ, "PYTHONPATH": ROOT,
         "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
  done = subprocess.run(["bash", "-c", readme_notebook_command()], cwd=tmp_path / "checkout", env=env,
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  executed = glob.glob(str(tmp_path / "checkout" / "runs" / "**" / f"{README_NOTEBOOK}*.ipynb"), recursive=True)
  assert len(executed) == 1, executed
  book = nbformat.read(executed[0], as_version=4)
  outputs = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert sum("image/png" in o.get("data", {}) for o in outputs) >= FIGURES[README_NOTEBOOK]
  tables = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
  assert len(tables) >= 2 and all("|" in t for t in tables)  # the router and per-layer tables


def path_of(name):
  return os.path.join(ROOT, "notebooks", f"{name}.ipynb")


def _execute(book, name, then=None):
  """Runs every cell (CellExecutionError on the first failure) and checks that figures were drawn;
  `then` = (prepare, second_book): calls prepare(), then runs second_book in the same kernel."""
  client = nbclient.NotebookClient(book, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}})
  with client.setup_kernel():
    for index, cell in enumerate(book.cells):
      client.execute_cell(cell, index)
    _assert_figures(book, name)
    if then is not None:
      prepare, second = then
      prepare()
      for index, cell in enumerate(second.cells):
        client.execute_cell(cell, index)
      _assert_figures(second, name)


def _assert_figures(book, name):
  images = sum(1 for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if "image/png" in o.get("data", {}))
  assert images >= FIGURES[name], f"{name}: expected {FIGURES[name]} figures, got {images}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_renders_the_committed_gpu_results(name, tmp_path, monkeypatch):
  """SETTING = "full" on docs/results' summary and run archive: tables and curves, no training."""
  import tarfile  # pylint: disable=g-import-not-at-top
  with tarfile.open(os.path.join(ROOT, "docs", "results", "ablation_runs.tar.gz")) as tar:
    tar.extractall(tmp_path / "runs", filter="data")
  monkeypatch.setenv("ABLATION_RUNS", str(tmp_path / "runs"))
  monkeypatch.setenv("ABLATION_OUT", str(tmp_path / "must_not_train"))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("ABLATION_SUMMARY", raising=False)  # the committed summary
  monkeypatch.delenv("MPLBACKEND", raising=False)
  book = nbformat.read(path_of(name), as_version=4)
  for cell in book.cells:
    cell.source = cell.source.replace('SETTING = "quick"', 'SETTING = "full"')
  _execute(book, name)
  assert not os.path.exists(tmp_path / "must_not_train")
