"""KdaSpec: built and validated once, from the model config to the kernel call."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.layers.kda import KDA
from k3jax.models.config import ModelConfig
from k3jax.models.lm import HybridLM
from pallas_kernels.kda import api
from pallas_kernels.kda import spec as spec_lib
from pallas_kernels.kda.spec import KdaSpec
from tests.kda_inputs import vjp_inputs


@pytest.mark.parametrize("fields,match", [
    (dict(implementation="cuda"), "implementation must be one of"),
    (dict(diagonal="banded", lower_bound=-5.0), "diagonal must be one of"),
    (dict(chunk_size=0, lower_bound=-5.0), "chunk_size must be a positive int"),
    (dict(chunk_size=64, sub_chunk=24, lower_bound=-5.0), "sub_chunk must divide chunk_size=64"),
    (dict(lower_bound=0.5), "lower_bound must be negative"),
    (dict(), "diagonal='dense' needs lower_bound"),
    (dict(lower_bound=-10.0), "unsafe for a dense diagonal tile of length 16"),
])
def test_spec_rejects_bad_choices(fields, match):
  with pytest.raises(ValueError, match=match):
    KdaSpec(**fields)


def test_spec_accepts_what_each_path_needs():
  assert KdaSpec(diagonal="pairwise").lower_bound is None       # any gate
  assert KdaSpec(implementation="naive").diagonal == "dense"     # the loop ignores tiling
  with pytest.raises(ValueError, match="unsafe"):                  # but a given bound is checked
    KdaSpec(implementation="naive", lower_bound=-20.0)
  assert KdaSpec(lower_bound=-5).lower_bound == -5.0             # normalised to a float
  with pytest.raises(dataclasses.FrozenInstanceError):
    KdaSpec(lower_bound=-5.0).chunk_size = 32


def test_resolve_takes_a_spec_or_its_fields():
  spec = KdaSpec(chunk_size=32, sub_chunk=8, lower_bound=-5.0, implementation="pallas")
  assert spec_lib.resolve(spec) is spec
  assert spec_lib.resolve(None, chunk_size=32, sub_chunk=8, lower_bound=-5.0,
                          implementation="pallas") == spec
  with pytest.raises(ValueError, match="pass either spec or its fields"):
    spec_lib.resolve(spec, sub_chunk=16)
  with pytest.raises(TypeError, match="spec must be a KdaSpec"):
    spec_lib.resolve({"chunk_size": 32})


@pytest.mark.parametrize("implementation", ["xla", "pallas", "naive"])
def test_chunk_kda_with_a_spec_matches_its_keywords(implementation):
  (q, k, v, g, beta, h0), _, _ = vjp_inputs(0, b=1, t=40, h=2, dk=16, dv=16, gates="spread")
  fields = dict(chunk_size=16, sub_chunk=8, lower_bound=-5.0, implementation=implementation)
  kw = dict(initial_state=h0, output_final_state=True, interpret=True)
  by_spec = api.chunk_kda(q, k, v, g, beta, spec=KdaSpec(**fields), **kw)
  by_keywords = api.chunk_kda(q, k, v, g, beta, **fields, **kw)
  for a, b in zip(by_spec, by_keywords):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_model_config_builds_the_spec_the_layers_hold():
  config = ModelConfig(vocab_size=64, d_model=32, num_layers=2, layer_pattern="KA",
                       num_heads=2, head_dim=16, num_kv_heads=2, num_experts=0,
                       kda=KdaSpec(chunk_size=32, sub_chunk=8, lower_bound=-4.0))
  d = config.to_dict()
  assert ModelConfig.from_dict(d) == config and d["kda"]["lower_bound"] == -4.0
  model = HybridLM(config, rngs=nnx.Rngs(0))
  assert model.layers[0].mixer.spec is config.kda
  # A partial kda mapping keeps the model's default spec for the fields it leaves out.
  softplus = ModelConfig.from_dict(dict(d, kda=dict(lower_bound=None, diagonal="pairwise")))
  assert softplus.kda == KdaSpec(lower_bound=None, diagonal="pairwise") and softplus.gate == "softplus"
  with pytest.raises(ValueError, match=r"^kda.sub_chunk must divide chunk_size=36, got 8"):
    ModelConfig.from_dict(dict(d, kda=dict(d["kda"], chunk_size=36)))


def test_layer_takes_the_spec_whole():
  spec = KdaSpec(lower_bound=-5.0)
  layer = KDA(16, 1, 8, spec=spec, rngs=nnx.Rngs(0))
  assert layer.spec is spec and layer.bounded
  assert not KDA(16, 1, 8, spec=KdaSpec(diagonal="pairwise"), rngs=nnx.Rngs(0)).bounded
  built = KDA(16, 1, 8, spec=KdaSpec(chunk_size=32, sub_chunk=8, lower_bound=-4.0),
              rngs=nnx.Rngs(0))
  y, _ = built(jnp.ones((1, 5, 16)))
  assert y.shape == (1, 5, 16) and bool(jnp.all(jnp.isfinite(y)))
