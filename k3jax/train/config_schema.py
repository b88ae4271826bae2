"""Typed validation of the whole training ConfigDict, run before any compute.

`validate(config)` raises `ConfigError` (a ValueError) naming the key, the
value and what is allowed for: unknown keys (with a did-you-mean, the level
where a misplaced field lives, or the nested key that a flat model key of
earlier versions became), missing keys, wrong types, out-of-range values and
unsafe combinations. It returns the `ModelConfig`; the model's own checks come
back as `config model.<path>...`, their messages led by the field's path.
`validate_for_devices(config, num_devices)` runs the same checks, the mesh's also
with the device count known (an axis of -1 resolved), and returns the
`ParallelConfig`.
`unknown_field_message(dotted)` explains a `--config.a.b` override that names
no field.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

from k3jax.configdict import did_you_mean
from k3jax.configdict import to_plain as _to_plain
from k3jax.data import DATA_KINDS, DOCUMENT_KINDS, PACKINGS
from k3jax.data.corpus import BYTE_VOCAB_SIZE
from k3jax.data.mqar import check_mqar
from k3jax.data.token_file import TOKEN_DTYPES
from k3jax.models import config as model_config_lib
from k3jax.parallel import config as pconfig_lib
from k3jax.parallel import pipeline_layout
from k3jax.routing.config import RouterConfig
from k3jax.sharding import mesh as mesh_lib
from k3jax.train import defaults
from k3jax.train.cli_errors import InputError
from pallas_kernels.kda.spec import KdaSpec

_NUM = (int, float)
_SEQ = (list, tuple)

TOP_LEVEL: dict[str, Any] = {
    "seed": int, "num_steps": int, "batch_size": int, "num_devices": int, "seq_len": int, "log_every": int,
    "eval_every": int, "eval_batches": int, "checkpoint_every": int, "keep_checkpoints": int,
    "async_checkpoints": bool, "progress_bar": bool, "peak_tflops_per_device": _NUM,
    "model": dict, "data": dict, "optim": dict,
}
DATA: dict[str, Any] = {
    "kind": str, "path": str, "tokenizer": str, "tokenizer_sha256": str, "packing": str,
    "reset_at_boundaries": bool, "max_documents_per_row": int, "packing_bins": int, "prefetch": int,
    "paths": _SEQ, "patterns": _SEQ, "heldout_fraction": _NUM, "max_bytes": int,
    "token_file": str, "token_dtype": str, "heldout_token_file": str, "vocab_size": int,
    "mqar_num_kv_pairs": int, "mqar_num_queries": int,
}
OPTIM: dict[str, Any] = {
    "learning_rate": _NUM, "end_lr_fraction": _NUM, "warmup_steps": int, "b1": _NUM, "b2": _NUM,
    "eps": _NUM, "weight_decay": _NUM, "grad_clip": _NUM,
}
# `parallel` may be left out (every device on the data axis); its keys may be too.
PARALLEL: dict[str, Any] = {
    "data": int, "fsdp": int, "expert": int, "context": int, "stages": int, "microbatches": int,
    "dispatch_slot_factor": _NUM, "rules": dict,
}
RULE_TYPES = (str, list, tuple, type(None))
# Above this peak learning rate AdamW on these models diverges; a typo like 3e-1 for 3e-4 is caught here.
MAX_LEARNING_RATE = 0.05


class ConfigError(InputError):
  """A config value, key or combination the trainer cannot run; the message names it and the limit."""


def _as_config_error(fn):
  """Re-raises the ValueErrors of a check (the data modules' own included) as ConfigError."""
  @functools.wraps(fn)
  def checked(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except ConfigError:
      raise
    except ValueError as e:
      text = str(e)
      raise ConfigError(text if text.startswith("config") else f"config: {text}") from e
  return checked


def _fields(cls) -> list[str]:
  return [f.name for f in dataclasses.fields(cls)]


def _section_fields() -> dict[str, list[str]]:
  """{section ("" = top level): its field names}, for every section a dotted config key can name."""
  return {"": [*TOP_LEVEL, "parallel"], "data": list(DATA), "optim": list(OPTIM), "parallel": list(PARALLEL),
          "model": _fields(model_config_lib.ModelConfig), "model.kda": _fields(KdaSpec),
          "model.router": _fields(RouterConfig)}


def _homes(name: str, sections: Mapping[str, list[str]]) -> list[str]:
  """The dotted keys of every field called `name`."""
  return [f"{where}.{name}" if where else name for where, fields in sections.items() if name in fields]


def _level(where: str) -> str:
  return f"under {where.rstrip('.')!r}" if where else "at the top level"


def _unknown_key(where: str, key: str, allowed, sections: Mapping[str, list[str]], rest: str = "") -> str:
  """Why `where + key` names no field: the level where a field of that name lives, or the closest name.

  `rest` is the remainder of an override's path below `key` (".name" of `router.name`).
  """
  dotted = where + key
  if where == "parallel." and key in pconfig_lib.RENAMED:
    return pconfig_lib.renamed_message(key)
  if where == "model." and key in defaults.MOVED_MODEL_KEYS:
    return moved_message(key)
  homes = [h for h in _homes(key, sections) if h != dotted]
  if homes:
    levels = " and ".join(f"{h!r}" + (" (top level)" if "." not in h else "") for h in homes)
    return (f"config {dotted + rest!r} names no field: {key} lives at {levels}, not {_level(where)}. "
            f"Use --config.{homes[0] + rest}=VALUE (or set it there in the config file).")
  hint = did_you_mean(key, allowed, where) or "."
  return f"unknown config key {dotted!r}{hint} Allowed {_level(where)}: {sorted(allowed)}"


def moved_message(old: str) -> str:
  """Why `model.<old>`, a flat key of the model section before it was nested, is refused."""
  new = "model." + defaults.MOVED_MODEL_KEYS[old]
  note = (" (0: no bound, the softplus gate, which needs model.kda.diagonal='pairwise')"
          if new == "model.kda.lower_bound" else "")
  return (f"config 'model.{old}' is now '{new}'{note}: use --config.{new}=VALUE or set it in the "
          "config file.")


def unknown_field_message(dotted: str) -> str | None:
  """Why the dotted config key `a.b.c` (an override's path) names no field, or None when it does.

  Walks the sections from the top: a misspelt section or field gets the closest
  name, a field at the wrong level the level where it lives, and a path through
  a plain field says so.
  """
  sections = _section_fields()
  section = ""
  parts = dotted.split(".")
  for i, part in enumerate(parts):
    if section == "parallel.rules":  # logical axis names: ParallelConfig checks them
      return None
    if section not in sections:
      return (f"config {section!r} is a field, not a section, so {dotted!r} names nothing. "
              f"Use --config.{section}=VALUE.")
    if part not in sections[section]:
      rest = "".join("." + p for p in parts[i + 1:])
      return _unknown_key(section + "." if section else "", part, sections[section], sections, rest)
    section = f"{section}.{part}" if section else part
  return None


def _check_keys(section: Mapping[str, Any], allowed, where: str, *, require_all: bool = True) -> None:
  allowed = list(allowed)
  for key in section:
    if key not in allowed:
      raise ConfigError(_unknown_key(where, key, allowed, _section_fields()))
  missing = [k for k in allowed if k not in section]
  if missing and require_all:
    raise ConfigError(f"config is missing keys {[where + m for m in missing]}; start the config "
                      "file from k3jax.train.defaults.base_config(), which sets every field")


def _check_types(section: Mapping[str, Any], spec: Mapping[str, Any], where: str) -> None:
  for key, want in spec.items():
    if key not in section:
      continue  # required keys were checked by _check_keys
    value = section[key]
    ok = isinstance(value, want) and not (isinstance(value, bool) and want in (int, _NUM))
    if not ok:
      names = "/".join(t.__name__ for t in (want if isinstance(want, tuple) else (want,)))
      raise ConfigError(f"config {where}{key}={value!r} has type {type(value).__name__}; expected {names}")


def _require(cond: bool, msg: str) -> None:
  if not cond:
    raise ConfigError(msg)


def model_config_from(model_section: Mapping[str, Any]):
  """Builds the `ModelConfig` from the `config.model` section (the numbers of `defaults.NONE_AS`
  read as None). Raises ConfigError naming the key (`config model.kda.lower_bound=...`)."""
  d = _to_plain(model_section)
  _check_model_keys(d)
  for dotted, number in defaults.NONE_AS.items():
    section, name = dotted.split(".")
    if isinstance(d.get(section), Mapping) and d[section].get(name) == number:
      d[section] = dict(d[section], **{name: None})
  try:
    return model_config_lib.ModelConfig.from_dict(d)
  except ValueError as e:  # its messages start with the field's path below `model`
    raise ConfigError(f"config model.{e}") from None


def _check_model_keys(model_section: Mapping[str, Any]) -> None:
  # Model fields left out take ModelConfig's defaults; unknown ones are errors.
  sections = _section_fields()
  _check_keys(model_section, sections["model"], "model.", require_all=False)
  for name in ("kda", "router"):
    if isinstance(model_section.get(name), Mapping):
      _check_keys(model_section[name], sections["model." + name], f"model.{name}.", require_all=False)


@_as_config_error
def validate(config: Any):
  """Validates a full training config; returns the built `ModelConfig`. Raises ConfigError."""
  c = _to_plain(config)
  model_cfg = _check_fields(c)
  _check_parallel(c, model_cfg, num_devices=None)
  return model_cfg


def _check_fields(c: Mapping[str, Any]):
  """Every check of `validate` but the mesh's; returns the built `ModelConfig`."""
  _check_keys(c, [*TOP_LEVEL, "parallel"], "", require_all=False)
  _check_keys({k: v for k, v in c.items() if k != "parallel"}, TOP_LEVEL, "")
  _check_types(c, {**TOP_LEVEL, "parallel": dict}, "")
  for name, spec in (("data", DATA), ("optim", OPTIM)):
    _check_keys(c[name], spec, name + ".")
    _check_types(c[name], spec, name + ".")
  _check_model_keys(c["model"])

  for key in ("num_steps", "batch_size", "seq_len", "log_every", "keep_checkpoints"):
    _require(c[key] >= 1, f"config {key}={c[key]} must be >= 1")
  for key in ("eval_every", "checkpoint_every", "seed", "num_devices"):
    _require(c[key] >= 0, f"config {key}={c[key]} must be >= 0")
  _require(c["eval_batches"] >= 1, f"config eval_batches={c['eval_batches']} must be >= 1")
  _require(c["peak_tflops_per_device"] >= 0,
           f"config peak_tflops_per_device={c['peak_tflops_per_device']} must be >= 0 (0 = look up)")

  o = c["optim"]
  _require(0 < o["learning_rate"] <= MAX_LEARNING_RATE,
           f"config optim.learning_rate={o['learning_rate']} must be in (0, {MAX_LEARNING_RATE}]")
  _require(0 <= o["end_lr_fraction"] <= 1, f"config optim.end_lr_fraction={o['end_lr_fraction']} must be in [0, 1]")
  _require(0 <= o["warmup_steps"] <= c["num_steps"],
           f"config optim.warmup_steps={o['warmup_steps']} must be in [0, num_steps={c['num_steps']}]")
  for key in ("b1", "b2"):
    _require(0 <= o[key] < 1, f"config optim.{key}={o[key]} must be in [0, 1)")
  _require(o["eps"] > 0, f"config optim.eps={o['eps']} must be > 0")
  _require(0 <= o["weight_decay"] < 1, f"config optim.weight_decay={o['weight_decay']} must be in [0, 1)")
  _require(o["grad_clip"] > 0, f"config optim.grad_clip={o['grad_clip']} must be > 0")

  d = c["data"]
  _require(d["kind"] in DATA_KINDS, f"config data.kind={d['kind']!r}; allowed: {DATA_KINDS}")
  model_cfg = model_config_from(c["model"])  # ModelConfig's own checks: tiles vs the bound, heads, ...
  _require(model_cfg.param_dtype == "float32",
           f"config model.param_dtype={model_cfg.param_dtype!r}: AdamW needs float32 master weights; "
           "set model.dtype='bfloat16' for bf16 compute instead")
  _check_documents(d, c["parallel"] if "parallel" in c else {})
  if d["kind"] == "bytes":
    _require(0 < d["heldout_fraction"] < 1, f"config data.heldout_fraction={d['heldout_fraction']} must be in (0, 1)")
    _require(d["max_bytes"] >= 0, f"config data.max_bytes={d['max_bytes']} must be >= 0")
    data_vocab = BYTE_VOCAB_SIZE
  elif d["kind"] == "prepared":
    data_vocab = 0  # read from the manifest when the data is opened (the trainer's build stage)
  else:
    _require(d["vocab_size"] >= 2, f"config data.vocab_size={d['vocab_size']} must be >= 2 for kind={d['kind']!r}")
    data_vocab = d["vocab_size"]
  if d["kind"] == "token_file":
    _require(bool(d["token_file"]), "config data.token_file is empty but data.kind='token_file'")
    _require(d["token_dtype"] in TOKEN_DTYPES,
             f"config data.token_dtype={d['token_dtype']!r}; allowed: {sorted(TOKEN_DTYPES)}")
  if d["kind"] == "mqar":
    check_mqar(c["seq_len"], d["vocab_size"], d["mqar_num_kv_pairs"])
  _require(model_cfg.vocab_size >= data_vocab,
           f"config model.vocab_size={model_cfg.vocab_size} is smaller than the data's vocabulary "
           f"{data_vocab} (data.kind={d['kind']!r})")
  return model_cfg


def _check_documents(d: Mapping[str, Any], parallel: Mapping[str, Any]) -> None:
  """The packing fields of `config.data`, and the mesh axes packed documents cannot use."""
  _require(d["packing"] in PACKINGS, f"config data.packing={d['packing']!r}; allowed: {PACKINGS}")
  if d["kind"] == "prepared":
    _require(bool(d["path"]), "config data.kind='prepared' needs data.path, the directory "
             "experiments/prepare_data.py wrote (--config.data.path=DIR)")
    _require(d["packing"] == "documents", "config data.packing='windows' cuts windows from one byte "
             "stream (data.kind='bytes'); prepared data is packed as documents: drop data.packing")
  elif d["tokenizer"]:
    _require(False, f"config data.tokenizer={d['tokenizer']!r} is read with data.kind='prepared' only "
             f"(data.kind={d['kind']!r} brings its own ids); drop it, or prepare the text with "
             "experiments/prepare_data.py")
  for key, low in (("max_documents_per_row", 1), ("packing_bins", 1), ("prefetch", 0)):
    _require(d[key] >= low, f"config data.{key}={d[key]} must be >= {low}")
  packed = d["kind"] in DOCUMENT_KINDS and d["packing"] == "documents"
  context = parallel.get("context", 1)
  _require(not (packed and d["reset_at_boundaries"] and context != 1),
           f"config parallel.context={context} splits sequences, and context parallelism does not carry "
           "document segments: use parallel.context=1, or train without segment ids "
           "(data.reset_at_boundaries=False, or data.packing='windows' for bytes)")


def _check_parallel(c: Mapping[str, Any], model_cfg, num_devices: int | None):
  """Checks `c["parallel"]` against the batch, sequence and model; returns (ParallelConfig, sizes).

  The fixed axes are checked first (an axis of -1 unknown), so that an error
  names the field before the device count. With `num_devices`, -1 is then
  resolved, the sizes must use exactly that many devices, and the checks run
  on the resolved sizes if they differ. `sizes` maps every mesh axis to its
  size (-1 if unknown).
  """
  section = c.get("parallel") or {}
  _check_keys(section, PARALLEL, "parallel.", require_all=False)
  _check_types(section, PARALLEL, "parallel.")
  rules = section.get("rules") or {}
  for name, target in rules.items():
    if not isinstance(target, RULE_TYPES):
      raise ConfigError(f"config parallel.rules.{name}={target!r} has type {type(target).__name__}; "
                       "expected a string of comma-separated mesh axes ('' = replicated)")
  try:
    pconf = pconfig_lib.ParallelConfig.from_trainer_config(section)
    sizes = dict(zip(mesh_lib.AXES, pconf.mesh.sizes()))
  except ValueError as e:
    raise ConfigError(f"config parallel: {e}") from None
  _check_sizes(c, model_cfg, pconf, sizes)
  if num_devices is None:
    return pconf, sizes
  try:
    resolved = dict(zip(mesh_lib.AXES, mesh_lib.resolve_sizes(pconf.mesh, num_devices)))
  except ValueError as e:
    raise ConfigError(f"config parallel: {e}") from None
  if resolved != sizes:  # an axis of -1, now known
    _check_sizes(c, model_cfg, pconf, resolved)
  return pconf, resolved


def _check_sizes(c: Mapping[str, Any], model_cfg, pconf, sizes: dict) -> None:
  """The mesh of axis `sizes` (-1: unknown) against the batch, sequence and model."""

  def product(axes) -> int:  # over the known sizes; an unresolved -1 counts as 1
    return math.prod(max(sizes[a], 1) for a in axes)

  def show(axes) -> str:
    return " x ".join(f"{a}={sizes[a] if sizes[a] > 0 else '?'}" for a in axes) or "none"

  batch_axes = pconfig_lib.rule_axes(pconf.rules, "batch")
  length_axes = pconfig_lib.rule_axes(pconf.rules, "length")
  n_batch = product(batch_axes)
  _require(c["batch_size"] % n_batch == 0,
           f"config batch_size={c['batch_size']} must be divisible by the mesh axes that shard the "
           f"batch (parallel.rules.batch: {show(batch_axes)}, product {n_batch})")
  _require(sizes[mesh_lib.STAGE] != 1 or pconf.microbatches == 1,
           f"config parallel.microbatches={pconf.microbatches} streams microbatches through "
           "pipeline stages, but parallel.stages=1; set parallel.stages > 1 or "
           "parallel.microbatches=1")
  layout = pipeline_layout.PipelineLayout(stages=max(sizes[mesh_lib.STAGE], 1),
                                          microbatches=pconf.microbatches)
  try:
    layout.check_model(model_cfg)
    layout.check_batch(c["batch_size"], n_batch)
  except ValueError as e:
    raise ConfigError(f"config {e}") from None
  n_len = product(length_axes)
  _require(c["seq_len"] % n_len == 0,
           f"config seq_len={c['seq_len']} must be divisible by the mesh axes that shard the "
           f"sequence (parallel.rules.length: {show(length_axes)}, product {n_len})")
  n_ctx = sizes[mesh_lib.CONTEXT]
  if n_ctx > 1:
    _require(mesh_lib.CONTEXT not in batch_axes,
             f"config parallel.rules.batch={batch_axes} includes 'context', which shards the sequence")
    if "K" in model_cfg.layer_types:
      span = n_ctx * model_cfg.kda.chunk_size
      _require(c["seq_len"] % span == 0,
               f"config seq_len={c['seq_len']} must be divisible by parallel.context={n_ctx} x "
               f"model.kda.chunk_size={model_cfg.kda.chunk_size} = {span}: each device's part of a "
               "sequence must be whole KDA chunks")
  n_exp = sizes[mesh_lib.EXPERT]
  if n_exp > 1 and model_cfg.num_experts:
    _require(model_cfg.num_experts % n_exp == 0,
             f"config model.num_experts={model_cfg.num_experts} must be divisible by "
             f"parallel.expert={n_exp}")
    # Tokens are split over the devices of one stage, a microbatch at a time.
    n_all = product(mesh_lib.WITHIN_STAGE_AXES)
    tokens = c["batch_size"] // pconf.microbatches * c["seq_len"]
    _require(tokens % n_all == 0,
             f"config batch_size / parallel.microbatches x seq_len = {tokens} tokens must be "
             f"divisible by the {n_all} devices of a stage for expert-parallel dispatch")
  embed_axes = pconfig_lib.rule_axes(pconf.rules, "embed")
  n_embed = product(embed_axes)
  _require(model_cfg.d_model % n_embed == 0,
           f"config model.d_model={model_cfg.d_model} must be divisible by the mesh axes that shard "
           f"it (parallel.rules.embed: {show(embed_axes)}, product {n_embed})")


@_as_config_error
def validate_for_devices(config: Any, num_devices: int):
  """Validates `config` for a run on `num_devices` devices.

  Returns:
    (ModelConfig, ParallelConfig, {axis: resolved size}).
  """
  c = _to_plain(config)
  model_cfg = _check_fields(c)
  pconf, sizes = _check_parallel(c, model_cfg, num_devices=num_devices)
  return model_cfg, pconf, sizes
