"""A run directory's `config.json` is the contract its checkpoints were written under.

Resuming compares the new config with the saved one before anything is read or
written: fields that shape the state or the data stream (model, data, seed,
batch, optimizer definition) must match; fields of the run's length, cadence,
placement and learning-rate schedule may change and are logged.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

import ml_collections

from k3jax.train import defaults
from k3jax.train.cli_errors import InputError

log = logging.getLogger(__name__)
CONFIG_FILE = "config.json"

# Dotted config keys (a key covers its sub-keys) that may differ from the saved config on resume.
RESUMABLE = (
    "num_steps",                # the run's length, and so the learning-rate schedule's
    "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "async_checkpoints",
    "progress_bar", "peak_tflops_per_device",
    "num_devices", "parallel",  # the mesh: checkpoints restore onto any mesh
    "model.kda.implementation",  # the same chunked KDA math on another backend's kernels
    "model.kda_decode",          # the same decode recurrence, another implementation
    "model.kda_fuse_gate",       # the same gate values, formed inside the kernels
    "optim.learning_rate", "optim.end_lr_fraction", "optim.warmup_steps",  # the schedule
    "optim.grad_clip",
)


class ConfigMismatchError(InputError):
  """The new config changes fields that the run's checkpoints depend on."""


def config_to_plain(config: Any) -> dict:
  """The JSON form of a ConfigDict as the trainer saves it (tuples become lists)."""
  return json.loads(config.to_json_best_effort(sort_keys=True))


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """{"a.b.c": leaf} of nested dicts; a dict's leaves only (lists stay whole)."""
  if isinstance(tree, dict) and tree:
    out: dict[str, Any] = {}
    for key, value in tree.items():
      out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out
  return {prefix: tree}


def _resumable(key: str) -> bool:
  return any(key == k or key.startswith(k + ".") for k in RESUMABLE)


def diff_configs(saved: dict, new: dict) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
  """Splits the fields that differ into (refused, allowed), each a list of (key, saved, new).

  A key missing on one side is shown as the string "<absent>". Keys added to the
  code's defaults since the run was saved are allowed (and logged), so that runs
  survive new config fields.
  """
  a, b = flatten(saved), flatten(new)
  refused, allowed = [], []
  for key in sorted(set(a) | set(b)):
    old_value, new_value = a.get(key, "<absent>"), b.get(key, "<absent>")
    if old_value == new_value:
      continue
    entry = (key, old_value, new_value)
    (allowed if _resumable(key) or key not in a else refused).append(entry)
  return refused, allowed


def read_saved_config(workdir: str) -> dict | None:
  """The run's saved config as plain JSON in today's shape (`nest_model_section`), or None when
  `workdir` has no config.json.

  Raises:
    ConfigMismatchError: the file exists but is not a JSON object.
  """
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigMismatchError(f"{path} is unreadable ({type(e).__name__}: {e}); it must describe the "
                              "checkpoints next to it. Restore it, or give a new run directory.") from None
  if not isinstance(saved, dict):
    raise ConfigMismatchError(f"{path} holds a {type(saved).__name__}, not a config object")
  if isinstance(saved.get("model"), dict):
    saved["model"] = nest_model_section(saved["model"])
  return saved


def nest_model_section(model: dict) -> dict:
  """A saved `model` section in today's nested shape; one saved with the flat KDA keys of
  `defaults.MOVED_MODEL_KEYS` (g_min, kda_chunk_size, ...) is rewritten, the others kept."""
  flat = {key: model[key] for key in defaults.MOVED_MODEL_KEYS if key in model}
  if not flat:
    return model
  out = {key: value for key, value in model.items() if key not in flat}
  kda = {defaults.MOVED_MODEL_KEYS[key].split(".")[1]: value for key, value in flat.items()
         if key != "gate"}
  if flat.get("gate") == "softplus":  # the unbounded gate: no bound, whatever g_min said
    kda["lower_bound"] = defaults.NONE_AS["kda.lower_bound"]
  out["kda"] = {**out.get("kda", {}), **kda}
  return out


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The trainer config a run directory was trained with (`<workdir>/config.json`).

  Raises:
    ValueError: `config.json` is missing.
    ConfigMismatchError: it is not a JSON object.
  """
  saved = read_saved_config(workdir)
  if saved is None:
    path = os.path.join(workdir, CONFIG_FILE)
    raise ValueError(f"{path} does not exist; is {workdir!r} a training run directory?")
  return ml_collections.ConfigDict(saved)


def check_resume(workdir: str, config: Any) -> list[tuple[str, Any, Any]]:
  """Compares `config` with `<workdir>/config.json` before a resume; changes nothing on disk.

  Returns the allowed changes (key, saved, new), each logged.

  Raises:
    ConfigMismatchError: with a diff of exactly the fields that may not change.
  """
  saved = read_saved_config(workdir)
  if saved is None:
    log.warning("%s has checkpoints but no %s: resuming without comparing configs", workdir, CONFIG_FILE)
    return []
  refused, allowed = diff_configs(saved, config_to_plain(config))
  if refused:
    lines = "\n".join(f"  {k}: {old!r} (saved) -> {new!r} (now)" for k, old, new in refused)
    raise ConfigMismatchError(
        f"the config differs from {os.path.join(workdir, CONFIG_FILE)} in fields that cannot change when "
        f"a run resumes:\n{lines}\nNothing in {workdir} was changed. Drop these overrides to resume "
        "the run, or give a new run directory to start another one.")
  for key, old, new in allowed:
    log.info("config change on resume: %s %r -> %r", key, old, new)
  return allowed


def write_config(workdir: str, config: Any) -> None:
  """Writes `<workdir>/config.json` atomically (a kill mid-write leaves the previous one)."""
  path = os.path.join(workdir, CONFIG_FILE)
  tmp = path + ".partial"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  os.replace(tmp, path)
