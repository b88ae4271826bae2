"""A run directory written by an earlier version still loads and restores to the same model.

`fixtures/run_0eb97c0` was written at commit 0eb97c0 (config.json and a step-1
checkpoint of a 2-layer, 8-wide model from `configs/tiny.py`); `expected.json`
holds, from that commit, its ModelConfig, the sum of every parameter and the
logits of a fixed batch.
"""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.train.config_schema import model_config_from
from k3jax.train.restore import restore_model
from k3jax.train.run_config import load_run_config

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "run_0eb97c0")


@pytest.fixture(scope="module")
def expected():
  with open(os.path.join(FIXTURE, "expected.json"), encoding="utf-8") as f:
    return json.load(f)


def test_saved_config_loads_to_the_same_model_config(expected):
  config = load_run_config(FIXTURE)
  assert model_config_from(config.model).to_dict() == expected["model_config"]


def test_saved_checkpoint_restores_the_same_parameters_and_outputs(tmp_path, expected):
  run = shutil.copytree(FIXTURE, tmp_path / "run")  # restoring must not touch the fixture
  model, model_cfg, step = restore_model(str(run))
  assert step == expected["step"] and model_cfg.to_dict() == expected["model_config"]
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
