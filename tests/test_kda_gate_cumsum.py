"""The fused bounded-gate cumsum kernels (`kernel_gate_cumsum`) vs float64 references.

Run twice: in interpret mode on the CPU (small shapes; interpret mode fills
outputs with NaN first, so an unwritten element fails) and compiled by Triton
on the GPU (marker `gpu`, the benchmark shape B16 T2048 H16 K128).
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import kernel_gate_cumsum as kgc

LOWER_BOUND = -5.0


def _config(backend, chunk):
  return kernel_config.make_config(backend=backend, dtype=jnp.float32, head_k=16,
                                   head_v=16, chunk_size=chunk, sub_chunk=16)


def _inputs(seed, shape, raw_dtype, pad_rows=3):
  """raw N(0, 2^2) with some rows saturated (+-30: gates at 0 and at the bound) and the
  last `pad_rows` rows -inf (the op's padding); bias N(0, 1) [F]; dG N(0, 1) f32."""
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
  raw = 2.0 * jax.random.normal(k1, shape)
  sat = jax.random.bernoulli(k4, 0.1, shape)
  raw = jnp.where(sat, 30.0 * jnp.sign(raw), raw)
  raw = raw.at[:, shape[1] - pad_rows:].set(-jnp.inf).astype(raw_dtype)
  bias = jax.random.normal(k2, shape[-1:], jnp.float32)
  dg_cum = jax.random.normal(k3, shape, jnp.float32)
  return raw, bias, dg_cum


@contextlib.contextmanager
def _optimised_compile():
  """XLA's default optimisation level inside the block, whatever the suite's setting."""
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)


def _reference(raw, bias, dg_cum, chunk):
  """Float64: G, draw, dbias and the magnitudes that bound f32 summation errors."""
  r = np.asarray(raw.astype(jnp.float32), np.float64) + np.asarray(bias, np.float64)
  s = 1.0 / (1.0 + np.exp(-r))
  g = LOWER_BOUND * s
  b, tp, f = g.shape
  split = lambda x: x.reshape(b, tp // chunk, chunk, f)
  g_cum = np.cumsum(split(g), axis=2).reshape(g.shape)
  g_mass = np.broadcast_to(np.abs(split(g)).sum(2, keepdims=True), split(g).shape)
  d = split(np.asarray(dg_cum, np.float64))
  dg = np.flip(np.cumsum(np.flip(d, 2), axis=2), 2).reshape(g.shape)
  d_mass = np.broadcast_to(np.abs(d).sum(2, keepdims=True), d.shape).reshape(g.shape)
  slope = s / (1.0 + np.exp(r))  # s (1 - s) without the cancellation in 1 - s
  draw = dg * LOWER_BOUND * slope
  return dict(g_cum=g_cum, g_mass=g_mass.reshape(g.shape), draw=draw,
              draw_mass=d_mass * abs(LOWER_BOUND) * slope, dbias=draw.sum((0, 1)),
              dbias_mass=np.abs(draw).sum((0, 1)))


class GateCumsumChecks:
  """Checks shared by the interpret and GPU twins. Subclasses set the fields."""
  backend: str
  shape: tuple  # (B, Tp, F)
  chunk: int

  def _fns(self, backend=None):
    cfg = _config(backend or self.backend, self.chunk)
    fwd = jax.jit(functools.partial(kgc.gate_cumsum, lower_bound=LOWER_BOUND,
                                    chunk_size=self.chunk, cfg=cfg))
    bwd = jax.jit(functools.partial(kgc.gate_cumsum_bwd, lower_bound=LOWER_BOUND,
                                    chunk_size=self.chunk, cfg=cfg))
    return fwd, bwd

  @pytest.mark.parametrize("raw_dtype", [jnp.float32, jnp.bfloat16])
  def test_matches_float64_reference(self, raw_dtype):
    """G, draw and dbias within f32 summation bounds of the float64 forms."""
    raw, bias, dg_cum = _inputs(1, self.shape, raw_dtype)
    fwd, bwd = self._fns()
    g_cum = np.asarray(fwd(raw, bias), np.float64)
    draw, dbias = bwd(dg_cum, raw, bias)
    assert draw.dtype == raw_dtype and dbias.dtype == jnp.float32
    draw = np.asarray(draw.astype(jnp.float32), np.float64)
    ref = _reference(raw, bias, dg_cum, self.chunk)
    eps = np.finfo(np.float32).eps
    for name, got in (("g_cum", g_cum), ("draw", draw), ("dbias", np.asarray(dbias))):
      assert np.all(np.isfinite(got)), f"{name}: non-finite (unwritten?)"
    # Sums of C terms: (C - 1) eps |terms|; the reverse sum twice that; plus a
    # few roundings of the sigmoid and products per term.
    c = self.chunk
    assert np.all(np.abs(g_cum - ref["g_cum"]) <= (c + 8) * eps * ref["g_mass"] + 1e-30)
    # jnp.finfo: numpy's finfo knows bfloat16 only with a recent ml_dtypes (not the GPU image's).
    out_eps = float(jnp.finfo(raw_dtype).eps) if raw_dtype != jnp.float32 else 0.0
    draw_bound = (2 * c + 16) * eps * ref["draw_mass"] + out_eps * np.abs(ref["draw"])
    assert np.all(np.abs(draw - ref["draw"]) <= draw_bound + 1e-30)
    n_terms = self.shape[0] * self.shape[1]
    dbias_bound = (n_terms + 2 * c + 16) * eps * ref["dbias_mass"]
    assert np.all(np.abs(np.asarray(dbias, np.float64) - ref["dbias"]) <= dbias_bound)

  def test_padded_rows_are_zero_gates(self):
    """raw = -inf rows add nothing to G and get draw = 0 exactly.

    Compiled at XLA's default CPU optimisation level, which tests/conftest.py lowers for compile
    time: at level 0 (`--xla_backend_optimization_level=0`) the interpreted kernel's last padded
    row came out one ulp off in one element of 320, though the same rows' gates, jitted alone at
    level 0, are exactly zero. Not traced further; GPU and TPU runs compile optimised."""
    raw, bias, dg_cum = _inputs(2, self.shape, jnp.float32, pad_rows=5)
    fwd, bwd = self._fns()
    with _optimised_compile():
      g_cum = np.asarray(fwd(raw, bias))
      draw, _ = bwd(dg_cum, raw, bias)
    tp = self.shape[1]
    np.testing.assert_array_equal(g_cum[:, tp - 5:], np.repeat(g_cum[:, tp - 6:tp - 5], 5, 1))
    np.testing.assert_array_equal(np.asarray(draw)[:, tp - 5:], 0.0)


class TestGateCumsumInterpret(GateCumsumChecks):
  backend = "interpret"
  shape = (2, 64, 32)
  chunk = 32

  def test_tpu_backend_is_the_xla_form(self):
    raw, bias, dg_cum = _inputs(3, self.shape, jnp.bfloat16)
    fwd, bwd = self._fns("tpu_interpret")
    np.testing.assert_array_equal(
        np.asarray(fwd(raw, bias)),
        np.asarray(kgc.gate_cumsum_xla(raw, bias, LOWER_BOUND, self.chunk)))
    for got, want in zip(bwd(dg_cum, raw, bias),
                         kgc.gate_cumsum_bwd_xla(dg_cum, raw, bias, LOWER_BOUND, self.chunk)):
      np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                    np.asarray(want.astype(jnp.float32)))

  def test_block_f_does_not_change_results(self):
    raw, bias, dg_cum = _inputs(4, self.shape, jnp.float32)
    cfg = _config("interpret", self.chunk)
    outs = []
    for block_f in (8, None):
      outs.append((kgc.gate_cumsum(raw, bias, LOWER_BOUND, self.chunk, cfg=cfg, block_f=block_f),
                   *kgc.gate_cumsum_bwd(dg_cum, raw, bias, LOWER_BOUND, self.chunk, cfg=cfg,
                                        block_f=block_f)))
    # Same math per element; only dbias's summation order over rows may differ.
    eps = np.finfo(np.float32).eps
    for a, b in zip(outs[0][:2], outs[1][:2]):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rows = self.shape[0] * self.shape[1]
    np.testing.assert_allclose(np.asarray(outs[0][2]), np.asarray(outs[1][2]), rtol=0,
                               atol=rows * eps * float(jnp.max(jnp.abs(outs[1][2]))))

  @pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
  def test_lowers_for_triton(self):
    """Both kernels lower for CUDA on the CPU (an abstract H200 stands in)."""
    cfg = _config("triton", 64)

    def fn(raw, bias, dg_cum):
      g_cum = kgc.gate_cumsum(raw, bias, LOWER_BOUND, 64, cfg=cfg)
      return g_cum, kgc.gate_cumsum_bwd(dg_cum, raw, bias, LOWER_BOUND, 64, cfg=cfg)

    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                      platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)
    target = "__gpu$xla.gpu.triton"
    shape = (2, 128, 256)
    with jax.sharding.use_abstract_mesh(mesh):
      exported = jax.export.export(
          jax.jit(fn), platforms=["cuda"],
          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)],
      )(jax.ShapeDtypeStruct(shape, jnp.bfloat16), jax.ShapeDtypeStruct(shape[-1:], jnp.float32),
        jax.ShapeDtypeStruct(shape, jnp.float32))
    text = exported.mlir_module()
    assert 'name = "kda_gate_cumsum"' in text and 'name = "kda_gate_cumsum_bwd"' in text

  def test_rejects_bad_inputs(self):
    cfg = _config("interpret", 32)
    raw = jnp.zeros((1, 64, 32), jnp.bfloat16)
    bias = jnp.zeros((32,), jnp.float32)
    with pytest.raises(ValueError, match=r"bias_f must be \[F\] = \[32\] float32"):
      kgc.gate_cumsum(raw, jnp.zeros((16,), jnp.float32), LOWER_BOUND, 32, cfg=cfg)
    with pytest.raises(ValueError, match="lower_bound must be a negative python float"):
      kgc.gate_cumsum(raw, bias, 0.5, 32, cfg=cfg)
    with pytest.raises(ValueError, match="Tp=80 must be a multiple of chunk_size=32"):
      kgc.gate_cumsum(jnp.zeros((1, 80, 32)), bias, LOWER_BOUND, 32, cfg=cfg)
    with pytest.raises(ValueError, match="block_f must be a power of two dividing F=32, got 24"):
      kgc.gate_cumsum(raw, bias, LOWER_BOUND, 32, cfg=cfg, block_f=24)
    with pytest.raises(ValueError, match="dg_cum_btf must be float32 of raw's shape"):
      kgc.gate_cumsum_bwd(raw, raw, bias, LOWER_BOUND, 32, cfg=cfg)


@pytest.mark.gpu
class TestGateCumsumGpu(GateCumsumChecks):
  """The Triton kernels at the benchmark shape (B16 T2048 H16 K128)."""
  backend = "triton"
  shape = (16, 2048, 2048)
  chunk = 64
