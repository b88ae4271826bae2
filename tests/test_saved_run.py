"""A run directory written by an earlier version still loads and restores to the same model.

`fixtures/run_0eb97c0` was written at commit 0eb97c0 (config.json and a step-1
checkpoint of a 2-layer, 8-wide model from `configs/tiny.py`); `expected.json`
holds, from that commit, its ModelConfig (`to_dict`, the flat KDA keys), the sum
of every parameter and the logits of a fixed batch.

`fixtures/tiny_config_c209b6a` is `configs/tiny.py`'s config.json as commit
c209b6a wrote it, the last with a flat `model` section (`model.g_min`,
`model.kda_chunk_size`, ...); `expected.json` holds that commit's ModelConfig repr.
"""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.models.config import ModelConfig
from k3jax.train.config_files import load_config_file
from k3jax.train.config_schema import model_config_from
from k3jax.train.restore import restore_model
from k3jax.train.run_config import check_resume, config_to_plain, load_run_config, nest_model_section

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
FIXTURE = os.path.join(FIXTURES, "run_0eb97c0")
TINY_FIXTURE = os.path.join(FIXTURES, "tiny_config_c209b6a")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path):
  with open(path, encoding="utf-8") as f:
    return json.load(f)


@pytest.fixture(scope="module")
def expected():
  return _read(os.path.join(FIXTURE, "expected.json"))


def _from_flat(flat: dict) -> ModelConfig:
  """The ModelConfig a flat record of 0eb97c0 (`gate`, `g_min`, `kda_*` keys) describes."""
  kda = {"chunk_size": flat["kda_chunk_size"], "sub_chunk": flat["kda_sub_chunk"],
         "diagonal": flat["kda_diagonal"], "implementation": flat["kda_implementation"],
         "lower_bound": flat["g_min"] if flat["gate"] == "bounded" else None}
  rest = {k: v for k, v in flat.items()
          if k not in ("gate", "g_min", "kda_chunk_size", "kda_sub_chunk", "kda_diagonal",
                       "kda_implementation")}
  return ModelConfig.from_dict({**rest, "kda": kda})


def test_saved_config_loads_to_the_same_model_config(expected):
  config = load_run_config(FIXTURE)
  assert model_config_from(config.model) == _from_flat(expected["model_config"])


def test_a_flat_config_json_reads_as_todays_nested_preset():
  """The tiny preset's config.json of c209b6a reads as the preset does now, whole, and a
  resume with the preset finds nothing changed."""
  config = load_run_config(TINY_FIXTURE)
  assert repr(model_config_from(config.model)) == _read(
      os.path.join(TINY_FIXTURE, "expected.json"))["model_config_repr"]
  tiny = load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
  assert config_to_plain(config) == config_to_plain(tiny)
  assert check_resume(TINY_FIXTURE, tiny) == []


def test_a_flat_softplus_section_reads_as_no_bound():
  nested = nest_model_section({"gate": "softplus", "g_min": -5.0, "kda_diagonal": "pairwise",
                               "d_model": 8})
  assert nested == {"d_model": 8, "kda": {"lower_bound": 0.0, "diagonal": "pairwise"}}
  assert model_config_from(nested).kda.lower_bound is None


def test_saved_checkpoint_restores_the_same_parameters_and_outputs(tmp_path, expected):
  run = shutil.copytree(FIXTURE, tmp_path / "run")  # restoring must not touch the fixture
  model, model_cfg, step = restore_model(str(run))
  assert step == expected["step"] and model_cfg == _from_flat(expected["model_config"])
  params = nnx.state(model, nnx.Param)
  sums = {jax.tree_util.keystr(path): float(np.asarray(x, np.float64).sum())
          for path, x in jax.tree_util.tree_leaves_with_path(params)}
  assert sums == expected["param_sums"]
  tokens_bt = (jnp.arange(32, dtype=jnp.int32) % 16).reshape(2, 16)
  # Jitted, as training and evaluation run it (op by op it took three times as long on the CPU).
  logits_btv, _ = nnx.jit(lambda m, t: m(t, deterministic=True))(model, tokens_bt)
  np.testing.assert_allclose(np.asarray(logits_btv[:, 0, :], np.float64), expected["logits_bt0"],
                             atol=1e-5)
  np.testing.assert_allclose(float(np.asarray(logits_btv, np.float64).sum()), expected["logits_sum"],
                             atol=1e-4)
