"""Slot plans, the gather-only dispatch/combine VJPs, and the grouped MoE modes
against the dense reference (forward and every gradient)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.layers import grouped_matmul
from k3jax.layers import moe
from k3jax.layers import moe_dispatch
from k3jax.routing import RouterConfig
from pallas_kernels import platform
from pallas_kernels.gmm.config import GmmConfig

TOL = {jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5)}


def _assignments(seed, n=37, k=3, groups=5, drop_every=4):
  rng = np.random.default_rng(seed)
  group = np.stack([rng.permutation(groups)[:k] for _ in range(n)]).astype(np.int32)
  kept = np.ones((n, k), bool)
  kept[::drop_every, -1] = False
  return group, kept


def _plan_reference(group, kept, groups, cap):
  """Plain loop: slots per group in flat (token, choice) order."""
  n, k = group.shape
  used = [0] * groups
  slot = np.full((n, k), -1)
  order = [[] for _ in range(groups)]
  for a in range(n * k):
    t, j = divmod(a, k)
    if not kept[t, j]:
      continue
    g = group[t, j]
    if cap is None or used[g] < cap:
      order[g].append(a)
      slot[t, j] = used[g]  # rank within the group
    used[g] += 1
  return slot, order


@pytest.mark.parametrize("positions, align", [("sort", 1), ("count", 1), ("count", 8)])
@pytest.mark.parametrize("cap", [None, 4, 9])
def test_plan_matches_a_plain_loop(cap, positions, align):
  group, kept = _assignments(0)
  groups = 5
  plan = moe_dispatch.plan_slots(jnp.asarray(group), jnp.asarray(kept), groups, cap,
                                 positions=positions, align=align)
  rank, order = _plan_reference(group, kept, groups, cap)
  n, k = group.shape
  up = lambda x: -(-x // align) * align
  num_slots = up(n * k + groups * (align - 1)) if cap is None else groups * up(cap)
  assert plan.num_slots == num_slots and plan.align == align
  sizes = np.array([len(o) for o in order])
  np.testing.assert_array_equal(np.asarray(plan.group_sizes), sizes)
  if cap is None:
    padded = up(sizes)
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
  else:
    starts = np.arange(groups) * up(cap)
  np.testing.assert_array_equal(np.asarray(plan.group_starts), starts)
  want_slot = np.where(rank >= 0, starts[group] + np.maximum(rank, 0), num_slots)
  np.testing.assert_array_equal(np.asarray(plan.slot_nk), want_slot)
  want_assign = np.full(num_slots, n * k)
  for g, members in enumerate(order):
    want_assign[starts[g]:starts[g] + len(members)] = members
  np.testing.assert_array_equal(np.asarray(plan.assign_s), want_assign)
  np.testing.assert_array_equal(np.asarray(plan.source_s),
                                np.where(want_assign < n * k, want_assign // k, n))
  overflow = float(plan.overflow_count(jnp.asarray(kept)))
  assert overflow == kept.sum() - sizes.sum()
  if cap == 4:
    assert overflow > 0, "the case must overflow a group"


def test_plan_rejects_bad_arguments():
  group, kept = _assignments(1)
  with pytest.raises(ValueError, match="capacity=0"):
    moe_dispatch.plan_slots(jnp.asarray(group), jnp.asarray(kept), 5, 0)
  with pytest.raises(ValueError, match="positions='scan'"):
    moe_dispatch.plan_slots(jnp.asarray(group), jnp.asarray(kept), 5, positions="scan")
  with pytest.raises(ValueError, match="one shape"):
    moe_dispatch.plan_slots(jnp.asarray(group), jnp.asarray(kept[:, :2]), 5)


@pytest.mark.parametrize("cap", [None, 4])
def test_dispatch_and_combine_vjps_equal_autodiff_of_plain_gathers(cap):
  group, kept = _assignments(2)
  n, k = group.shape
  d = 6
  plan = moe_dispatch.plan_slots(jnp.asarray(group), jnp.asarray(kept), 5, cap)
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (n, d))
  y_s = jax.random.normal(keys[1], (plan.num_slots, d))
  w = jax.random.uniform(keys[2], (n, k)) * jnp.asarray(kept)

  def plain_dispatch(x):
    return jnp.take(x, plan.source_s, axis=0, mode="fill", fill_value=0)

  def plain_combine(y_s, w):
    rows = jnp.take(y_s, plan.slot_nk, axis=0, mode="fill", fill_value=0)
    return jnp.einsum("nkd,nk->nd", rows, w)

  ours = lambda x: moe_dispatch.dispatch_rows(x, plan.source_s, plan.slot_nk)
  np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(plain_dispatch(x)))
  ct = jax.random.normal(keys[3], (plan.num_slots, d))
  np.testing.assert_allclose(np.asarray(jax.vjp(ours, x)[1](ct)[0]),
                             np.asarray(jax.vjp(plain_dispatch, x)[1](ct)[0]), atol=1e-6)

  ours_c = lambda y_s, w: moe_dispatch.combine_rows(y_s, w, plan.slot_nk, plan.assign_s)
  np.testing.assert_allclose(np.asarray(ours_c(y_s, w)), np.asarray(plain_combine(y_s, w)),
                             atol=1e-6)
  ct = jax.random.normal(keys[3], (n, d))
  for got, want in zip(jax.vjp(ours_c, y_s, w)[1](ct), jax.vjp(plain_combine, y_s, w)[1](ct)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_unplaced_and_empty_slots_never_leak_nan():
  group, kept = _assignments(3)
  n, k = group.shape
  plan = moe_dispatch.plan_slots(jnp.asarray(group), jnp.asarray(kept), 5, 30)
  filled = np.zeros(plan.num_slots, bool)
  filled[np.asarray(plan.assign_s) < n * k] = True
  assert not filled.all()
  # Poison every slot no assignment owns: the combine and its gradients
  # must not read them.
  y_s = jnp.where(jnp.asarray(filled)[:, None], 1.0, jnp.nan) * jnp.ones((plan.num_slots, 4))
  w = jnp.ones((n, k)) * jnp.asarray(kept)
  f = lambda y_s, w: jnp.sum(moe_dispatch.combine_rows(y_s, w, plan.slot_nk, plan.assign_s))
  out, (dy, dw) = jax.value_and_grad(f, argnums=(0, 1))(y_s, w)
  assert np.isfinite(float(out))
  assert np.isfinite(np.asarray(dw)).all()
  np.testing.assert_array_equal(np.asarray(dy)[~filled], 0.0)


def _layer_pair(impl, cf, seed=0, router="quantile", **kw):
  base = dict(d_model=24, num_experts=6, top_k=2, expert_hidden=20, num_shared_experts=1,
              shared_hidden=12, router=RouterConfig(name=router, capacity_factor=cf,
                                                     overflow_choices=2), impl=impl)
  base.update(kw)
  config = moe.MoEConfig(**base)
  return (moe.MoE(config, rngs=nnx.Rngs(seed)),
          moe.MoE(dataclasses.replace(config, impl="dense"), rngs=nnx.Rngs(seed)))


def _value_and_grads(layer, x, ct):
  def loss(layer, x):
    y, aux = layer(x, deterministic=True)
    return jnp.sum(y * ct), aux
  return nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(layer, x)


# The Pallas grouped matmuls (interpret mode here) need widths that are multiples of 16.
PALLAS = dict(grouped_backend="pallas", d_model=32, expert_hidden=16,
              gmm_config=GmmConfig(block_m=16, block_n=16, block_k=16))


@pytest.mark.parametrize("impl, router, cf, backend", [
    ("buffered", "topk", 0.8, "auto"), ("buffered", "quantile", 1.25, "auto"),
    ("ragged", "topk", 0.8, "auto"), ("ragged", "quantile", None, "auto"),
    ("buffered", "topk", 0.8, "pallas"), ("ragged", "topk", 0.8, "pallas"),
    ("ragged", "quantile", None, "pallas")])
def test_grouped_modes_equal_dense_reference_forward_and_gradients(impl, router, cf, backend):
  # Plain top-k under a tight capacity both drops and reassigns assignments.
  kw = PALLAS if backend == "pallas" else {}
  layer, dense = _layer_pair(impl, cf, router=router, **kw)
  keys = jax.random.split(jax.random.key(4), 2)
  # 90 tokens: not a multiple of E
  x = jax.random.normal(keys[0], (2, 45, layer.config.d_model))
  ct = jax.random.normal(keys[1], x.shape)
  (v, aux), (g, dx) = _value_and_grads(layer, x, ct)
  (v_ref, aux_ref), (g_ref, dx_ref) = _value_and_grads(dense, x, ct)
  if cf == 0.8:
    assert float(aux["drop_fraction"]) > 0 and float(aux["reassigned_fraction"]) > 0
  for key in ("load", "max_vio", "drop_fraction", "reassigned_fraction", "load_cv"):
    np.testing.assert_array_equal(np.asarray(aux[key]), np.asarray(aux_ref[key]), err_msg=key)
  tol = TOL[jnp.dtype(jnp.float32)]
  np.testing.assert_allclose(float(v), float(v_ref), **tol)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), **tol)
  ref = dict(nnx.to_flat_state(nnx.state(g_ref, nnx.Param)))
  for path, var in nnx.to_flat_state(nnx.state(g, nnx.Param)):
    np.testing.assert_allclose(np.asarray(var.get_value()), np.asarray(ref[path].get_value()),
                               **tol, err_msg=f"gradient of {path}")
    assert np.abs(np.asarray(var.get_value())).max() > 0, path


@pytest.mark.parametrize("impl, cf, backend", [("buffered", 1.0, "auto"), ("ragged", None, "auto"),
                                               ("ragged", None, "pallas")])
def test_one_trace_per_shape(impl, cf, backend):
  layer, _ = _layer_pair(impl, cf, **(PALLAS if backend == "pallas" else {}))
  d = layer.config.d_model
  traces = []

  @nnx.jit
  def apply(layer, x):
    traces.append(1)
    return layer(x, deterministic=True)[0]

  # The first Pallas interpret call of a process adds a value to jax's tracing
  # context, which retraces once: a warm-up at another shape takes that.
  apply(layer, jax.random.normal(jax.random.key(8), (2, 8, d)))
  traces.clear()
  for seed in range(3):
    apply(layer, jax.random.normal(jax.random.key(seed), (2, 16, d)))
  assert len(traces) == 1
  apply(layer, jax.random.normal(jax.random.key(9), (2, 24, d)))
  assert len(traces) == 2


def test_auto_picks_the_kernels_that_read_token_rows_on_the_gpu(monkeypatch):
  # XLA's ragged_dot materialises [groups, rows, d] on NVIDIA GPUs; "auto" must not take it there.
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert grouped_matmul.resolve_backend("auto", ragged=True, pallas_widths=(32, 16)) == "pallas"
  assert grouped_matmul.resolve_backend("auto", ragged=True, pallas_widths=(32, 24)) == "xla"
  assert grouped_matmul.resolve_backend("auto", ragged=True) == "xla"  # dispatched rows
  assert grouped_matmul.resolve_backend("auto", ragged=False, pallas_widths=(32, 16)) == "einsum"
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert grouped_matmul.resolve_backend("auto", ragged=True, pallas_widths=(32, 16)) == "xla"


@pytest.mark.parametrize("impl, cf", [("buffered", 1.0), ("ragged", None)])
def test_the_layer_resolves_its_backend_once_when_built(monkeypatch, impl, cf):
  calls = []
  resolve = grouped_matmul.resolve_backend
  monkeypatch.setattr(grouped_matmul, "resolve_backend",
                      lambda *a, **kw: calls.append(a) or resolve(*a, **kw))
  layer, _ = _layer_pair(impl, cf)
  assert layer.path.grouped_backend in grouped_matmul.RESOLVED
  assert len(calls) == 1
  for t in (8, 12):  # two traces of the forward (shapes only, nothing compiled)
    nnx.eval_shape(lambda m, x: m(x, deterministic=True), layer,
                   jax.ShapeDtypeStruct((2, t, layer.config.d_model), jnp.float32))
  assert len(calls) == 1


def test_backend_choices_and_errors():
  assert grouped_matmul.resolve_backend("auto", ragged=False) == "einsum"
  assert grouped_matmul.resolve_backend("auto", ragged=True) == "xla"
  assert grouped_matmul.resolve_backend("auto", ragged=True, pallas_widths=(32, 16)) == (
      "xla" if platform.interprets("gmm") else "pallas")
  with pytest.raises(ValueError, match="needs the capacity layout"):
    grouped_matmul.resolve_backend("einsum", ragged=True)
  with pytest.raises(ValueError, match="backend='cutlass'"):
    grouped_matmul.resolve_backend("cutlass", ragged=True)
  if not grouped_matmul.tokamax_available():
    with pytest.raises(ValueError, match="tokamax is not installed"):
      grouped_matmul.resolve_backend("tokamax", ragged=True)
  with pytest.raises(ValueError, match="grouped_backend='xla' is for impl='ragged'"):
    _layer_pair("buffered", 1.0, grouped_backend="xla")
  with pytest.raises(ValueError, match="no buffers"):
    _layer_pair("ragged", None, grouped_backend="einsum")
  with pytest.raises(ValueError, match="grouped_backend='fast'"):
    _layer_pair("ragged", None, grouped_backend="fast")
  with pytest.raises(ValueError, match="expert_hidden=20 must be a multiple of 16"):
    _layer_pair("ragged", None, grouped_backend="pallas", d_model=32)
  with pytest.raises(ValueError, match="is not resolved.*resolve_backend"):
    grouped_matmul.grouped_swiglu(jnp.zeros((4, 16)), *(jnp.zeros((2, 16, 16)),) * 3,
                                  group_sizes=jnp.ones(2, jnp.int32), capacity=None,
                                  backend="auto")
  with pytest.raises(ValueError, match="dispatched rows"):
    grouped_matmul.grouped_swiglu(jnp.zeros((4, 16)), *(jnp.zeros((2, 16, 16)),) * 3,
                                  group_sizes=jnp.ones(2, jnp.int32), capacity=None,
                                  backend="pallas")


@pytest.mark.gpu
@pytest.mark.parametrize("impl, cf, backend", [("buffered", 1.25, "auto"),
                                               ("ragged", None, "xla"),
                                               ("ragged", None, "tokamax"),
                                               ("ragged", None, "pallas"),
                                               ("buffered", 1.25, "pallas")])
def test_grouped_modes_match_dense_at_scale_on_gpu(impl, cf, backend):
  if backend == "tokamax" and not grouped_matmul.tokamax_available():
    pytest.skip("tokamax is not installed")
  layer, dense = _layer_pair(impl, cf, d_model=256, num_experts=16, top_k=2,
                             expert_hidden=128, grouped_backend=backend, dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.key(5), (4, 1024, 256))
  ct = jax.random.normal(jax.random.key(6), x.shape)
  (_, _), (g, dx) = _value_and_grads(layer, x, ct)
  (_, _), (g_ref, dx_ref) = _value_and_grads(dense, x, ct)
  scale = float(jnp.abs(dx_ref).max())
  np.testing.assert_allclose(np.asarray(dx) / scale, np.asarray(dx_ref) / scale, atol=3e-2)
  ref = dict(nnx.to_flat_state(nnx.state(g_ref, nnx.Param)))
  for path, var in nnx.to_flat_state(nnx.state(g, nnx.Param)):
    want = np.asarray(ref[path].get_value())
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(var.get_value()) / scale, want / scale, atol=3e-2,
                               err_msg=f"gradient of {path}")
