"""The committed figures are what experiments/render_docs.py makes of the committed data.

A fresh render goes to a temporary directory and each PNG is compared with
docs/figures/: byte for byte when the committed PNG names this matplotlib
version (its "Software" text chunk); under another version, which may draw
text a pixel apart, the decoded pixels must agree within a small tolerance
(which cannot see a change below a pixel). Rendering is byte-reproducible
within one installation, checked by rendering one figure twice. The pages reference
every figure and every figure they reference exists. Each data file holds
numbers that stand on its page (docs/benchmarks.md unless it names another), and a
page's `<!-- data:NAME -->` tables are what docs/data/NAME.json renders to.
"""
import json
import os
import re
import sys

import matplotlib.image
import numpy as np
import PIL.Image
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import render_docs  # pylint: disable=wrong-import-position

FIGURES = os.path.join(ROOT, "docs", "figures")
PAGES = ("README.md", "docs/results.md", "docs/benchmarks.md", "docs/sharding.md")
# Mean absolute difference of RGBA values in [0, 1] that a text rasterised a pixel apart stays under.
PIXEL_TOLERANCE = 2e-3


def _software(path: str) -> str | None:
  with PIL.Image.open(path) as image:
    return image.info.get("Software")


def _same_figure(committed: str, new: str) -> bool:
  """Equal bytes under the committing matplotlib version, else pixels within the tolerance."""
  if _software(committed) == _software(new):
    return open(committed, "rb").read() == open(new, "rb").read()
  return _pixels_close(committed, new)


def _pixels_close(a: str, b: str) -> bool:
  x, y = matplotlib.image.imread(a), matplotlib.image.imread(b)
  return x.shape == y.shape and float(np.abs(x - y).mean()) < PIXEL_TOLERANCE


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
  out = tmp_path_factory.mktemp("figures")
  render_docs.render(str(out))
  return out


def test_the_committed_figures_are_the_rendered_ones(fresh):
  stale = []
  for name in render_docs.FIGURES:
    committed, new = os.path.join(FIGURES, name), str(fresh / name)
    if not os.path.isfile(committed):
      stale.append(f"{name}: not committed")
    elif not _same_figure(committed, new):
      stale.append(f"{name}: differs from a fresh render")
  assert stale == [], "run `python experiments/render_docs.py` and commit docs/figures:\n" + "\n".join(stale)


def test_every_figure_is_small(fresh):
  sizes = {name: os.path.getsize(fresh / name) for name in render_docs.FIGURES}
  assert all(size < 100_000 for size in sizes.values()), sizes


def test_rendering_is_byte_reproducible(tmp_path):
  first = render_docs.render(str(tmp_path / "a"), ["documents.png"])[0]
  second = render_docs.render(str(tmp_path / "b"), ["documents.png"])[0]
  assert open(first, "rb").read() == open(second, "rb").read()


def _references() -> dict[str, set[str]]:
  """{page: figure file names it shows}."""
  out = {}
  for page in PAGES:
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    out[page] = set(re.findall(r"!\[[^\]]*\]\((?:docs/)?figures/([\w.-]+\.png)\)", text))
  return out


def test_pages_and_figures_reference_each_other():
  refs = _references()
  shown = set().union(*refs.values())
  files = {n for n in os.listdir(FIGURES) if n.endswith(".png")}
  assert shown - files == set(), f"pages show figures that do not exist: {sorted(shown - files)}"
  assert files - shown == set(), f"figures no page shows: {sorted(files - shown)}"
  assert files == set(render_docs.FIGURES), "docs/figures holds files render_docs.py does not make"


def _numbers(node) -> list[float]:
  """Every non-integer, non-zero number in a JSON tree."""
  if isinstance(node, dict):
    return [x for v in node.values() for x in _numbers(v)]
  if isinstance(node, list):
    return [x for v in node for x in _numbers(v)]
  return [node] if isinstance(node, float) and node != 0 else []


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(ROOT, "docs", "data"))
                                         if n.endswith(".json")))
def test_benchmark_data_holds_the_page_numbers(name):
  """Each number in the data file stands on its page (`page`, else docs/benchmarks.md) as written
  there (trailing zeros aside)."""
  data = json.load(open(os.path.join(ROOT, "docs", "data", name), encoding="utf-8"))
  page = open(os.path.join(ROOT, data.get("page", "docs/benchmarks.md")), encoding="utf-8").read()
  assert data["command"] if "command" in data else all(data[k]["command"] for k in ("layer", "profile"))
  missing = [x for x in _numbers(data) if not re.search(rf"(?<![\d.]){re.escape(repr(x))}0*(?!\d)", page)]
  assert missing == [], f"{name}: numbers not on the page: {missing}"


def test_page_tables_are_rendered_from_the_data():
  """Every `<!-- data:NAME -->` table is what docs/data/NAME.json renders to, and each registered
  table stands on a page."""
  shown = set()
  for page in render_docs.PAGES:
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    assert render_docs.render_page_tables(text) == text, f"run `python experiments/render_docs.py`: {page}"
    shown |= set(re.findall(r"<!-- data:([a-z0-9_]+) -->", text))
  assert shown == set(render_docs.PAGE_TABLES)
  edited = render_docs.render_page_tables("<!-- data:kda_decode -->\n| stale |\n<!-- /data -->")
  assert "| stale |" not in edited and "| 8 | 4 | 66.1 | 37.0 | 45.9 | **28.7** |" in edited
  with pytest.raises(ValueError, match="no page table 'nope'"):
    render_docs.render_page_tables("<!-- data:nope -->\n<!-- /data -->")


@pytest.mark.parametrize("name", render_docs.NOTEBOOKS)
def test_executed_notebooks_are_the_committed_ones_run_on_the_results(name):
  """docs/notebooks holds each notebook executed in its full setting: same code, figures, no local paths.

  Executing them takes longer than a test may (`python experiments/render_docs.py
  --notebooks=docs/notebooks` does); this checks that a notebook edit was followed by a render.
  """
  nbformat = pytest.importorskip("nbformat")
  path = os.path.join(ROOT, "docs", "notebooks", f"{name}.ipynb")
  executed = nbformat.read(path, as_version=4)
  source = nbformat.read(os.path.join(ROOT, "notebooks", f"{name}.ipynb"), as_version=4)
  full = [c.source.replace('SETTING = "quick"', 'SETTING = "full"') for c in source.cells]
  assert [c.source for c in executed.cells] == full, "notebook changed: run render_docs.py --notebooks"
  outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error" or o.get("name") == "stderr"]
  assert sum("image/png" in o.get("data", {}) for o in outputs) >= 1
  text = open(path, encoding="utf-8").read()
  assert ROOT not in text and os.path.getsize(path) < 150_000
  readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  assert f"docs/notebooks/{name}.ipynb" in readme


@pytest.mark.parametrize("name", render_docs.NOTEBOOKS)
def test_html_copies_are_the_executed_notebooks(name):
  """docs/notebooks/NAME.html is the HTML of the committed executed notebook: byte for byte under the
  nbconvert, mistune and pygments versions it names, else it holds every figure of the notebook."""
  nbformat = pytest.importorskip("nbformat")
  pytest.importorskip("nbconvert")
  base = os.path.join(ROOT, "docs", "notebooks", name)
  html = open(f"{base}.html", encoding="utf-8").read()
  book = nbformat.read(f"{base}.ipynb", as_version=4)
  named = re.search(r'<meta name="generator" content="([^"]+)">', html).group(1)
  if named == render_docs.html_generator():
    assert html == render_docs.notebook_html(book, f"{name} (executed on docs/results)"), \
        "run `python experiments/render_docs.py --html=docs/notebooks`"
  images = [o.data["image/png"] for c in book.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert images and all(f"data:image/png;base64,{png}" in html for png in images)
  assert ROOT not in html and "<script" not in html and len(html) < 150_000
  readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  assert f"docs/notebooks/{name}.html" in readme
