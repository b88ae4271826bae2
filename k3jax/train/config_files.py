"""Loading `configs/*.py` files (each defines `get_config(arg=None)`) outside of absl flags."""
from __future__ import annotations

import importlib.util
import inspect
import os

import ml_collections

from k3jax.configdict import did_you_mean


def load_config_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """Imports a config file by path and returns `get_config(arg)` (or `get_config()` if arg is None).

  `path` may carry the argument after a colon, as on the command line: `configs/ablations/router.py:bias_sign`.
  """
  if arg is None and ":" in os.path.basename(path):
    path, arg = path.rsplit(":", 1)
  if not os.path.isfile(path):
    raise ValueError(missing_file_message(path))
  name = "k3jax_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ValueError(f"config file {path!r} has no get_config()")
  takes_arg = bool(inspect.signature(module.get_config).parameters)
  if arg is not None and not takes_arg:
    raise ValueError(f"config file {path!r} takes no argument, got {arg!r}")
  return module.get_config(arg) if arg is not None else module.get_config()


def missing_file_message(path: str) -> str:
  """`config file X does not exist`, with the closest file of its directory or the files there."""
  folder = os.path.dirname(path) or "."
  names = sorted(n for n in os.listdir(folder) if n.endswith(".py")) if os.path.isdir(folder) else []
  hint = did_you_mean(os.path.basename(path), names, os.path.join(os.path.dirname(path), ""))
  if not hint and names:
    hint = f"; config files in {folder}: {', '.join(names)}"
  elif not hint:
    hint = f"; {folder} holds no config files (the presets are configs/*.py in the repository root)"
  return f"config file {path!r} does not exist{hint}"


def sibling_config(this_file: str, relpath: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """Loads a config file given relative to another config file (for ablations built on a preset)."""
  return load_config_file(os.path.join(os.path.dirname(os.path.abspath(this_file)), relpath), arg)
