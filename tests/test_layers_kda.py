"""KDA token-mixer layer (k3jax.layers.kda) against a float64 numpy reference."""
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3jax.layers import kda as kda_lib
from k3jax.layers.segments import Segments
from k3jax.models.config import ModelConfig
from pallas_kernels.kda.spec import KdaSpec

D, H, K, W = 16, 2, 8, 3
CHUNK, SUB = 8, 4
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 6e-2}


def _layer(gate="bounded", dtype=jnp.float32, implementation="xla", seed=0,
           decode_implementation="auto", fuse_gate=False):
  bounded = gate == "bounded"
  spec = KdaSpec(chunk_size=CHUNK, sub_chunk=SUB, diagonal="dense" if bounded else "pairwise",
                 lower_bound=-5.0 if bounded else None, implementation=implementation)
  return kda_lib.KDA(D, H, K, spec=spec, conv_size=W, decode_implementation=decode_implementation, fuse_gate=fuse_gate,
                     dtype=dtype, rngs=nnx.Rngs(seed))


def _x(b, t, seed=1):
  return np.random.default_rng(seed).standard_normal((b, t, D)).astype(np.float32)


def _sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def _reference(layer, x):
  """The whole layer in float64 numpy, with the token-by-token delta rule."""
  p = {n: np.asarray(v[...], np.float64) for n, v in nnx.state(layer, nnx.Param).items()}
  x = x.astype(np.float64)
  b, t, _ = x.shape

  def conv_silu(xp, w):
    pad = np.concatenate([np.zeros((b, W - 1) + xp.shape[2:]), xp], axis=1)
    y = sum(w[j] * pad[:, j:j + t] for j in range(W))
    return y * _sigmoid(y)

  def l2(a):
    return a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)

  q = l2(conv_silu(np.einsum("btd,dhk->bthk", x, p["wq"]), p["conv_q"]))
  k = l2(conv_silu(np.einsum("btd,dhk->bthk", x, p["wk"]), p["conv_k"]))
  v = conv_silu(np.einsum("btd,dhk->bthk", x, p["wv"]), p["conv_v"])
  z = np.einsum("btr,rhk->bthk", x @ p["wf_a"], p["wf_b"])
  if layer.bounded:
    g = layer.spec.lower_bound * _sigmoid(z + p["f_bias"])
  else:
    g = -np.exp(p["a_log"])[:, None] * np.log1p(np.exp(z + p["f_bias"]))
  beta = _sigmoid(np.einsum("btd,dh->bth", x, p["wb"]))
  o = np.zeros((b, t, H, K))
  for bi in range(b):
    for h in range(H):
      s = np.zeros((K, K))
      for ti in range(t):
        s = s * np.exp(g[bi, ti, h])[:, None]
        kt = k[bi, ti, h]
        s = s + beta[bi, ti, h] * np.outer(kt, v[bi, ti, h] - s.T @ kt)
        o[bi, ti, h] = s.T @ (q[bi, ti, h] * K ** -0.5)
  og = _sigmoid(np.einsum("btd,dhk->bthk", x, p["w_og"]))
  o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + 1e-6) * p["o_norm"] * og
  return np.einsum("bthk,hkd->btd", o, p["wo"]), g


def _forward(layer, x):
  return nnx.jit(lambda m, x: m(x))(layer, x)


def _conv_loop(x, w, run_bt=None):
  """The causal depthwise conv in float64, tap by tap; with run_bt [B, T] a tap adds
  only when it reads a position of t's own run."""
  width, (batch, length) = w.shape[0], x.shape[:2]
  run = np.zeros((batch, length), int) if run_bt is None else np.asarray(run_bt)
  want = np.zeros(x.shape, np.float64)
  for b in range(batch):
    for t in range(length):
      for j in range(width):
        src = t - (width - 1) + j
        if src >= 0 and run[b, src] == run[b, t]:
          want[b, t] += w[j].astype(np.float64) * x[b, src]
  return want


def test_causal_depthwise_conv_matches_loop():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 7, H, K)).astype(np.float32)
  w = rng.standard_normal((4, H, K)).astype(np.float32)
  got = jax.jit(kda_lib.causal_depthwise_conv)(x, w)
  np.testing.assert_allclose(got, _conv_loop(x, w), rtol=1e-5, atol=1e-5)


def _masked_taps_conv(x, w, run_bt):
  """The conv with every tap masked where it leaves its run: tap j of t reads
  t - (W - 1) + j only when that position lies in t's run."""
  width, t = w.shape[0], x.shape[1]
  y = jnp.zeros_like(x)
  for j in range(width):
    src = jnp.arange(t) - (width - 1) + j
    ok = (src >= 0)[None] & (run_bt[:, jnp.clip(src, 0)] == run_bt)
    tap = jnp.where(src[None, :, None, None] >= 0, x[:, jnp.clip(src, 0)], 0.0)
    y = y + jnp.where(ok[..., None, None], tap, 0.0) * w[j]
  return y


@pytest.mark.parametrize("max_segments", [None, 4])
def test_causal_depthwise_conv_restarts_at_every_run(max_segments):
  """With `offsets_bm` each run's outputs are the run's own conv, zeros before its start:
  runs shorter than W - 1, a padding run, a row of one run, and with M = 4 a row whose
  runs past the fourth merge (no restart inside the merged run). Values against a float64
  loop, gradients (x and w) against the conv with every tap masked."""
  width = 4
  ids = np.array([[1, 1, 1, 1, 1, 2, 3, 3, 4, 4, 4, 4, 4, 0, 0, 0],
                  [7] * 16], np.int32)
  seg = Segments.from_ids(ids, max_segments)
  rng = np.random.default_rng(3)
  x = rng.standard_normal((2, 16, H, K)).astype(np.float32)
  w = rng.standard_normal((width, H, K)).astype(np.float32)
  want = _conv_loop(x, w, seg.run_bt)
  conv = jax.jit(kda_lib.causal_depthwise_conv)
  got, plain = conv(x, w, seg.offsets_bm), np.asarray(conv(x, w))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  if max_segments == 4:  # run 3 spans the merged tail: position 13 reads 12
    assert abs(want[0, 13] - plain[0, 13]).max() < 1e-5
  assert np.abs(np.asarray(got) - plain).max() > 0.1  # the restarts matter
  ct = rng.standard_normal(x.shape).astype(np.float32)
  grads = jax.grad(lambda x, w: jnp.sum(ct * kda_lib.causal_depthwise_conv(x, w, seg.offsets_bm)),
                   argnums=(0, 1))(x, w)
  want_grads = jax.grad(lambda x, w: jnp.sum(ct * _masked_taps_conv(x, w, seg.run_bt)),
                        argnums=(0, 1))(x, w)
  for g, r in zip(grads, want_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_causal_depthwise_conv_restarts_keep_rows_on_their_devices():
  """Rows sharded over 8 devices: the restarts' gathers and scatters stay on each row's
  device (no all-gather), and the only all-reduce is the weight gradient's, as for the
  plain conv."""
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  rows = NamedSharding(mesh, PartitionSpec("data"))
  ids = np.repeat(np.arange(1, 5), 4)[None].repeat(8, 0).astype(np.int32)
  offsets = jax.device_put(Segments.from_ids(ids, 6).offsets_bm, rows)
  x = jax.device_put(jnp.ones((8, 16, H, K)), rows)
  w = jnp.ones((4, H, K))
  grad = jax.jit(jax.grad(lambda x, w: jnp.sum(kda_lib.causal_depthwise_conv(x, w, offsets) ** 2),
                          argnums=(0, 1)))
  hlo = grad.lower(x, w).compile().as_text()
  assert "all-gather" not in hlo
  reduced = re.findall(r"^\s*\S+ = (.*?) all-reduce(?:-start)?\(", hlo, re.M)
  assert reduced, "the weight gradient sums over the rows' devices"
  for shapes in reduced:
    assert set(re.findall(r"\[([\d,]*)\]", shapes)) <= {f"{H},{K}", f"4,{H},{K}"}, shapes


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_layer_matches_float64_reference(gate):
  layer = _layer(gate)
  x = _x(2, 19)  # not a multiple of the chunk
  y, stats = _forward(layer, x)
  chex.assert_shape(y, (2, 19, D))
  assert y.dtype == jnp.float32
  ref, g = _reference(layer, x)
  np.testing.assert_allclose(y, ref, rtol=TOL[jnp.float32], atol=TOL[jnp.float32] * np.abs(ref).max())
  np.testing.assert_allclose(stats["g_mean"], g.mean(), rtol=1e-5)
  np.testing.assert_allclose(stats["g_min"], g.min(), rtol=1e-5)
  if gate == "bounded":
    assert -5.0 < float(stats["g_min"]) and float(jnp.max(g)) < 0


def test_bfloat16_activations_stay_close_to_float32():
  x = _x(1, 13, seed=4)
  y32, _ = _forward(_layer(), x)
  y16, _ = _forward(_layer(dtype=jnp.bfloat16), x)
  assert y16.dtype == jnp.bfloat16
  scale = float(np.abs(y32).max())
  np.testing.assert_allclose(np.asarray(y16, np.float32), y32, rtol=0, atol=TOL[jnp.bfloat16] * scale)


@pytest.mark.parametrize("decode_implementation,tokens_per_step", [
    ("auto", 1), ("fused", 3), ("pallas", 1), ("pallas", 3), ("naive", 2)])
def test_decode_equals_full_pass(decode_implementation, tokens_per_step):
  """Prefill, then steps of 1 or a few tokens ("pallas" interpreted on the CPU)."""
  layer = _layer(decode_implementation=decode_implementation)
  x = _x(2, 16, seed=5)
  full, _ = _forward(layer, x)
  y0, _, cache = nnx.jit(lambda m, x: m.prefill(x))(layer, x[:, :10])  # crosses a chunk edge
  chex.assert_shape(cache["state"], (2, H, K, K))
  chex.assert_shape(cache["conv_q"], (2, W - 1, H, K))
  step = nnx.jit(lambda m, x, c: m.decode(x, c))
  outs = [y0]
  for t in range(10, 16, tokens_per_step):
    y, cache = step(layer, x[:, t:t + tokens_per_step], cache)
    outs.append(y)
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-5, atol=1e-5)
  assert cache["state"].dtype == jnp.float32


def test_decode_resolves_auto_by_tokens_and_states(monkeypatch):
  """The layer's decode resolves "auto" from the step's tokens, head width and B * H
  states, which pick the kernel for a single token only in a wide batch (resolved as
  on the GPU here)."""
  seen = []
  resolve = kda_lib.kda_decode.resolve_decode

  def on_the_gpu(implementation, t_new=None, head_k=None, platform=None, *, states=None):
    seen.append((t_new, head_k, states, resolve(implementation, t_new, head_k, "gpu", states=states)))
    return "fused"   # the CPU runs the fused step whatever the GPU would pick
  layer = _layer()
  monkeypatch.setattr(kda_lib.kda_decode, "resolve_decode", on_the_gpu)
  wide_b = kda_lib.kda_decode.MIN_KERNEL_STATES_ONE_TOKEN // H
  for b, t_new in ((2, 1), (wide_b, 1), (2, 2)):
    layer.decode(_x(b, t_new, seed=8), layer.init_cache(b))
  assert seen == [(1, K, 2 * H, "fused"), (1, K, wide_b * H, "pallas"), (2, K, 2 * H, "pallas")]


def test_short_prompt_and_empty_cache_decode():
  """A prompt shorter than the conv window, and decoding from init_cache."""
  layer = _layer()
  x = _x(1, 4, seed=6)
  full, _ = _forward(layer, x)
  step = nnx.jit(lambda m, x, c: m.decode(x, c))
  cache = layer.init_cache(1)
  outs = []
  for t in range(4):
    y, cache = step(layer, x[:, t:t + 1], cache)
    outs.append(y)
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-5, atol=1e-5)


def test_gradients_are_finite_and_nonzero():
  layer = _layer()
  x = _x(1, 11, seed=7)
  grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0] ** 2)))(layer, x)
  for name, g in nnx.to_flat_state(grads):
    g = np.asarray(g[...])
    assert np.all(np.isfinite(g)), name
    assert np.abs(g).max() > 0, name


def test_bad_configs():
  with pytest.raises(ValueError, match="use diagonal='pairwise' for an unbounded gate"):
    kda_lib.KDA(D, H, K, spec=KdaSpec(diagonal="dense"), rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="spec must be a KdaSpec"):
    kda_lib.KDA(D, H, K, spec={"lower_bound": -5.0}, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"\[B, T, 16\]"):
    _layer()(np.zeros((2, 3), np.float32))
  with pytest.raises(ValueError, match="decode implementation must be 'auto' or one of"):
    _layer(decode_implementation="scan")
  layer = _layer()
  with pytest.raises(ValueError, match="decode takes 1 to 16 tokens .* got shape \\(1, 17, 16\\)"):
    layer.decode(np.zeros((1, 17, D), np.float32), layer.init_cache(1))


def test_fused_gate_is_opt_in_and_bounded_only():
  """Off unless asked (not yet timed on a GPU); the softplus gate cannot be fused: the model
  config refuses the pair, naming the fix, and a layer built directly fails at its first call."""
  assert not _layer(implementation="pallas").fuse_gate
  assert _layer(implementation="pallas", fuse_gate=True).fuse_gate
  with pytest.raises(ValueError, match="^kda_fuse_gate=True needs the bounded gate.*set "
                                       "kda_fuse_gate=False or a kda.lower_bound"):
    ModelConfig(kda=KdaSpec(diagonal="pairwise"), kda_fuse_gate=True)
  layer = kda_lib.KDA(D, H, K, spec=KdaSpec(diagonal="pairwise"), fuse_gate=True,
                      rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="bounded gate needs a spec with a lower_bound"):
    layer(np.zeros((1, 4, D), np.float32))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_fused_gate_layer_equals_unfused(implementation):
  """Same parameters: outputs, stats and every parameter gradient agree fused vs unfused."""
  x = _x(2, 19, seed=8)  # not a multiple of the chunk
  # The Pallas kernels need K and C >= 16 (tensor-core tiles).
  k, chunk, sub = (K, CHUNK, SUB) if implementation == "xla" else (16, 16, 16)
  spec = KdaSpec(chunk_size=chunk, sub_chunk=sub, lower_bound=-5.0, implementation=implementation)
  layers = [kda_lib.KDA(D, H, k, spec=spec, conv_size=W, fuse_gate=fuse, rngs=nnx.Rngs(3))
            for fuse in (True, False)]

  def run(layer):
    def loss(m, x):
      y, stats = m(x)
      return jnp.sum(y * jnp.cos(y)), (y, stats)
    return nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer, x)

  (_, (y_f, s_f)), g_f = run(layers[0])
  (_, (y_u, s_u)), g_u = run(layers[1])
  scale = float(np.abs(y_u).max())
  np.testing.assert_allclose(y_f, y_u, rtol=0, atol=1e-5 * scale)
  for name in ("g_mean", "g_min"):
    np.testing.assert_allclose(s_f[name], s_u[name], rtol=1e-6)
  flat_u = dict(nnx.to_flat_state(g_u))
  for name, gf in nnx.to_flat_state(g_f):
    gf, gu = np.asarray(gf[...]), np.asarray(flat_u[name][...])
    assert np.abs(gu).max() > 0, name
    np.testing.assert_allclose(gf, gu, rtol=0, atol=2e-5 * np.abs(gu).max(), err_msg=str(name))
  if implementation == "xla":  # and both equal the float64 layer
    ref, _ = _reference(layers[0], x)
    np.testing.assert_allclose(y_f, ref, rtol=TOL[jnp.float32],
                               atol=TOL[jnp.float32] * np.abs(ref).max())
