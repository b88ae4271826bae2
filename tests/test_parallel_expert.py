"""Expert-parallel MoE on 8 fake CPU devices against the unsharded layer."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.layers import moe, moe_path
from k3jax.routing import capacity as capacity_lib
from k3jax.sharding import rules
from k3jax.sharding.mesh import MeshConfig, make_mesh
from k3jax.routing import RouterConfig

# float32 compute, float32 accumulation: only summation order differs.
TOL = {jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5)}


def _layer(seed=0, **kw):
  base = dict(d_model=32, num_experts=8, top_k=2, expert_hidden=24, num_shared_experts=1,
              shared_hidden=16, router=RouterConfig(name="quantile", capacity_factor=1.0))
  base.update(kw)
  return moe.MoE(moe.MoEConfig(**base), rngs=nnx.Rngs(seed))


def _loss_and_grads(layer, x):
  def loss(layer, x):
    y, _ = layer(x, deterministic=True)
    return jnp.sum(jnp.sin(y)), y
  return nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)


@pytest.mark.parametrize("mesh_shape, impl, backend", [
    ((2, 4), "ragged", "auto"), ((1, 8), "buffered", "auto"),
    ((2, 4), "ragged", "pallas")])  # the grouped matmuls on the received rows
def test_lossless_expert_parallel_equals_unsharded_layer(mesh_shape, impl, backend, monkeypatch):
  data, expert = mesh_shape
  mesh = make_mesh(MeshConfig(data=data, expert=expert))
  x = jax.random.normal(jax.random.key(1), (8, 8, 32), jnp.float32)
  kw = dict(grouped_backend="pallas", expert_hidden=32) if backend == "pallas" else {}
  plain = _layer(impl=impl, **kw)
  (_, y_ref), (g_ref, dx_ref) = nnx.jit(_loss_and_grads)(plain, x)

  calls = []
  real = moe_path.expert_parallel_swiglu
  monkeypatch.setattr(moe_path, "expert_parallel_swiglu",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  ep = _layer(impl=impl, expert_parallel=moe_path.ExpertParallel(), **kw)
  graphdef, state = nnx.split(ep)
  state = rules.shard_tree(state, mesh)
  assert state["wi_gate"].get_value().sharding.spec == jax.sharding.PartitionSpec("expert")
  xs = jax.device_put(x, jax.sharding.NamedSharding(
      mesh, rules.activation_spec(("batch", "length", "embed"), mesh, shape=x.shape)))

  @jax.jit
  def run(state, x):
    return _loss_and_grads(nnx.merge(graphdef, state), x)

  with jax.set_mesh(mesh):
    (_, y), (g, dx) = run(state, xs)
    hlo = run.lower(state, xs).as_text()
  assert calls, "the expert-parallel path was not taken"
  assert "all_to_all" in hlo or "all-to-all" in hlo
  tol = TOL[jnp.dtype(jnp.float32)]
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), **tol)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), **tol)
  g_ref_flat = dict(nnx.to_flat_state(nnx.state(g_ref, nnx.Param)))
  for path, var in nnx.to_flat_state(nnx.state(g, nnx.Param)):
    np.testing.assert_allclose(np.asarray(var.get_value()),
                               np.asarray(g_ref_flat[path].get_value()), **tol,
                               err_msg=f"gradient of {path}")


def _expected_with_capacity(x, idx, w, wg, wu, wo, n_blocks, n_shards, cap):
  """float64 numpy: drop, per source block and destination shard, the
  assignments past `cap` in (token, slot) order; then the dense MoE."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64).copy()
  idx = np.asarray(idx)
  wg, wu, wo = (np.asarray(a, np.float64) for a in (wg, wu, wo))
  n, k = idx.shape
  e_local = wg.shape[0] // n_shards
  nl = n // n_blocks
  for blk in range(n_blocks):
    rows = range(blk * nl, (blk + 1) * nl)
    pairs = [(idx[r, j], r, j) for r in rows for j in range(k) if w[r, j] > 0]
    used = [0] * n_shards
    for e, r, j in pairs:
      dest = e // e_local
      if used[dest] >= cap:
        w[r, j] = 0.0
      used[dest] += 1
  silu = lambda z: z / (1 + np.exp(-z))
  h = silu(np.einsum("nd,nkdh->nkh", x, wg[idx])) * np.einsum("nd,nkdh->nkh", x, wu[idx])
  return np.einsum("nkh,nkhd,nk->nd", h, wo[idx], w), w


def test_capacity_drops_overflow_in_token_order():
  mesh = make_mesh(MeshConfig(data=1, expert=8))
  n, d, e, h, k = 64, 16, 8, 8, 2
  keys = jax.random.split(jax.random.key(3), 6)
  x = jax.random.normal(keys[0], (n, d))
  # Skewed routing: experts 0 and 1 (shard 0 and 1) are popular.
  logits = jax.random.normal(keys[1], (n, e)) + jnp.array([3.0, 2.0] + [0.0] * 6)
  idx = jax.lax.top_k(logits, k)[1]
  w = jax.random.uniform(keys[2], (n, k), minval=0.1)
  w = w.at[::5, 1].set(0.0)  # some router drops
  wg = jax.random.normal(keys[3], (e, d, h)) / 4
  wu = jax.random.normal(keys[4], (e, d, h)) / 4
  wo = jax.random.normal(keys[5], (e, h, d)) / 4
  cf = 1.0
  cap = capacity_lib.dispatch_slots(n // 8, k, 8, cf)
  assert cap == 2  # 8 tokens x 2 slots per device, spread over 8 shards
  y, dropped = jax.jit(lambda *a: moe_path.expert_parallel_swiglu(
      *a, mesh=mesh, dispatch_slot_factor=cf, return_dropped=True))(x, idx, w, wg, wu, wo)
  expected, w_kept = _expected_with_capacity(x, idx, w, wg, wu, wo, 8, 8, cap)
  n_router_kept = (np.asarray(w) > 0).sum()
  n_dropped = n_router_kept - (w_kept > 0).sum()
  assert n_dropped > 0, "the test must overflow somewhere"
  np.testing.assert_allclose(float(dropped), n_dropped / n_router_kept, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(y), expected, atol=1e-5, rtol=1e-5)
  # Lossless dispatch of the same assignments keeps everything.
  y_all = jax.jit(lambda *a: moe_path.expert_parallel_swiglu(*a, mesh=mesh))(
      x, idx, w, wg, wu, wo)
  full, _ = _expected_with_capacity(x, idx, w, wg, wu, wo, 8, 8, math.inf)
  np.testing.assert_allclose(np.asarray(y_all), full, atol=1e-5, rtol=1e-5)


def test_errors_name_the_bad_value():
  mesh = make_mesh(MeshConfig(data=2, expert=4))
  x, idx, w = jnp.zeros((8, 4)), jnp.zeros((8, 1), jnp.int32), jnp.ones((8, 1))
  wg = jnp.zeros((6, 4, 2))
  with pytest.raises(ValueError, match="num_experts=6 must be divisible by the expert axis size 4"):
    moe_path.expert_parallel_swiglu(x, idx, w, wg, wg, jnp.zeros((6, 2, 4)), mesh=mesh)
  wg = jnp.zeros((8, 4, 2))
  with pytest.raises(ValueError, match="N=6 tokens"):
    moe_path.expert_parallel_swiglu(x[:6], idx[:6], w[:6], wg, wg, jnp.zeros((8, 2, 4)), mesh=mesh)
  with pytest.raises(ValueError, match="needs a mesh"):
    moe_path.expert_parallel_swiglu(x, idx, w, wg, wg, jnp.zeros((8, 2, 4)))
  with pytest.raises(ValueError, match="dispatch_slot_factor=0"):
    capacity_lib.dispatch_slots(8, 2, 4, 0)
  with pytest.raises(ValueError, match="dispatch_slot_factor=0"):
    moe_path.ExpertParallel(dispatch_slot_factor=0)


def test_without_expert_axis_the_expert_parallel_layer_is_the_plain_layer():
  x = jax.random.normal(jax.random.key(2), (2, 8, 32), jnp.float32)
  plain = _layer(seed=4)
  ep = _layer(seed=4, expert_parallel=moe_path.ExpertParallel())
  # One class, one parameter tree: the path is a setting chosen at build time.
  assert type(ep) is type(plain) is moe.MoE
  assert ep.path == dataclasses.replace(plain.path, expert_parallel=moe_path.ExpertParallel())
  assert nnx.to_flat_state(nnx.state(ep)).paths == nnx.to_flat_state(nnx.state(plain)).paths
  apply = nnx.jit(lambda layer, x: layer(x, deterministic=True)[0])
  np.testing.assert_array_equal(np.asarray(apply(plain, x)), np.asarray(apply(ep, x)))
  mesh = make_mesh(MeshConfig(data=8, expert=1))
  with jax.set_mesh(mesh):
    assert not ep.path.distributes()


def _skewed_assignments(n, d, e, h, k, seed):
  keys = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(keys[0], (n, d))
  logits = jax.random.normal(keys[1], (n, e)) + jnp.array([3.0, 2.0] + [0.0] * (e - 2))
  idx = jax.lax.top_k(logits, k)[1]
  w = jax.random.uniform(keys[2], (n, k), minval=0.1)
  w = w.at[::5, 1].set(0.0)
  wg = jax.random.normal(keys[3], (e, d, h)) / 4
  wu = jax.random.normal(keys[4], (e, d, h)) / 4
  wo = jax.random.normal(keys[5], (e, h, d)) / 4
  return x, idx, w, wg, wu, wo


def test_buffered_local_grouping_equals_ragged_when_nothing_overflows():
  mesh = make_mesh(MeshConfig(data=2, expert=4))
  args = _skewed_assignments(64, 16, 8, 8, 2, seed=5)
  run = lambda impl: jax.jit(lambda *a: moe_path.expert_parallel_swiglu(
      *a, mesh=mesh, local_impl=impl, return_dropped=True))(*args)
  (y_r, drop_r), (y_b, drop_b) = run("ragged"), run("buffered")
  np.testing.assert_allclose(np.asarray(y_b), np.asarray(y_r), atol=1e-5, rtol=1e-5)
  assert float(drop_r) == float(drop_b) == 0.0


def test_buffered_local_capacity_drops_overflow_in_token_order_and_counts_it():
  mesh = make_mesh(MeshConfig(data=2, expert=4))
  n, d, e, h, k = 64, 16, 8, 8, 2
  x, idx, w, wg, wu, wo = _skewed_assignments(n, d, e, h, k, seed=6)
  lcf = 1.0
  e_local = e // 4
  lcap = capacity_lib.local_expert_capacity(n // 8 * k, e_local, lcf)
  y, dropped = jax.jit(lambda *a: moe_path.expert_parallel_swiglu(
      *a, mesh=mesh, local_impl="buffered", local_capacity_factor=lcf,
      return_dropped=True))(x, idx, w, wg, wu, wo)
  # Lossless dispatch; within a data group (half the tokens), a local
  # expert's rows arrive in source-device order, then slot order: token
  # order. Keep the first lcap per (data group, expert).
  w_kept = np.asarray(w, np.float64).copy()
  idx_np = np.asarray(idx)
  used = np.zeros((2, e), int)
  for r in range(n):
    for j in range(k):
      if w_kept[r, j] > 0:
        group = r // (n // 2)
        if used[group, idx_np[r, j]] >= lcap:
          w_kept[r, j] = 0.0
        used[group, idx_np[r, j]] += 1
  n_kept = (np.asarray(w) > 0).sum()
  n_dropped = n_kept - (w_kept > 0).sum()
  assert n_dropped > 0, "the skew must overflow the hot experts' buffers"
  np.testing.assert_allclose(float(dropped), n_dropped / n_kept, rtol=1e-6)
  expected, _ = _expected_with_capacity(x, idx, w_kept, wg, wu, wo, 1, 4, math.inf)
  np.testing.assert_allclose(np.asarray(y), expected, atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="local_impl='grouped'"):
    moe_path.expert_parallel_swiglu(x, idx, w, wg, wu, wo, mesh=mesh, local_impl="grouped")


def test_layer_reports_dispatch_drops():
  mesh = make_mesh(MeshConfig(data=1, expert=8))
  x = jax.random.normal(jax.random.key(7), (8, 8, 32), jnp.float32)
  plain_aux = nnx.jit(lambda layer, x: layer(x, deterministic=True)[1])(_layer(impl="buffered"), x)
  assert float(plain_aux["dispatch_drop_fraction"]) == 0.0

  def drops(slot_factor):
    ep = _layer(impl="buffered",
                expert_parallel=moe_path.ExpertParallel(dispatch_slot_factor=slot_factor))
    graphdef, state = nnx.split(ep)
    state = rules.shard_tree(state, mesh)
    with jax.set_mesh(mesh):
      aux = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, deterministic=True)[1])(state, x)
    return float(aux["dispatch_drop_fraction"])

  assert drops(None) == 0.0
  # 8 tokens x 2 choices per device, 1 slot per destination: most are dropped.
  assert 0.3 < drops(0.25) < 1.0
