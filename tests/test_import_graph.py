"""The import graph of `k3jax` and `pallas_kernels` runs one way (docs/design.md, "Import levels").

Every module's imports are read with `ast` (nothing is imported). A module may
import its own package or a package of a lower level; a cycle between modules
is an error even inside one package; an import inside a function is allowed
only for the optional dependencies below, each with a comment on its line.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lower numbers sit lower; an arrow may only point to a strictly lower level (or inside a package).
LEVELS = {
    "pallas_kernels": 0,        # the kernels (kda, gmm) and their timers
    "pallas_kernels.tools": 1,  # benchmarks' cost model, Triton IR capture
    "k3jax": 2,                 # k3jax/__init__.py, k3jax/configdict.py
    "k3jax.sharding": 2,        # mesh axes and logical-axis rules
    "k3jax.data": 3,
    "k3jax.routing": 3,
    "k3jax.layers": 4,
    "k3jax.models": 5,
    "k3jax.parallel": 6,
    "k3jax.train": 7,
    "k3jax.ablations": 8,
    "k3jax.eval": 8,            # run evaluation, the lm-eval adapter (optional `eval` extra)
}

# Optional dependencies, imported where they are used so that the package works without them.
OPTIONAL = {"tokamax", "tensorboardX", "triton", "sentencepiece", "pyarrow"}


def _modules() -> dict[str, str]:
  """{dotted module name: path} of every module under k3jax/ and pallas_kernels/."""
  mods = {}
  for top in ("k3jax", "pallas_kernels"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(dirpath, name)
          dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
          mods[dotted.removesuffix(".__init__")] = path
  return mods


MODULES = _modules()


def _owner(name: str) -> str | None:
  """The module of ours that `name` (a module or a name inside one) resolves to, else None."""
  while name and name not in MODULES:
    name = name.rpartition(".")[0]
  return name or None


def _imports(module: str) -> list[tuple[ast.stmt, list[str], bool]]:
  """(statement, imported dotted names, inside a function) for every import of `module`."""
  path = MODULES[module]
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  in_function = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      in_function.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        for _ in range(node.level - 1):
          package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
      # `from pkg import mod` imports pkg.mod; `from mod import name` imports mod.
      names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    else:
      continue
    out.append((node, names, id(node) in in_function))
  return out


def _package(module: str) -> str:
  parts = module.split(".")
  sub = ".".join(parts[:2])
  return sub if sub in LEVELS else parts[0]


def _edges() -> dict[str, set[str]]:
  edges = {m: set() for m in MODULES}
  for module in MODULES:
    for _, names, _ in _imports(module):
      for name in names:
        target = _owner(name)
        if target is not None and target != module:
          edges[module].add(target)
  return edges


def test_every_package_has_a_level():
  assert sorted({_package(m) for m in MODULES} - set(LEVELS)) == []


def test_no_upward_arrow():
  upward = []
  for module, targets in _edges().items():
    for target in targets:
      a, b = _package(module), _package(target)
      if a != b and LEVELS[b] >= LEVELS[a]:
        upward.append(f"{module} (level {LEVELS[a]}) -> {target} (level {LEVELS[b]})")
  assert upward == [], "imports must point to a lower level:\n" + "\n".join(sorted(upward))


def test_kernels_import_nothing_from_k3jax():
  bad = [f"{m} -> {t}" for m, ts in _edges().items() if m.startswith("pallas_kernels")
         for t in ts if t.split(".")[0] == "k3jax"]
  assert bad == []


def test_no_cycle():
  edges = _edges()
  # A package's __init__ re-exports its modules; an arrow into a package's __init__ from inside the
  # package would close a loop, so it is a cycle like any other.
  index, low, stack, on_stack, cycles = {}, {}, [], set(), []

  def visit(v):  # Tarjan's strongly connected components
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in edges[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        cycles.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  assert cycles == []


def test_imports_inside_functions_are_optional_dependencies():
  bad = []
  for module, path in sorted(MODULES.items()):
    lines = open(path, encoding="utf-8").read().splitlines()
    for node, names, in_function in _imports(module):
      if not in_function:
        continue
      tops = sorted({n.split(".")[0] for n in names})
      where = f"{os.path.relpath(path, ROOT)}:{node.lineno}"
      if not set(tops) <= OPTIONAL:
        bad.append(f"{where} imports {tops} inside a function; move it to the top of the module")
      elif "#" not in lines[node.lineno - 1]:
        bad.append(f"{where}: say in a comment why the optional import is deferred")
  assert bad == [], "\n".join(bad)
