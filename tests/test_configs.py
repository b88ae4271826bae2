"""Every config file builds and validates; typos and unsafe settings fail before any compute."""
import glob
import os
import re

import pytest

from k3jax.train.config_files import load_config_file
from k3jax.train.config_schema import validate
from k3jax.train.defaults import base_config
from tests.config_helpers import set_dotted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.py"),
                                                                    recursive=True))
ABLATION_ARGS = {
    "configs/ablations/decay.py": ["softplus", "bounded_pairwise", "g5_t16", "g10_t8", "g2.5_t32"],
    "configs/ablations/router.py": ["quantile", "quantile_lagged", "bias_sign", "aux_loss",
                                    "expert_choice", "topk"],
    "configs/ablations/residual.py": ["prenorm", "block", "full"],
    "configs/ablations/long_context.py": ["bounded", "softplus", "attention"],
}


def test_config_files_are_all_listed():
  assert {"configs/tiny.py", "configs/gpu_150m.py", "configs/gpu_1b.py"} <= set(CONFIG_FILES)
  assert set(ABLATION_ARGS) <= set(CONFIG_FILES)


@pytest.mark.parametrize("path", CONFIG_FILES)
def test_config_file_builds_validates_and_documents_its_command(path):
  c = load_config_file(os.path.join(ROOT, path))
  model_cfg = validate(c)
  assert model_cfg.vocab_size == c.model.vocab_size
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    head = f.read().split('"""')[1]
  assert f"experiments/train.py --config={path}" in head.replace("\\\n", "").replace("\n", " ")


def _docstring_commands(path):
  """The `experiments/train.py` command lines of a config file's docstring, continuations joined."""
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    doc = f.read().split('"""')[1].replace("\\\n", " ")
  return [line for line in doc.splitlines() if "experiments/train.py" in line]


@pytest.mark.parametrize("path", CONFIG_FILES)
def test_docstring_commands_validate_with_their_overrides(path):
  """The documented commands (config arg and --config.* overrides) give valid configs."""
  for line in _docstring_commands(path):
    config_arg = re.search(r"--config=(\S+)", line).group(1).strip("`")
    c = load_config_file(os.path.join(ROOT, config_arg))
    for key, value in re.findall(r"--config\.([\w.]+)=(\S+)", line):
      *parents, leaf = key.split(".")
      target = c
      for p in parents:
        target = target[p]
      target[leaf] = type(target[leaf])(value.strip("`"))
    validate(c)


@pytest.mark.parametrize("path,arg", [(p, a) for p, args in ABLATION_ARGS.items() for a in args]
                         + [(p, a + ",tiny") for p, args in ABLATION_ARGS.items() for a in args[:2]])
def test_every_ablation_variant_validates(path, arg):
  c = load_config_file(os.path.join(ROOT, path), arg)
  m = validate(c)
  variant = arg.split(",")[0]
  if path.endswith("router.py"):
    assert m.router.name == variant
  if path.endswith(("decay.py", "long_context.py")):
    assert (m.gate == "softplus") == (variant == "softplus")
  if path.endswith("long_context.py"):
    assert set(m.layer_types) == ({"A"} if variant == "attention" else {"K", "A"})
  if arg.endswith(",tiny"):
    assert c.model.d_model == load_config_file(os.path.join(ROOT, "configs", "tiny.py")).model.d_model


def test_ablation_rejects_unknown_variant():
  with pytest.raises(ValueError, match="variant must be one of"):
    load_config_file(os.path.join(ROOT, "configs/ablations/router.py"), "quantil")


def test_gpu_presets_have_their_advertised_sizes():
  from k3jax.models import lm
  sizes = {}
  for name in ("gpu_150m", "gpu_1b"):
    c = load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
    m = validate(c)
    assert m.dtype == "bfloat16" and m.kda.implementation == "pallas"
    sizes[name] = lm.param_count(m)
  assert 1.3e8 < sizes["gpu_150m"] < 1.8e8
  assert 0.9e9 < sizes["gpu_1b"] < 1.3e9


def _cfg(**changes):
  return set_dotted(base_config(), changes)


@pytest.mark.parametrize("key,suggestion", [
    ("num_step", "num_steps"), ("optim.lerning_rate", "optim.learning_rate"),
    ("data.heldout_fractoin", "data.heldout_fraction"), ("model.d_modle", "model.d_model"),
    ("model.router.capacity_factr", "model.router.capacity_factor"),
])
def test_typo_keys_raise_with_a_suggestion(key, suggestion):
  with pytest.raises(ValueError, match=rf"unknown config key '{key}'; did you mean '{suggestion}'"):
    validate(_cfg(**{key: 1}))


@pytest.mark.parametrize("key,home", [
    ("model.batch_size", "batch_size"), ("optim.seq_len", "seq_len"),
    ("data.lower_bound", "model.kda.lower_bound"),
    ("model.learning_rate", "optim.learning_rate"),
    ("capacity_factor", "model.router.capacity_factor"),
    ("dispatch_slot_factor", "parallel.dispatch_slot_factor"),
])
def test_a_field_at_the_wrong_level_names_its_level(key, home):
  with pytest.raises(ValueError, match=rf"config '{key}' names no field: .* lives at '{home}'"):
    validate(_cfg(**{key: 1}))


def test_the_renamed_parallel_capacity_factor_names_its_new_key():
  """Only the router's setting is called capacity_factor; the dispatch's old name is refused
  with the new one, in a config file and in an override path alike."""
  from k3jax.train.config_schema import unknown_field_message
  c = _cfg()
  with c.unlocked():
    c.parallel.capacity_factor = 2.0
  with pytest.raises(ValueError, match=r"'parallel.capacity_factor' was renamed "
                                       r"'parallel.dispatch_slot_factor'"):
    validate(c)
  message = unknown_field_message("parallel.capacity_factor")
  assert "renamed 'parallel.dispatch_slot_factor'" in message
  assert "--config.parallel.dispatch_slot_factor=VALUE" in message


def test_override_paths_are_explained_before_they_are_applied():
  from k3jax.train.config_schema import unknown_field_message
  assert unknown_field_message("model.router.name") is None
  assert unknown_field_message("parallel.rules.batch") is None
  assert "Use --config.model.router.name=VALUE" in unknown_field_message("router.name")
  assert "did you mean 'model'" in unknown_field_message("modle.d_model")
  assert "'seed' is a field, not a section" in unknown_field_message("seed.x")


def test_wrong_types_raise_for_plain_dict_configs():
  # ConfigDict already refuses most retyping; the schema also guards configs built as plain dicts.
  c = base_config().to_dict()
  c["num_steps"] = "100"
  with pytest.raises(ValueError, match=r"num_steps='100' has type str; expected int"):
    validate(c)
  c = base_config().to_dict()
  c["optim"]["learning_rate"] = [1e-3]
  with pytest.raises(ValueError, match=r"optim.learning_rate=\[0.001\] has type list"):
    validate(c)


def test_missing_key_raises():
  c = base_config()
  del c.optim["grad_clip"]
  with pytest.raises(ValueError, match="missing keys.*optim.grad_clip"):
    validate(c)
  # Model fields may be left to ModelConfig's defaults.
  c = base_config()
  del c.model["conv_size"]
  assert validate(c).conv_size == 4


@pytest.mark.parametrize("changes,message", [
    ({"batch_size": True}, r"batch_size=True has type bool"),
    ({"num_steps": 0}, r"num_steps=0 must be >= 1"),
    ({"optim.learning_rate": 0.5}, r"optim.learning_rate=0.5 must be in \(0, 0.05\]"),
    ({"optim.learning_rate": 0.0}, r"optim.learning_rate=0.0 must be in"),
    ({"optim.warmup_steps": 500}, r"warmup_steps=500 must be in \[0, num_steps=200\]"),
    ({"optim.b2": 1.0}, r"optim.b2=1.0 must be in \[0, 1\)"),
    ({"optim.grad_clip": 0.0}, r"grad_clip=0.0 must be > 0"),
    ({"model.kda.lower_bound": -10.0}, r"^config model.kda.lower_bound=-10.0 is unsafe for a dense "
                                       r"diagonal tile of length 16"),
    ({"model.kda.lower_bound": 0.0, "model.kda.implementation": "xla"},
     r"^config model.kda.diagonal='dense' needs lower_bound.*diagonal='pairwise'"),
    ({"model.kda.sub_chunk": 24}, r"^config model.kda.sub_chunk must divide chunk_size=64, got 24"),
    ({"model.num_kv_heads": 3}, r"^config model.num_kv_heads=3 must divide num_heads=4"),
    ({"model.param_dtype": "bfloat16"}, r"float32 master weights"),
    ({"model.vocab_size": 128}, r"model.vocab_size=128 is smaller than the data's vocabulary 256"),
    ({"model.top_k": 9}, r"top_k"),
    ({"model.router.name": "quantiles"}, r"^config model.router.name='quantiles'"),
    ({"data.kind": "text"}, r"data.kind='text'; allowed"),
    ({"data.kind": "token_file", "data.vocab_size": 256}, r"data.token_file is empty"),
    ({"data.kind": "mqar", "data.vocab_size": 256, "data.mqar_num_kv_pairs": 200}, r"fewer than num_kv_pairs=200"),
    ({"data.kind": "mqar", "data.vocab_size": 256, "data.mqar_num_kv_pairs": 120, "seq_len": 200},
     r"seq_len=200 cannot hold 120 pairs"),
    ({"data.heldout_fraction": 0.0}, r"heldout_fraction=0.0 must be in \(0, 1\)"),
])
def test_unsafe_or_invalid_values_raise(changes, message):
  with pytest.raises(ValueError, match=message):
    validate(_cfg(**changes))


def test_model_section_is_built_from_the_dataclasses_and_reads_back():
  """`model` is ModelConfig's fields (kda and router as sections), each default the dataclass's,
  and a ModelConfig with every None of NONE_AS written as its number reads back equal."""
  import dataclasses
  from k3jax.models.config import ModelConfig
  from k3jax.routing.config import RouterConfig
  from k3jax.train.config_schema import model_config_from
  from k3jax.train.defaults import config_dict, model_config
  from pallas_kernels.kda.spec import FIELDS as KDA_FIELDS
  from pallas_kernels.kda.spec import KdaSpec
  section = model_config()
  assert sorted(section) == sorted(f.name for f in dataclasses.fields(ModelConfig))
  assert sorted(section.kda) == sorted(KDA_FIELDS)
  assert sorted(section.router) == sorted(f.name for f in dataclasses.fields(RouterConfig))
  assert section.kda.lower_bound == -5.0 and section.router.overflow_choices == -1
  assert model_config_from(section) == ModelConfig()
  changed = ModelConfig(d_model=32, kda=KdaSpec(lower_bound=None, diagonal="pairwise", sub_chunk=8),
                        router=RouterConfig(name="topk", capacity_factor=None, overflow_choices=1))
  assert config_dict(changed).kda.lower_bound == 0.0
  assert model_config_from(config_dict(changed)) == changed
  assert ModelConfig.from_dict(changed.to_dict()) == changed


@pytest.mark.parametrize("old,new", [("g_min", "kda.lower_bound"), ("gate", "kda.lower_bound"),
                                     ("kda_chunk_size", "kda.chunk_size")])
def test_a_flat_model_key_names_its_nested_key(old, new):
  from k3jax.train.config_schema import unknown_field_message
  message = unknown_field_message(f"model.{old}")
  assert message.startswith(f"config 'model.{old}' is now 'model.{new}'") and "\n" not in message
  with pytest.raises(ValueError, match=re.escape(message)):  # the same line from a config file
    validate(_cfg(**{f"model.{old}": -5.0}))
