"""Routers: balance on skewed scores, weights, capacity, purity, gradients, causality."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import routing
from k3jax.routing import capacity as capacity_lib
from k3jax.routing import probe
from k3jax.routing import quantiles
from k3jax.routing import selection
from k3jax.routing import synthetic

ALL = ("quantile", "quantile_lagged", "bias_sign", "aux_loss", "expert_choice", "topk")


def _cfg(name, **kw):
  return routing.RouterConfig(name=name, **kw)


@functools.lru_cache(maxsize=None)
def _jitted_route(config, k):
  return jax.jit(lambda s, st: routing.route(s, k=k, config=config, state=st))


def _warm_state(config, k, num_experts, num_tokens, steps=3, seed=100):
  state = routing.init_router_state(num_experts, config)
  fn = _jitted_route(config, k)
  for i in range(steps):
    scores = synthetic.skewed_scores(jax.random.key(seed + i), num_tokens, num_experts)
    state = fn(scores, state)[3]
  return state


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs, match", [
    (dict(name="nope"), "name"),
    (dict(quantile_impl="approx"), "quantile_impl"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(name="expert_choice", capacity_factor=None), "capacity_factor"),
    (dict(num_bins=1), "num_bins"),
    (dict(bias_update_rate=-1.0), "bias_update_rate"),
    (dict(overflow_choices=-2), "overflow_choices"),
])
def test_config_rejects_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    routing.RouterConfig(**kwargs)


def test_route_rejects_bad_inputs():
  cfg = _cfg("quantile")
  with pytest.raises(ValueError, match="shape"):
    routing.route(jnp.zeros((4, 3, 2)), k=1, config=cfg)
  with pytest.raises(ValueError, match="k="):
    routing.route(jnp.zeros((4, 3)), k=4, config=cfg)
  with pytest.raises(ValueError, match="floating"):
    routing.route(jnp.zeros((4, 3), jnp.int32), k=1, config=cfg)
  with pytest.raises(ValueError, match="state"):
    routing.route(jnp.zeros((4, 3)), k=1, config=_cfg("bias_sign"), state=None)


# ---------------------------------------------------------------- quantiles

@pytest.mark.parametrize("num_tokens, num_experts, count, num_bins", [
    (16384, 64, 2048, 1000), (1000, 7, 1, 50), (513, 5, 513, 10), (4096, 33, 300, 64)])
def test_histogram_threshold_within_one_bin_of_exact(num_tokens, num_experts, count, num_bins):
  v = jax.random.normal(jax.random.key(count), (num_tokens, num_experts)) * 3.0 + 1.0
  exact = jax.jit(quantiles.column_threshold_exact, static_argnums=1)(v, count)
  approx = jax.jit(quantiles.column_threshold_histogram, static_argnums=(1, 2))(
      v, count, num_bins)
  width = (v.max(0) - v.min(0)) / num_bins
  vn = np.asarray(v)
  # The exact threshold has exactly `count` values at or above it (continuous data).
  np.testing.assert_array_equal((vn >= np.asarray(exact)[None]).sum(0), count)
  assert np.all(np.abs(np.asarray(approx - exact)) <= np.asarray(width) * (1 + 1e-4))


@pytest.mark.parametrize("num_tokens, num_experts, count, values", [
    (4096, 16, 512, "sigmoid"), (1000, 7, 1, "normal"), (513, 5, 513, "normal"),
    (2048, 33, 300, "ties"), (64, 3, 17, "signed_zeros")])
def test_radix_threshold_equals_exact(num_tokens, num_experts, count, values):
  """The radix select returns the top_k threshold bit for bit: sigmoid scores,
  signed values (the lagged router's s - alpha), heavy ties, count 1 and T."""
  v = jax.random.normal(jax.random.key(count), (num_tokens, num_experts)) * 3.0
  if values == "sigmoid":
    v = jax.nn.sigmoid(v)
  elif values == "ties":
    v = jnp.round(v)
  elif values == "signed_zeros":
    v = jnp.where(jnp.abs(v) >= 2, v, jnp.where(v > 0, 0.0, -0.0))
  exact = jax.jit(quantiles.column_threshold_exact, static_argnums=1)(v, count)
  radix = jax.jit(quantiles.column_threshold_radix, static_argnums=1)(v, count)
  np.testing.assert_array_equal(np.asarray(radix), np.asarray(exact))
  # and it is a real order statistic: at least `count` values at or above it, fewer above.
  vn = np.asarray(v)
  assert np.all((vn >= np.asarray(radix)[None]).sum(0) >= count)
  assert np.all((vn > np.asarray(radix)[None]).sum(0) < count)


@pytest.mark.parametrize("num_experts, m", [(1, 1), (8, 8), (16, 4), (32, 3), (33, 5), (64, 9)])
@pytest.mark.parametrize("values", ["normal", "ties", "signed_zeros"])
def test_top_k_equals_lax_top_k(num_experts, m, values):
  """selection.top_k (pairwise ranks for few experts) returns lax.top_k's values and
  ids, tie order and -0.0 < 0.0 included."""
  v = jax.random.normal(jax.random.key(num_experts * m), (257, num_experts))
  if values == "ties":
    v = jnp.round(v * 2)
  elif values == "signed_zeros":
    v = jnp.where(jnp.abs(v) >= 1, v, jnp.where(v > 0, 0.0, -0.0))
  want_v, want_i = jax.lax.top_k(v, m)
  got_v, got_i = jax.jit(selection.top_k, static_argnums=1)(v, m)
  np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
  np.testing.assert_array_equal(np.signbit(got_v), np.signbit(want_v))
  np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
  assert got_i.dtype == jnp.int32


# ---------------------------------------------------------------- capacity

def _greedy_reference(cand, k, num_experts, cap):
  cnt = np.zeros(num_experts, int)
  filled = np.zeros(len(cand), int)
  out = cand[:, :k].copy()
  for j in range(cand.shape[1]):
    for t in range(len(cand)):
      e = cand[t, j]
      if filled[t] < k and cnt[e] < cap:
        out[t, filled[t]] = e
        filled[t] += 1
        cnt[e] += 1
  return out, np.arange(k)[None] < filled[:, None]


@pytest.mark.parametrize("positions", ["sort", "count"])
@pytest.mark.parametrize("seed", range(3))
def test_capacity_assignment_matches_greedy_loop(seed, positions):
  rng = np.random.default_rng(seed)
  num_tokens, num_experts, k = 97, 9, 3
  num_cand = int(rng.integers(k, num_experts + 1))
  cap = int(rng.integers(5, 40))
  cand = np.stack([rng.permutation(num_experts)[:num_cand] for _ in range(num_tokens)])
  idx, kept = capacity_lib.assign_with_capacity(
      jnp.asarray(cand), k=k, num_experts=num_experts, capacity=cap, positions=positions)
  ref_idx, ref_kept = _greedy_reference(cand, k, num_experts, cap)
  np.testing.assert_array_equal(np.asarray(kept), ref_kept)
  np.testing.assert_array_equal(np.where(ref_kept, np.asarray(idx), -1),
                                np.where(ref_kept, ref_idx, -1))


# The numbers the four former copies of the formula gave (router capacity,
# quantile balanced count, expert-parallel slots per device pair and rows per
# local expert), including clipping to [1, at_most] and float rounding.
@pytest.mark.parametrize("args, want", [
    ((64, 8, 2, 1.25), 20),      # ceil(1.25 * 128 / 8), exact
    ((10, 3, 2, 1.0), 7),        # ceil(6.67) rounds up
    ((7, 16, 1, 1.0), 1),        # below one slot: at least 1
    ((4, 2, 2, 3.0), 4),         # above T: at most T
    ((25, 5, 2, 1.1), 12),       # 1.1 * 50 / 5 is 11.000000000000002 in floats: the factor
                                 # multiplies first, as it always has
    ((100, 8, 2, None), None),   # dropless
])
def test_expert_capacity_keeps_its_numbers(args, want):
  assert capacity_lib.expert_capacity(*args) == want


def test_quantile_balanced_count_is_the_capacity_at_factor_one():
  from k3jax.routing import quantile  # pylint: disable=g-import-not-at-top
  assert [quantile.balanced_count(t, e, k) for t, e, k in ((5, 8, 2), (16384, 64, 8), (1, 64, 8))] \
      == [2, 2048, 1]


@pytest.mark.parametrize("args, want", [
    ((8, 2, 8, 1.0), 2), ((8, 2, 8, None), 16), ((8, 2, 4, 0.25), 1), ((3, 2, 4, 10.0), 6),
    ((64, 2, 8, 1.25), 20),
])
def test_dispatch_slots_keep_their_numbers(args, want):
  assert capacity_lib.dispatch_slots(*args) == want


@pytest.mark.parametrize("args, want", [((16, 2, 1.0), 8), ((16, 3, 1.25), 7), ((5, 8, 1.0), 1),
                                        ((4, 1, 2.0), 4)])
def test_local_expert_capacity_keeps_its_numbers(args, want):
  assert capacity_lib.local_expert_capacity(*args) == want


@pytest.mark.parametrize("capacity, align, stride", [(20, 1, 20), (20, 16, 32), (16, 16, 16),
                                                     (1, 8, 8)])
def test_aligned_capacity_layout_rounds_each_group_up(capacity, align, stride):
  from k3jax.layers import moe_dispatch  # pylint: disable=g-import-not-at-top
  group_nk = jnp.zeros((4, 2), jnp.int32).at[:, 1].set(2)
  plan = moe_dispatch.plan_slots(group_nk, jnp.ones((4, 2), bool), 3, capacity, align=align)
  assert plan.num_slots == 3 * stride
  np.testing.assert_array_equal(np.asarray(plan.group_starts), [0, stride, 2 * stride])


# ---------------------------------------------------------------- balance

T_BAL, E_BAL, K_BAL = 16384, 64, 8


def _max_vio_over_batches(config, steps, first_seed=0):
  state = routing.init_router_state(E_BAL, config)
  fn = _jitted_route(config, K_BAL)
  out = []
  for i in range(steps):
    scores = synthetic.skewed_scores(jax.random.key(first_seed + i), T_BAL, E_BAL)
    _, _, stats, state = fn(scores, state)
    out.append((float(stats["max_vio"]), float(stats["drop_fraction"])))
  return out


@pytest.mark.parametrize("impl", ["exact", "radix", "histogram"])
def test_quantile_balances_skewed_batches(impl):
  vios = _max_vio_over_batches(_cfg("quantile", capacity_factor=1.0, quantile_impl=impl), 2)
  plain = _max_vio_over_batches(_cfg("topk", capacity_factor=None), 1)
  assert plain[0][0] > 2.0, plain  # the benchmark really is skewed
  for max_vio, drop in vios:
    assert max_vio <= 0.05, vios
    assert drop <= 0.01, vios


@pytest.mark.parametrize("impl", ["exact", "histogram"])
def test_lagged_quantile_balances_after_a_few_batches(impl):
  vios = _max_vio_over_batches(
      _cfg("quantile_lagged", capacity_factor=None, quantile_impl=impl), 6)
  assert vios[0][0] > 2.0  # zero bias at the start: plain top-k
  for max_vio, drop in vios[3:]:
    assert max_vio <= 0.10, vios
    assert drop == 0.0


def test_bias_sign_moves_bias_against_load():
  cfg = _cfg("bias_sign", capacity_factor=None, bias_update_rate=1e-3)
  scores = synthetic.skewed_scores(jax.random.key(0), 4096, 16, num_hot=2)
  state = routing.init_router_state(16, cfg)
  idx, _, stats, new = _jitted_route(cfg, 2)(scores, state)
  load = np.bincount(np.asarray(idx).ravel(), minlength=16)
  expect = 1e-3 * np.sign(load.mean() - load)
  np.testing.assert_allclose(np.asarray(new["bias"]), expect, atol=1e-7)
  assert float(stats["max_vio"]) > 1.0


def test_aux_loss_value_and_gradient():
  cfg = _cfg("aux_loss", aux_loss_coef=0.01, capacity_factor=None)
  num_experts = 8
  uniform = jnp.full((64, num_experts), 0.5)
  # One expert per token in turn: f_e = P_e = 1/E, loss = coef.
  scores = uniform + 0.1 * jax.nn.one_hot(jnp.arange(64) % num_experts, num_experts)
  loss = _jitted_route(cfg, 1)(scores, None)[2]["aux_loss"]
  p = np.asarray(scores / scores.sum(1, keepdims=True)).mean(0)
  np.testing.assert_allclose(float(loss), 0.01 * num_experts * np.sum(p / num_experts), rtol=1e-5)
  skew = synthetic.skewed_scores(jax.random.key(1), 512, num_experts, num_hot=1)
  g = jax.jit(jax.grad(lambda s: routing.route(s, k=2, config=cfg)[2]["aux_loss"]))(skew)
  assert float(jnp.abs(g).max()) > 0


# ---------------------------------------------------------------- weights and capacity invariants

@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("cf", [None, 0.6])
def test_weights_are_renormalised_unbiased_scores_of_kept_experts(name, cf):
  if name == "expert_choice" and cf is None:
    pytest.skip("expert choice needs a capacity")
  num_tokens, num_experts, k = 512, 16, 3
  cfg = _cfg(name, capacity_factor=cf)
  scores = synthetic.skewed_scores(jax.random.key(7), num_tokens, num_experts, num_hot=2)
  state = _warm_state(cfg, k, num_experts, num_tokens) if cfg.stateful else None
  idx, w, stats, _ = _jitted_route(cfg, k)(scores, state)
  chex.assert_shape((idx, w), (num_tokens, k))
  assert idx.dtype == jnp.int32 and w.dtype == jnp.float32
  idx, w, s = np.asarray(idx), np.asarray(w), np.asarray(scores, np.float64)
  kept = w > 0
  picked = np.take_along_axis(s, idx, 1) * kept
  denom = picked.sum(1, keepdims=True)
  ref = np.where(denom > 0, picked / np.where(denom > 0, denom, 1), 0)
  np.testing.assert_allclose(w, ref, rtol=1e-5, atol=1e-7)
  for t in range(num_tokens):  # no expert twice among a token's kept slots
    assert len(set(idx[t][kept[t]])) == kept[t].sum()
  load = np.bincount(idx[kept], minlength=num_experts)
  np.testing.assert_array_equal(np.asarray(stats["load"]), load)
  np.testing.assert_allclose(float(stats["max_vio"]), load.max() / load.mean() - 1, rtol=1e-5)
  np.testing.assert_allclose(float(stats["drop_fraction"]), 1 - kept.mean(), atol=1e-6)
  np.testing.assert_allclose(float(stats["load_cv"]), load.std() / load.mean(), rtol=1e-4)
  cap = capacity_lib.expert_capacity(num_tokens, num_experts, k, cf)
  if cap is None:
    assert kept.all()
  else:
    assert load.max() <= cap
    if cf < 1 and name != "expert_choice":
      assert (~kept).any()  # 0.6 capacity must drop


# ---------------------------------------------------------------- purity

@pytest.mark.parametrize("name", ALL)
def test_jit_once_per_shape_and_deterministic(name):
  cfg = _cfg(name, quantile_impl="histogram", num_bins=64)
  num_experts, k = 16, 2
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def fn(s, st):
    return routing.route(s, k=k, config=cfg, state=st)

  state = routing.init_router_state(num_experts, cfg)
  outs = []
  for seed in (0, 1, 1):
    scores = synthetic.skewed_scores(jax.random.key(seed), 256, num_experts)
    outs.append(fn(scores, state))
  chex.assert_trees_all_equal(outs[1], outs[2])
  assert not np.array_equal(np.asarray(outs[0][0]), np.asarray(outs[1][0]))


@pytest.mark.parametrize("name", ALL)
def test_gradient_flows_only_through_combine_weights(name):
  num_tokens, num_experts, k = 256, 8, 2
  cfg = _cfg(name, capacity_factor=0.8)
  scores = synthetic.skewed_scores(jax.random.key(3), num_tokens, num_experts, num_hot=1)
  state = _warm_state(cfg, k, num_experts, num_tokens) if cfg.stateful else None
  c = jax.random.normal(jax.random.key(4), (num_tokens, k))
  idx, w, _, _ = _jitted_route(cfg, k)(scores, state)
  kept = w > 0

  def through_router(s, st):
    return jnp.sum(routing.route(s, k=k, config=cfg, state=st)[1] * c)

  def fixed_choice(s):  # the same weights with the selection held fixed
    picked = jnp.where(kept, jnp.take_along_axis(s, idx, 1), 0.0)
    return jnp.sum(picked / jnp.sum(picked, 1, keepdims=True) * c)

  g_s, g_state = jax.jit(jax.grad(through_router, argnums=(0, 1)))(scores, state)
  np.testing.assert_allclose(np.asarray(g_s), np.asarray(jax.jit(jax.grad(fixed_choice))(scores)),
                             rtol=1e-5, atol=1e-7)
  assert float(jnp.abs(g_s).max()) > 0
  if state is not None:
    assert float(jnp.abs(g_state["bias"]).max()) == 0.0
    g_new = jax.jit(jax.grad(lambda s: jnp.sum(
        routing.route(s, k=k, config=cfg, state=state)[3]["bias"])))(scores)
    assert float(jnp.abs(g_new).max()) == 0.0


# ---------------------------------------------------------------- causality

def _probe(name, cf, seed=0):
  b, s, e, k, t = 4, 256, 16, 2, 100
  cfg = _cfg(name, capacity_factor=cf)
  key0, key1 = jax.random.split(jax.random.key(seed))
  scores = synthetic.skewed_scores(key0, b * s, e, num_hot=2).reshape(b, s, e)
  future = synthetic.skewed_scores(key1, s - t - 1, e, num_hot=2)
  state = _warm_state(cfg, k, e, b * s) if cfg.stateful else None
  return probe.routing_causality_probe(scores, future, t=t, k=k, config=cfg, state=state)


def test_lagged_quantile_is_causal():
  result = _probe("quantile_lagged", None)
  assert result["causal"], result
  assert result["changed_fraction"] == 0.0


def test_probe_detects_same_batch_leak():
  # The same-batch quantile threshold moves with future tokens: the probe sees it.
  result = _probe("quantile", None)
  assert not result["causal"], result


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("cf", [None, 1.0])
def test_causality_probe_report(name, cf):
  """A finding, not a requirement: printed for docs/routers.md."""
  if name == "expert_choice" and cf is None:
    pytest.skip("expert choice needs a capacity")
  result = _probe(name, cf)
  print(f"causality {name} cf={cf}: {result}")
  assert 0.0 <= result["changed_fraction"] <= 1.0


def test_reassigned_fraction_counts_moves_off_the_preferred_top_k():
  num_tokens, num_experts, k = 512, 16, 3
  cfg = _cfg("topk", capacity_factor=0.9)
  scores = synthetic.skewed_scores(jax.random.key(9), num_tokens, num_experts, num_hot=2)
  idx, w, stats, _ = _jitted_route(cfg, k)(scores, None)
  preferred = np.argsort(-np.asarray(scores), axis=1)[:, :k]
  idx, kept = np.asarray(idx), np.asarray(w) > 0
  moved = kept & ~(idx[:, :, None] == preferred[:, None, :]).any(-1)
  assert moved.any()
  np.testing.assert_allclose(float(stats["reassigned_fraction"]), moved.mean(), atol=1e-6)


def test_quantile_with_one_token_falls_back_to_top_k():
  # T k <= E: every shifted score is 0; ties must go to the higher raw score.
  cfg = _cfg("quantile", capacity_factor=1.0)
  scores = synthetic.skewed_scores(jax.random.key(12), 1, 16)
  idx, w, _, _ = _jitted_route(cfg, 2)(scores, None)
  expect = np.argsort(-np.asarray(scores[0]))[:2]
  assert set(np.asarray(idx[0])) == set(expect)
  assert (np.asarray(w) > 0).all()
