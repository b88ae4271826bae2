"""Pallas within-chunk gate cumsum vs a float64 reference, forward and reverse,
and the clamped variant that `chunk_kda` runs on traced gates.

The checks live in a mixin run twice: in interpret mode on the CPU (small
shapes, CI) and compiled by Triton on the GPU (marker `gpu`, the benchmark
shape). Interpret mode fills kernel outputs with NaN before the kernel runs,
so an element the kernel fails to write shows up as a non-finite value.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import inputs
from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import kernel_cumsum
from pallas_kernels.kda.kernel_cumsum import chunk_cumsum
from pallas_kernels.kda.kernel_cumsum import chunk_cumsum_xla
from pallas_kernels.kda.kernel_cumsum import default_block_f

# Error-bound factor per direction: any summation order of C terms errs by at
# most (C - 1) eps sum|x|, and both directions are plain running sums (the
# kernels' reverse is a sequential suffix sum, XLA's a reverse cumsum).
BOUND_FACTOR = {False: 1.0, True: 1.0}


def _config(backend, chunk):
  return kernel_config.make_config(backend=backend, dtype=jnp.float32, head_k=16,
                                   head_v=16, chunk_size=chunk, sub_chunk=16)


def _gates(seed, shape, kind):
  """[B, Tp, F] f32: "decay" gates -5 sigmoid(N(0, 4)) in (-5, 0), or "mixed" N(0, 1)."""
  x = jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)
  if kind == "decay":
    return -5.0 * jax.nn.sigmoid(2.0 * x)
  return x


def _reference(g, chunk, reverse):
  """Float64 within-chunk (reverse) cumsum and per-column chunk sums of |g|."""
  g = np.asarray(g, np.float64)
  b, tp, f = g.shape
  x = g.reshape(b, tp // chunk, chunk, f)
  if reverse:
    out = np.flip(np.cumsum(np.flip(x, 2), axis=2), 2)
  else:
    out = np.cumsum(x, axis=2)
  mass = np.broadcast_to(np.abs(x).sum(axis=2, keepdims=True), x.shape)
  return out.reshape(b, tp, f), mass.reshape(b, tp, f)


def _assert_close(out, g, chunk, reverse, zeroed=None):
  """Every element finite and within the f32 summation bound of the reference
  (set to zero where `zeroed`, a [B, Tp, F] bool mask)."""
  out = np.asarray(out)
  assert out.dtype == np.float32 and out.shape == g.shape
  assert np.all(np.isfinite(out)), "non-finite values (unwritten output?)"
  ref, mass = _reference(g, chunk, reverse)
  if zeroed is not None:
    ref = np.where(zeroed, 0.0, ref)
  eps = np.finfo(out.dtype).eps
  err = np.abs(out.astype(np.float64) - ref)
  bound = BOUND_FACTOR[reverse] * chunk * eps * mass
  worst = np.max(err / np.maximum(bound, 1e-30))
  print(f"reverse={reverse} max abs err {err.max():.2e}, worst err/bound {worst:.3f}")
  assert np.all(err <= bound), f"max err/bound {worst:.3f}"


def _gates_out_of_range(seed, shape, chunk, lower_bound=-5.0):
  """Decay gates with a few entries below the bound or above 0, in one chunk of one
  F-block only, plus entries exactly at the bound (in range) elsewhere."""
  g = _gates(seed, shape, "decay")
  g = g.at[0, 3, 5].set(4 * lower_bound).at[0, 7, 6].set(0.5).at[0, 9, 5].set(jnp.inf)
  return g.at[-1, chunk + 1, -3].set(lower_bound).at[-1, chunk + 2, -2].set(0.0)


def _block_flags(g, chunk, block_f, lower_bound=-5.0):
  """[B, NC, F/BF] int32: 1 where the block holds an out-of-range gate (numpy)."""
  b, tp, f = g.shape
  out = np.asarray(inputs.out_of_range(g, lower_bound))
  return out.reshape(b, tp // chunk, chunk, f // block_f, block_f).any(axis=(2, 4)).astype(
      np.int32)


class CumsumChecks:
  """Checks shared by the interpret and GPU twins. Subclasses set the fields."""
  backend: str
  shape: tuple  # (B, Tp, F)
  chunk: int
  block_fs: tuple  # block_f values to run (None: the default)

  def _fn(self, chunk, reverse, block_f=None, backend=None):
    cfg = _config(backend or self.backend, chunk)
    return jax.jit(functools.partial(chunk_cumsum, chunk_size=chunk, reverse=reverse,
                                     cfg=cfg, block_f=block_f))

  @pytest.mark.parametrize("reverse", [False, True])
  @pytest.mark.parametrize("kind", ["decay", "mixed"])
  def test_matches_float64_reference(self, reverse, kind):
    g = _gates(1 + reverse, self.shape, kind)
    for block_f in self.block_fs:
      _assert_close(self._fn(self.chunk, reverse, block_f)(g), g, self.chunk, reverse)

  def test_clamped_equals_clamp_then_cumsum(self):
    """G is the cumsum of the clamped gates and dg the reverse cumsum of dG with the
    clamped entries (only) zeroed, each within the f32 summation bound of float64
    (the compiler may order the sums unlike the plain kernel's); G without the
    record is the same program's G; the flags mark exactly the blocks holding a
    clamped gate."""
    lb, c = -5.0, self.chunk
    g = _gates_out_of_range(7, self.shape, c)
    dg_cum = _gates(8, self.shape, "mixed")
    cfg = _config(self.backend, c)
    outside = np.asarray(inputs.out_of_range(g, lb))
    for block_f in self.block_fs:
      fwd = jax.jit(functools.partial(kernel_cumsum.clamped_cumsum, lower_bound=lb,
                                      chunk_size=c, cfg=cfg, block_f=block_f, with_record=True))
      g_cum, record = fwd(g)
      _assert_close(g_cum, inputs.clamp_gates(g, lb), c, reverse=False)
      no_record = kernel_cumsum.clamped_cumsum(g, lb, c, cfg=cfg, block_f=block_f)
      _assert_close(no_record, inputs.clamp_gates(g, lb), c, reverse=False)
      bf = block_f or default_block_f(self.shape[2])
      np.testing.assert_array_equal(np.asarray(record[0]), _block_flags(g, c, bf))
      dg = np.asarray(jax.jit(functools.partial(kernel_cumsum.clamped_cumsum_bwd, chunk_size=c,
                                                cfg=cfg, block_f=block_f))(dg_cum, record))
      assert np.all(dg[outside] == 0)
      _assert_close(dg, np.asarray(dg_cum), c, reverse=True,
                    zeroed=outside)
      assert dg[-1, c + 1, -3] != 0  # at the bound: in range, gradient kept

  def test_clamped_backward_reads_the_mask_only_where_flagged(self):
    """Under zero flags a mask of ones gives the same dg, to the bit, as a mask of
    zeros: unflagged blocks never load it (so the forward need not write it there)."""
    c = self.chunk
    dg_cum = _gates(9, self.shape, "mixed")
    cfg = _config(self.backend, c)
    b, tp, f = self.shape
    flags = jnp.zeros((b, tp // c, f // default_block_f(f)), jnp.int32)
    bwd = jax.jit(functools.partial(kernel_cumsum.clamped_cumsum_bwd, chunk_size=c, cfg=cfg))
    ones = bwd(dg_cum, (flags, jnp.ones(self.shape, jnp.int8)))
    zeros = bwd(dg_cum, (flags, jnp.zeros(self.shape, jnp.int8)))
    np.testing.assert_array_equal(np.asarray(ones), np.asarray(zeros))
    _assert_close(ones, dg_cum, c, reverse=True)


class TestChunkCumsumInterpret(CumsumChecks):
  backend = "interpret"
  shape = (2, 96, 32)
  chunk = 32
  block_fs = (16, None)

  def test_other_shapes(self):
    """C = 16 and F = 48 (default block_f 16: the largest power of two dividing F)."""
    assert default_block_f(48) == 16
    g = _gates(3, (1, 48, 48), "mixed")
    for reverse in (False, True):
      _assert_close(self._fn(16, reverse)(g), g, 16, reverse)

  @pytest.mark.parametrize("reverse", [False, True])
  def test_chunks_are_independent(self, reverse):
    """New values in chunk 1 change its outputs and leave the other chunks' bit-identical."""
    c = self.chunk
    g = _gates(4, self.shape, "mixed")
    g2 = g.at[:, c:2 * c].set(_gates(5, (self.shape[0], c, self.shape[2]), "mixed"))
    fn = self._fn(c, reverse)
    o1, o2 = np.asarray(fn(g)), np.asarray(fn(g2))
    np.testing.assert_array_equal(o1[:, :c], o2[:, :c])
    np.testing.assert_array_equal(o1[:, 2 * c:], o2[:, 2 * c:])
    assert not np.any(o1[:, c:2 * c] == o2[:, c:2 * c])

  @pytest.mark.parametrize("reverse", [False, True])
  def test_tpu_backend_is_the_xla_cumsum(self, reverse):
    g = _gates(6, self.shape, "decay")
    out = self._fn(self.chunk, reverse, backend="tpu_interpret")(g)
    want = chunk_cumsum_xla(g, self.chunk, reverse=reverse)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))

  @pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
  @pytest.mark.parametrize("reverse", [False, True])
  def test_lowers_for_triton(self, reverse):
    """The Triton lowering (no reverse cumsum there) takes both bodies, on the CPU.

    An abstract H200 stands in for the GPU that the lowering asks about.
    """
    cfg = _config("triton", 64)
    fn = jax.jit(functools.partial(chunk_cumsum, chunk_size=64, reverse=reverse, cfg=cfg))
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                      platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)
    target = "__gpu$xla.gpu.triton"
    with jax.sharding.use_abstract_mesh(mesh):
      exported = jax.export.export(
          fn, platforms=["cuda"],
          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)],
      )(jax.ShapeDtypeStruct((2, 128, 256), jnp.float32))
    text = exported.mlir_module()
    assert f"@{target}" in text and 'name = "kda_chunk_cumsum"' in text
    assert "num_warps = 4" in text

  def test_tpu_backend_clamps_in_xla(self):
    g = _gates_out_of_range(10, self.shape, self.chunk)
    dg_cum = _gates(11, self.shape, "mixed")
    cfg = _config("tpu_interpret", self.chunk)
    g_cum, record = kernel_cumsum.clamped_cumsum(g, -5.0, self.chunk, cfg=cfg, with_record=True)
    want = chunk_cumsum_xla(inputs.clamp_gates(g, -5.0), self.chunk)
    np.testing.assert_array_equal(np.asarray(g_cum), np.asarray(want))
    dg = kernel_cumsum.clamped_cumsum_bwd(dg_cum, record, self.chunk, cfg=cfg)
    want = np.where(np.asarray(inputs.out_of_range(g, -5.0)), 0.0,
                    np.asarray(chunk_cumsum_xla(dg_cum, self.chunk, reverse=True)))
    np.testing.assert_array_equal(np.asarray(dg), want)

  def test_clamped_rejects_bad_inputs(self):
    cfg = _config("interpret", 32)
    g = jnp.zeros((1, 64, 32), jnp.float32)
    with pytest.raises(ValueError, match="lower_bound must be a negative python float"):
      kernel_cumsum.clamped_cumsum(g, 0.0, 32, cfg=cfg)
    _, record = kernel_cumsum.clamped_cumsum(g, -5.0, 32, cfg=cfg, with_record=True)
    with pytest.raises(ValueError, match="record shapes"):
      kernel_cumsum.clamped_cumsum_bwd(g, record, 32, cfg=cfg, block_f=16)

  def test_rejects_bad_inputs(self):
    cfg = _config("interpret", 32)
    g = jnp.zeros((1, 64, 32), jnp.float32)
    with pytest.raises(ValueError, match="Tp=80 must be a multiple of chunk_size=32"):
      chunk_cumsum(jnp.zeros((1, 80, 32), jnp.float32), 32, cfg=cfg)
    with pytest.raises(ValueError, match="chunk_size must be a power of two, got 24"):
      chunk_cumsum(jnp.zeros((1, 48, 32), jnp.float32), 24, cfg=cfg)
    for bad in (24, 64, 0):
      with pytest.raises(ValueError, match=f"block_f must be a power of two dividing F=32, "
                                           f"got {bad}"):
        chunk_cumsum(g, 32, cfg=cfg, block_f=bad)
    with pytest.raises(ValueError, match="must be float32, got bfloat16"):
      chunk_cumsum(g.astype(jnp.bfloat16), 32, cfg=cfg)
    with pytest.raises(ValueError, match=r"rank 3\), got shape \(64, 32\)"):
      chunk_cumsum(g[0], 32, cfg=cfg)
    with pytest.raises(ValueError, match="must be float32"):
      chunk_cumsum(g.astype(jnp.bfloat16), 32, cfg=_config("tpu_interpret", 32))


@pytest.mark.gpu
class TestChunkCumsumGpu(CumsumChecks):
  """The Triton kernel at the benchmark shape (B16 T2048 H16 K128)."""
  backend = "triton"
  shape = (16, 2048, 2048)
  chunk = 64
  block_fs = (None, 64)
