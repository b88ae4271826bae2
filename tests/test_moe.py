"""MoE layer: ragged vs dense vs a float64 reference, router state, axes, gradients."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.layers import moe
from k3jax.routing import RouterConfig

ATOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
RTOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
ALL = ("quantile", "quantile_lagged", "bias_sign", "aux_loss", "expert_choice", "topk")


def _config(name="quantile", cf=1.0, **kw):
  base = dict(d_model=32, num_experts=8, top_k=2, expert_hidden=24, num_shared_experts=1,
              shared_hidden=16, router=RouterConfig(name=name, capacity_factor=cf))
  base.update(kw)
  return moe.MoEConfig(**base)


def _pair(config, seed=0):
  ragged = moe.MoE(config, rngs=nnx.Rngs(seed))
  dense = moe.MoE(dataclasses.replace(config, impl="dense"), rngs=nnx.Rngs(seed))
  return ragged, dense


@nnx.jit(static_argnames="deterministic")
def _apply(layer, x, deterministic=True):
  return layer(x, deterministic=deterministic)


def _reference(layer, x_btd):
  """Float64 numpy MoE from the layer's params and its routing decision."""
  from k3jax import routing  # pylint: disable=g-import-not-at-top
  p = {k: np.asarray(v[...], np.float64) for k, v in nnx.state(layer, nnx.Param).items()}
  x = np.asarray(x_btd, np.float64).reshape(-1, x_btd.shape[-1])
  state = None if layer.router_state is None else layer.router_state.get_value()
  cfg = layer.config

  @jax.jit
  def decide(x32, kernel, state):
    scores = jax.nn.sigmoid(x32 @ kernel)
    return routing.route(scores, k=cfg.top_k, config=cfg.router, state=state)[:2]

  idx, w = decide(jnp.asarray(x, jnp.float32), layer.router_kernel[...], state)
  idx, w = np.asarray(idx), np.asarray(w, np.float64)
  silu = lambda z: z / (1 + np.exp(-z))
  h_tkh = silu(np.einsum("td,tkdh->tkh", x, p["wi_gate"][idx])) * np.einsum(
      "td,tkdh->tkh", x, p["wi_up"][idx])
  y = np.einsum("tkh,tkhd,tk->td", h_tkh, p["wo"][idx], w)
  if "shared_gate" in p:
    y += (silu(x @ p["shared_gate"]) * (x @ p["shared_up"])) @ p["shared_out"]
  return y.reshape(x_btd.shape), w


@pytest.mark.parametrize("name", ["quantile", "expert_choice"])
def test_ragged_matches_dense_and_float64_reference(name):
  config = _config(name, cf=0.75)  # tight capacity: some assignments dropped
  ragged, dense = _pair(config)
  x = jax.random.normal(jax.random.key(1), (2, 48, 32))
  y_r, aux = _apply(ragged, x)
  y_d, _ = _apply(dense, x)
  buffered = moe.MoE(dataclasses.replace(config, impl="buffered"), rngs=nnx.Rngs(0))
  y_b, _ = _apply(buffered, x)
  ref, w = _reference(ragged, x)
  assert (w == 0).any()
  np.testing.assert_allclose(np.asarray(y_r), np.asarray(y_d), atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(y_b), np.asarray(y_d), atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(y_r), ref, atol=ATOL[jnp.float32], rtol=RTOL[jnp.float32])
  assert float(aux["drop_fraction"]) > 0


def test_bfloat16_compute_matches_float64_reference():
  config = _config("quantile", cf=1.25, dtype=jnp.bfloat16)
  ragged, dense = _pair(config)
  x = jax.random.normal(jax.random.key(2), (2, 40, 32))
  y_r, _ = _apply(ragged, x)
  y_d, _ = _apply(dense, x)
  ref, _ = _reference(ragged, x)
  scale = np.abs(ref).max()
  np.testing.assert_allclose(np.asarray(y_r) / scale, ref / scale, atol=ATOL[jnp.bfloat16])
  np.testing.assert_allclose(np.asarray(y_d) / scale, ref / scale, atol=ATOL[jnp.bfloat16])


def test_no_shared_expert_and_poisoned_params():
  config = _config("topk", cf=None, num_shared_experts=0)
  layer = moe.MoE(config, rngs=nnx.Rngs(3))
  assert layer.shared_gate is None
  x = jax.random.normal(jax.random.key(3), (1, 16, 32))
  ref, _ = _reference(layer, x)
  np.testing.assert_allclose(np.asarray(_apply(layer, x)[0]), ref, atol=2e-5, rtol=2e-5)
  # A NaN in an expert no token uses must not reach the output (dropped rows masked).
  used = set(np.asarray(
      jax.lax.top_k(jax.nn.sigmoid(x.reshape(16, 32) @ layer.router_kernel[...]), 2)[1]).ravel())
  unused = [e for e in range(8) if e not in used]
  if unused:
    layer.wo[...] = layer.wo[...].at[unused[0]].set(jnp.nan)
    assert np.isfinite(np.asarray(_apply(layer, x)[0])).all()


@pytest.mark.parametrize("name", ["quantile_lagged", "bias_sign"])
def test_router_state_updates_in_training_and_freezes_in_eval(name):
  layer = moe.MoE(_config(name, cf=None), rngs=nnx.Rngs(0))
  assert isinstance(layer.router_state, moe.RouterState)
  assert not isinstance(layer.router_state, nnx.Param)
  assert "router_state" not in nnx.state(layer, nnx.Param)
  x = jax.random.normal(jax.random.key(5), (2, 64, 32)) + 0.5
  before = np.asarray(layer.router_state.get_value()["bias"])
  _apply(layer, x, deterministic=True)
  np.testing.assert_array_equal(np.asarray(layer.router_state.get_value()["bias"]), before)
  _apply(layer, x, deterministic=False)
  after = np.asarray(layer.router_state.get_value()["bias"])
  assert not np.array_equal(after, before)
  y1, _ = _apply(layer, x, deterministic=True)
  y2, _ = _apply(layer, x, deterministic=True)
  np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))


def test_stateless_router_has_no_state():
  assert moe.MoE(_config("quantile"), rngs=nnx.Rngs(0)).router_state is None


def test_every_param_has_logical_axes():
  layer = moe.MoE(_config("quantile"), rngs=nnx.Rngs(0))
  want = {"router_kernel": ("embed", None), "wi_gate": ("expert", "embed", "mlp"),
          "wi_up": ("expert", "embed", "mlp"), "wo": ("expert", "mlp", "embed"),
          "shared_gate": ("embed", "mlp"), "shared_up": ("embed", "mlp"),
          "shared_out": ("mlp", "embed")}
  params = dict(nnx.state(layer, nnx.Param).items())
  assert set(params) == set(want)
  for name, var in params.items():
    assert tuple(var.get_metadata()["out_sharding"]) == want[name], name
    assert len(want[name]) == var[...].ndim


@pytest.mark.parametrize("name", ["quantile", "aux_loss"])
def test_gradients_reach_experts_and_router(name):
  layer = moe.MoE(_config(name, cf=1.0), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(6), (2, 32, 32))

  @nnx.jit
  def grads(layer, x):
    def loss_fn(layer):
      y, aux = layer(x, deterministic=True)
      return jnp.mean(y ** 2) + aux["aux_loss"], aux
    return nnx.grad(loss_fn, has_aux=True)(layer)

  g, aux = grads(layer, x)
  for key in ("router_kernel", "wi_gate", "wi_up", "wo", "shared_gate"):
    assert float(jnp.abs(g[key][...]).max()) > 0, key
  if name == "aux_loss":
    assert float(aux["aux_loss"]) > 0
  else:
    assert float(aux["aux_loss"]) == 0.0
  for key in ("max_vio", "drop_fraction", "load_cv", "aux_loss"):
    assert aux[key].shape == () and aux[key].dtype == jnp.float32


def test_lagged_layer_is_causal_in_eval():
  layer = moe.MoE(_config("quantile_lagged", cf=None), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(7), (2, 64, 32))
  _apply(layer, x, deterministic=False)  # a non-zero bias from one batch
  t = 30
  x2 = x.at[0, t + 1:].set(jax.random.normal(jax.random.key(8), (64 - t - 1, 32)))
  y1, _ = _apply(layer, x)
  y2, _ = _apply(layer, x2)
  np.testing.assert_array_equal(np.asarray(y1[:, : t + 1]), np.asarray(y2[:, : t + 1]))
  assert not np.array_equal(np.asarray(y1[0, t + 1:]), np.asarray(y2[0, t + 1:]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=9), "top_k"), (dict(impl="scatter"), "impl"), (dict(d_model=0), "d_model"),
    (dict(impl="buffered", cf=None), "capacity_factor"),
    (dict(router="quantile"), "router")])
def test_config_rejects_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _config(**kwargs)


def test_call_rejects_bad_shape():
  layer = moe.MoE(_config(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="shape"):
    layer(jnp.zeros((2, 4, 31)))


@pytest.mark.gpu
def test_buffered_matches_dense_at_scale_on_gpu():
  config = _config("quantile", cf=1.0, d_model=256, num_experts=64, top_k=8,
                   expert_hidden=128, dtype=jnp.bfloat16)
  buffered = moe.MoE(dataclasses.replace(config, impl="buffered"), rngs=nnx.Rngs(0))
  dense = moe.MoE(dataclasses.replace(config, impl="dense"), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(11), (4, 1024, 256))
  y_b, aux = _apply(buffered, x)
  y_d, _ = _apply(dense, x)
  scale = float(jnp.abs(y_d).max())
  np.testing.assert_allclose(np.asarray(y_b) / scale, np.asarray(y_d) / scale,
                             atol=ATOL[jnp.bfloat16])
  assert float(aux["max_vio"]) <= 0.05
