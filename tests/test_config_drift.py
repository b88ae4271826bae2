"""The trainer's `model` section and the frozen dataclasses cannot drift apart.

`k3jax.train.defaults.model_config()` lists every model field with its meaning;
its keys and KDA values must be `ModelConfig`'s (the KDA spec spelled flat, as
`ModelConfig.to_dict` writes it), so a default changed in one place fails here.
"""
from k3jax.configdict import to_plain
from k3jax.models import config as model_config_lib
from k3jax.models.config import ModelConfig
from k3jax.train import defaults

# Owned by the MoE/router configs, checked with them.
_ROUTER_SIDE = {"router"}


def test_model_section_has_exactly_the_dataclass_keys():
  section = to_plain(defaults.model_config())
  assert sorted(section) == sorted(model_config_lib.trainer_keys())


def test_model_section_defaults_are_the_dataclass_defaults():
  section = to_plain(defaults.model_config())
  want = ModelConfig().to_dict()
  differ = {k: (section[k], want[k]) for k in want
            if k not in _ROUTER_SIDE and section[k] != want[k]}
  assert not differ, f"train/defaults.py vs ModelConfig defaults: {differ}"


def test_the_flat_section_builds_the_default_model():
  section = {k: v for k, v in to_plain(defaults.model_config()).items() if k not in _ROUTER_SIDE}
  assert ModelConfig.from_dict(section) == ModelConfig()
