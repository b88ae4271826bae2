"""Executes the ablation notebooks on their committed `quick` setting (tiny CPU runs); any cell error fails."""
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = ("decay_ablation", "router_ablation", "residual_ablation")


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory):
  """One persistent XLA cache for all notebook kernels: programs they share compile once."""
  return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path, shared_cache, monkeypatch):
  path = os.path.join(ROOT, "notebooks", f"{name}.ipynb")
  book = nbformat.read(path, as_version=4)
  setting_cells = [c for c in book.cells if c.cell_type == "code" and 'SETTING = "quick"' in c.source]
  assert setting_cells, f"{name}: the committed notebook must run the quick setting"
  assert all(not c.get("outputs") for c in book.cells if c.cell_type == "code"), f"{name}: outputs not stripped"
  # The kernel inherits this environment: runs go to a fresh directory, one CPU device.
  monkeypatch.setenv("ABLATION_OUT", str(tmp_path / "runs"))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", shared_cache)
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel draws inline PNGs
  client = nbclient.NotebookClient(book, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}})
  client.execute()  # raises CellExecutionError on the first failing cell
  images = sum(1 for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if "image/png" in o.get("data", {}))
  assert images >= 2, f"{name}: expected figures, got {images}"
