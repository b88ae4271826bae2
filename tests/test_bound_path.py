"""How many files the KDA gate's lower bound passes through on the gpu_1b path (issue 37's figure).

The counting rule:
- The path is every file a gpu_1b training run loads: `configs/gpu_1b.py`, the
  config files it loads with `sibling_config(__file__, "...")`, and the modules
  of `k3jax` and `pallas_kernels` reached from those files and from
  `experiments/train.py` by following imports (read with `ast`; nothing is
  imported).
- A file counts when its code names the bound: a Python name token (a
  variable, attribute, argument or function name) that contains `g_min` or
  `lower_bound`. Comments, docstrings and other strings do not count (the
  metric `stats["g_min"]` is the smallest gate, not the bound).

`python tests/test_bound_path.py` prints the files that count, with their names.
"""
import ast
import os
import re
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("configs/gpu_1b.py", "experiments/train.py")
BOUND = re.compile(r"g_min|lower_bound")
MOST_FILES = 5  # the two config files, the spec and the two gate-cumsum kernel files


def _module_path(dotted: str) -> str | None:
  """The path of `dotted` (a module or a name inside one) under ROOT, for our packages only."""
  if dotted.split(".")[0] not in ("k3jax", "pallas_kernels"):
    return None
  while dotted:
    base = os.path.join(ROOT, *dotted.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
      if os.path.isfile(path):
        return path
    dotted = dotted.rpartition(".")[0]
  return None


def _dotted(path: str) -> str:
  return os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")


def _loads(path: str) -> set[str]:
  """The files that `path` imports (with the packages above them) or loads as sibling configs."""
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        package = _dotted(path)
        if not path.endswith("__init__.py"):
          package = package.rpartition(".")[0]
        for _ in range(node.level - 1):
          package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
      names += [base] + [f"{base}.{a.name}" for a in node.names]
    elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "sibling_config"
          and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
      names.append(("file", os.path.join(os.path.dirname(path), node.args[1].value)))
  out = set()
  for name in names:
    if isinstance(name, tuple):
      out.add(os.path.normpath(name[1]))
      continue
    parts = name.split(".")
    for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__.py and a/b/__init__.py too
      found = _module_path(".".join(parts[:i]))
      if found:
        out.add(found)
  return out


def path_files() -> list[str]:
  """Every file on the gpu_1b path (see the module docstring), relative to ROOT."""
  todo = [os.path.join(ROOT, r) for r in ROOTS]
  seen = set()
  while todo:
    path = todo.pop()
    if path not in seen:
      seen.add(path)
      todo += sorted(_loads(path) - seen)
  return sorted(os.path.relpath(p, ROOT) for p in seen)


def bound_names(relpath: str) -> list[str]:
  """The name tokens of `relpath` that name the bound, in order."""
  with open(os.path.join(ROOT, relpath), "rb") as f:
    return [t.string for t in tokenize.tokenize(f.readline)
            if t.type == tokenize.NAME and BOUND.search(t.string)]


def files_naming_the_bound() -> dict[str, list[str]]:
  """{file: its names of the bound} for the files on the gpu_1b path that name it."""
  return {f: names for f in path_files() if (names := bound_names(f))}


def test_the_path_reaches_the_kernels():
  files = path_files()
  for needed in ("configs/gpu_base.py", "k3jax/models/config.py", "k3jax/layers/kda.py",
                 "pallas_kernels/kda/pallas_op.py", "pallas_kernels/kda/kernel_gate_cumsum.py"):
    assert needed in files


def test_the_bound_passes_through_few_files():
  files = files_naming_the_bound()
  assert len(files) <= MOST_FILES, "\n".join(f"{f}: {sorted(set(n))}" for f, n in files.items())


if __name__ == "__main__":
  counted = files_naming_the_bound()
  for name, found in counted.items():
    print(f"{name}: {len(found)} ({', '.join(sorted(set(found)))})")
  print(f"{len(counted)} files name the bound, of {len(path_files())} on the gpu_1b path")
  sys.exit(0)
