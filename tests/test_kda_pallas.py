"""Pallas KDA kernels vs the float32 references, forward and VJP.

Every check lives in a mixin run twice: in interpret mode on the CPU (small
shapes, CI) and compiled on the GPU (marker `gpu`, benchmark-sized shapes;
the GPU Triton compiler is checked, not trusted, for the backward).
Interpret mode fills every kernel output with NaN before the kernel runs, so
an element a kernel fails to write shows up as a non-finite value.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import api
from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import kernel_intra_fwd
from pallas_kernels.kda import reference
from pallas_kernels.kda import spec
from pallas_kernels.kda.pallas_op import chunk_kda_pallas
from tests.kda_inputs import pallas_spec, rel_err

LOWER_BOUND = -5.0
# Relative errors: max|x - ref| / max|ref| for f32, ||x - ref|| / ||ref|| for bf16.
# f32 on the GPU uses 3xTF32 matmuls (~1e-6 per product).
TOL = {("interpret", "float32"): 2e-5, ("triton", "float32"): 1e-4,
       ("interpret", "bfloat16"): 5e-3, ("triton", "bfloat16"): 5e-3}
GRAD_TOL = {("interpret", "float32"): 2e-5, ("triton", "float32"): 2e-4,
            ("interpret", "bfloat16"): 1e-2, ("triton", "bfloat16"): 1e-2}


def _inputs(seed, b, t, h, dk, dv, dtype=jnp.float32, gdn=False, at_bound=False):
  """Unit-norm q/k, gates in [g_min, 0) (optionally at the bound), beta in (0, 1)."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, t, h, dk))).astype(dtype)
  k = unit(jax.random.normal(ks[1], (b, t, h, dk))).astype(dtype)
  v = jax.random.normal(ks[2], (b, t, h, dv)).astype(dtype)
  gshape = (b, t, h) if gdn else (b, t, h, dk)
  if at_bound:
    g = LOWER_BOUND * jax.nn.sigmoid(6.0 + jax.random.normal(ks[3], gshape))
  else:
    g = LOWER_BOUND * jax.nn.sigmoid(2.0 * jax.random.normal(ks[3], gshape))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h))).astype(dtype)
  return q, k, v, g, beta, ks[5]


def _jit_vg(loss):
  """Jitted value-and-grad of `loss(*xs) -> (scalar, aux)` w.r.t. all arguments.

  Jitting matters in interpret mode: eager dispatch of the emulated kernels
  is an order of magnitude slower than one compiled program.
  """
  return jax.jit(lambda *xs: jax.value_and_grad(loss, argnums=tuple(range(len(xs))),
                                                has_aux=True)(*xs))


def _with_states(fn, xs, key, cu_seqlens=None):
  """((o, ht), the gradients w.r.t. q, k, v, g, beta and h0) of `fn` on xs =
  (q, k, v, g, beta) with a random initial state h0, against random
  cotangents of o and of the final state ht; h0 and both cotangents from key.
  With cu_seqlens ([N + 1] int32, B = 1) there is one state per sequence."""
  q, v = xs[0], xs[2]
  b, t, h, dk = q.shape
  n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
  k1, k2, k3 = jax.random.split(key, 3)
  h0 = jax.random.normal(k1, (n, h, dk, v.shape[-1]))
  do = jax.random.normal(k2, v.shape)
  dht = jax.random.normal(k3, h0.shape)
  varlen = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}

  def loss(*args):
    o, ht = fn(*args[:5], initial_state=args[5], output_final_state=True, **varlen)
    return jnp.sum(o * do) + jnp.sum(ht * dht), (o, ht)

  (_, out), grads = _jit_vg(loss)(*xs, h0)
  return out, grads


def _o_and_vjp(fn, xs, do):
  """Jitted (o, grads) of `fn(*xs)[0]` with cotangent `do`."""
  def run(xs, do):
    o, vjp = jax.vjp(lambda *a: fn(*a)[0], *xs)
    return o, vjp(do)
  return jax.jit(run)(xs, do)


# The GPU classes below check three kernel configurations against the same
# float32 references at the same inputs: each reference is computed once per
# process (and its program compiled once) and shared.
BENCHMARK_SHAPES = [(16, 2048, 16, 128), (1, 8192, 16, 128), (4, 8192, 16, 128),
                    (1, 32768, 16, 128)]
# Heads are independent: the chunked reference runs this many at a time, which
# keeps its peak near a quarter of the whole call's (13 GB at B16 T2048 H16 D128).
_REFERENCE_HEADS = 4


def _bf16_inputs(seed, b, t, h, d):
  """bf16 inputs, their cotangent, and the float32 copies the references take."""
  q, k, v, g, beta, key = _inputs(seed, b, t, h, d, d, dtype=jnp.bfloat16)
  do = jax.random.normal(key, q.shape, jnp.bfloat16)
  f32 = tuple(x.astype(jnp.float32) for x in (q, k, v, g, beta))
  return (q, k, v, g, beta), do, f32


@functools.partial(jax.jit, static_argnums=0)
def _reference_vjp(fn, xs, do):
  o, vjp = jax.vjp(lambda *a: fn(*a)[0], *xs)
  return o, vjp(do)


_chunked_reference = functools.partial(reference.chunk_kda_xla, chunk_size=64, diagonal="dense",
                                       lower_bound=LOWER_BOUND)


@functools.lru_cache(maxsize=1)
def _benchmark_reference(shape):
  """(inputs, do, (o, grads) of the f32 chunked reference) at a benchmark shape."""
  b, t, h, d = shape
  xs, do, f32 = _bf16_inputs(10, b, t, h, d)
  do32 = do.astype(jnp.float32)
  parts = []
  for h0 in range(0, h, _REFERENCE_HEADS):
    heads = slice(h0, h0 + _REFERENCE_HEADS)
    parts.append(_reference_vjp(_chunked_reference, tuple(x[:, :, heads] for x in f32),
                                do32[:, :, heads]))
  o = jnp.concatenate([p[0] for p in parts], axis=2)
  grads = tuple(jnp.concatenate([p[1][i] for p in parts], axis=2) for i in range(5))
  return xs, do, (o, grads)


@functools.lru_cache(maxsize=1)
def _issue_shape_reference():
  """(inputs, do, (o, grads) of the f32 naive recurrence) at B1 T1024 H4 D128."""
  xs, do, f32 = _bf16_inputs(9, 1, 1024, 4, 128)
  return xs, do, _reference_vjp(reference.naive_recurrent_kda, f32, do.astype(jnp.float32))


class KdaPallasChecks:
  """Checks shared by the interpret and GPU twins. Subclasses set the fields."""
  interpret: bool
  backend: str
  shape: tuple  # (B, T, H, K, V); T not a multiple of the chunk
  chunk: int
  sub_chunk: int = 16

  def _pallas(self, diagonal, **kw):
    """The kernels under test; kw may override sub_chunk and lower_bound."""
    kw = dict(dict(sub_chunk=self.sub_chunk, lower_bound=LOWER_BOUND), **kw)
    return functools.partial(api.chunk_kda, implementation="pallas", interpret=self.interpret,
                             chunk_size=self.chunk, diagonal=diagonal, **kw)

  @pytest.mark.parametrize("diagonal,gdn,at_bound", [
      ("dense", False, True), ("pairwise", True, False), ("pairwise", False, True)])
  def test_forward_and_vjp_match_naive(self, diagonal, gdn, at_bound):
    """o, final state and all six gradients; KDA gates at the bound / GDN gates."""
    b, t, h, dk, dv = self.shape
    q, k, v, g, beta, key = _inputs(2, b, t, h, dk, dv, gdn=gdn, at_bound=at_bound)
    (o, ht), got = _with_states(self._pallas(diagonal), (q, k, v, g, beta), key)
    (o_r, ht_r), want = _with_states(reference.naive_recurrent_kda, (q, k, v, g, beta), key)
    tol, gtol = TOL[(self.backend, "float32")], GRAD_TOL[(self.backend, "float32")]
    assert o.shape == o_r.shape and o.dtype == q.dtype
    assert rel_err(o, o_r, jnp.float32) < tol
    assert rel_err(ht, ht_r, jnp.float32) < tol
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
      assert a.shape == r.shape, name
      err = rel_err(a, r, jnp.float32)
      assert err < gtol, f"{name}: {err:.2e}"

  def test_varlen_matches_naive(self):
    _, t, h, dk, dv = self.shape
    # Lengths not multiples of the chunk, one sequence shorter than a chunk.
    cuts = sorted({0, 5, t // 2 + 3, t})
    cu = jnp.asarray(cuts, jnp.int32)
    q, k, v, g, beta, key = _inputs(3, 1, t, h, dk, dv)
    xs = (q, k, v, g, beta)
    (o, ht), got = _with_states(self._pallas("dense"), xs, key, cu)
    (o_r, ht_r), want = _with_states(reference.naive_recurrent_kda, xs, key, cu)
    tol, gtol = TOL[(self.backend, "float32")], GRAD_TOL[(self.backend, "float32")]
    assert rel_err(o, o_r, jnp.float32) < tol
    assert rel_err(ht, ht_r, jnp.float32) < tol
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
      err = rel_err(a, r, jnp.float32)
      assert err < gtol, f"{name}: {err:.2e}"

  def test_pairwise_varlen_h0_matches_dense_and_naive(self):
    """pairwise == dense == the naive recurrence: varlen (lengths not multiples
    of the chunk), initial and final states, all six gradients, gates near g_min."""
    _, t, h, dk, dv = self.shape
    cu = jnp.asarray(sorted({0, 7, t // 2 + 5, t}), jnp.int32)
    q, k, v, g, beta, key = _inputs(12, 1, t, h, dk, dv)
    xs = (q, k, v, g, beta)
    runs = {name: _with_states(fn, xs, key, cu) for name, fn in (
        ("pairwise", self._pallas("pairwise")), ("dense", self._pallas("dense")),
        ("naive", reference.naive_recurrent_kda))}
    tol, gtol = TOL[(self.backend, "float32")], GRAD_TOL[(self.backend, "float32")]
    (o_p, ht_p), got = runs["pairwise"]
    for ref in ("dense", "naive"):
      (o_r, ht_r), want = runs[ref]
      assert rel_err(o_p, o_r, jnp.float32) < tol, ref
      assert rel_err(ht_p, ht_r, jnp.float32) < tol, ref
      for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        err = rel_err(a, r, jnp.float32)
        assert err < gtol, f"{name} vs {ref}: {err:.2e}"

  def test_pairwise_unbounded_gate_stays_finite(self):
    """The softplus gate g = -softplus(x) with entries below -20 (no bound, so
    no dense path): one diagonal tile per chunk, forward and all six
    gradients finite and equal to the naive recurrence."""
    b, t, h, dk, dv = self.shape
    q, k, v, _, beta, key = _inputs(13, b, t, h, dk, dv)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    x = jax.random.normal(k1, (b, t, h, dk))
    # A third of the entries near -30, the rest weak, so long-range pairs survive.
    strong = jax.random.uniform(k4, x.shape) < 1 / 3
    g = -jax.nn.softplus(jnp.where(strong, 30.0 + 2.0 * x, x - 4.0))
    assert float(jnp.min(g)) < -20.0
    h0 = jax.random.normal(k2, (b, h, dk, dv))
    do = jax.random.normal(k3, (b, t, h, dv))
    pallas = self._pallas("pairwise", sub_chunk=self.chunk, lower_bound=None)

    def loss(fn, *xs):
      o, ht = fn(*xs[:5], initial_state=xs[5], output_final_state=True)
      return jnp.sum(o * do) + jnp.sum(ht), (o, ht)

    xs = (q, k, v, g, beta, h0)
    (_, (o, ht)), got = _jit_vg(functools.partial(loss, pallas))(*xs)
    (_, (o_r, ht_r)), want = _jit_vg(functools.partial(loss, reference.naive_recurrent_kda))(*xs)
    tol, gtol = TOL[(self.backend, "float32")], GRAD_TOL[(self.backend, "float32")]
    for name, a, r in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"),
                          (o, ht, *got), (o_r, ht_r, *want)):
      assert np.all(np.isfinite(np.asarray(a))), name
      err = rel_err(a, r, jnp.float32)
      assert err < (tol if name in ("o", "ht") else gtol), f"{name}: {err:.2e}"

  def test_bf16_forward_and_vjp(self):
    b, t, h, dk, dv = self.shape
    q, k, v, g, beta, key = _inputs(4, b, t, h, dk, dv, dtype=jnp.bfloat16)
    do = jax.random.normal(key, (b, t, h, dv), jnp.bfloat16)
    o, grads = _o_and_vjp(self._pallas("dense"), (q, k, v, g, beta), do)
    f32 = tuple(x.astype(jnp.float32) for x in (q, k, v, g, beta))
    o_ref, grads_ref = _o_and_vjp(reference.naive_recurrent_kda, f32, do.astype(jnp.float32))
    assert o.dtype == jnp.bfloat16
    assert rel_err(o, o_ref, jnp.bfloat16) < TOL[(self.backend, "bfloat16")]
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, grads_ref):
      err = rel_err(a.astype(jnp.float32), r, jnp.bfloat16)
      assert err < GRAD_TOL[(self.backend, "bfloat16")], f"{name}: {err:.2e}"

  def test_dense_at_the_limit_of_the_bound(self):
    """g_min = -85 / (L - 1), the most negative bound the dense diagonal
    takes (`spec.MAX_EXP_ARG`), gates at it: its column factors reach e^85
    and its row factors e^-85, where unshifted row operands underflowed f32
    (o was 30-50% off; `kernel_common.DIAG_SHIFT`). o, the final state and
    every gradient against the naive recurrence, f32; dG at 1e-4: at this
    decay its norm is small against its terms (3.6e-5 measured in
    interpret mode)."""
    b, t, h, dk, dv = self.shape
    bound = -spec.MAX_EXP_ARG / (self.sub_chunk - 1)
    q, k, v, _, beta, key = _inputs(15, b, t, h, dk, dv)
    gate_key, key = jax.random.split(key)
    g = bound * jax.nn.sigmoid(6.0 + jax.random.normal(gate_key, q.shape))
    xs = (q, k, v, g, beta)
    (o, ht), got = _with_states(self._pallas("dense", lower_bound=bound), xs, key)
    (o_r, ht_r), want = _with_states(reference.naive_recurrent_kda, xs, key)
    tol, gtol = TOL[(self.backend, "float32")], GRAD_TOL[(self.backend, "float32")]
    for name, a, r in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"),
                          (o, ht, *got), (o_r, ht_r, *want)):
      err = rel_err(a, r, jnp.float32)
      limit = tol if name in ("o", "ht") else (max(gtol, 1e-4) if name == "dg" else gtol)
      assert err < limit, f"{name}: {err:.2e}"

  @pytest.mark.parametrize("diagonal", ["dense", "pairwise"])
  def test_f16_at_the_bound(self, diagonal):
    """f16 inputs with gates at the bound: the diagonal tiles' factors reach
    e^{|g_min| (L - 1)} = e^75, past f16's range, so the kernels take bf16
    operands (`kernel_config.heuristic_config`); o (in f16) and the
    gradients stay within the bf16 tolerances of the f32 recurrence."""
    b, t, h, dk, dv = self.shape
    q, k, v, g, beta, key = _inputs(14, b, t, h, dk, dv, dtype=jnp.float16, at_bound=True)
    do = jax.random.normal(key, (b, t, h, dv), jnp.float16)
    o, grads = _o_and_vjp(self._pallas(diagonal), (q, k, v, g, beta), do)
    f32 = tuple(x.astype(jnp.float32) for x in (q, k, v, g, beta))
    o_ref, grads_ref = _o_and_vjp(reference.naive_recurrent_kda, f32, do.astype(jnp.float32))
    assert o.dtype == jnp.float16
    assert rel_err(o.astype(jnp.float32), o_ref, jnp.bfloat16) < TOL[(self.backend, "bfloat16")]
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, grads_ref):
      err = rel_err(a.astype(jnp.float32), r, jnp.bfloat16)
      assert err < GRAD_TOL[(self.backend, "bfloat16")], f"{name}: {err:.2e}"

  @pytest.mark.parametrize("diagonal", ["dense", "pairwise"])
  def test_causal_under_future_gates(self, diagonal):
    """Changing gates after position p leaves outputs before p bit-identical."""
    b, t, h, dk, dv = self.shape
    q, k, v, g, beta, _ = _inputs(5, b, t, h, dk, dv)
    p = self.chunk + self.sub_chunk + 3  # inside a diagonal tile of chunk 1
    g2 = g.at[:, p:].set(LOWER_BOUND * 0.999)
    fn = jax.jit(lambda *xs: self._pallas(diagonal)(*xs)[0])
    o1 = fn(q, k, v, g, beta)
    o2 = fn(q, k, v, g2, beta)
    np.testing.assert_array_equal(np.asarray(o1[:, :p]), np.asarray(o2[:, :p]))
    assert not np.array_equal(np.asarray(o1[:, p:]), np.asarray(o2[:, p:]))


class TestKdaPallasInterpret(KdaPallasChecks):
  interpret = True
  backend = "interpret"
  shape = (2, 70, 1, 16, 16)
  chunk = 32

  def test_kernel_outputs_fully_written(self):
    """Every element of the intra-chunk kernel's outputs is written (NaN-poisoned)."""
    b, t, h, dk, dv = 1, 64, 2, 16, 16
    q, k, v, g, beta, _ = _inputs(6, b, t, h, dk, dv)
    cfg = kernel_config.make_config(backend="interpret", dtype=jnp.float32, head_k=dk,
                                    head_v=dv, chunk_size=32, sub_chunk=16)
    g_cum = jnp.cumsum(g.reshape(b, 2, 32, h * dk), axis=2).reshape(b, t, h * dk)
    beta_t = jnp.transpose(beta, (0, 2, 1))[..., None]
    intra = jax.jit(functools.partial(kernel_intra_fwd.intra_fwd, heads=h, chunk_size=32,
                                      sub_chunk=16, diagonal="pairwise", scale=0.25, cfg=cfg,
                                      save_m=True))
    outs = intra(q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1), g_cum, beta_t)
    for x in outs[:4]:
      assert np.all(np.isfinite(np.asarray(x)))

  def test_rejects_non_power_of_two_chunk(self):
    """Head widths are padded (tests/test_kda_head_widths.py); the chunk is not."""
    q, k, v, g, beta, _ = _inputs(7, 1, 16, 1, 24, 16)
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
      chunk_kda_pallas(q, k, v, g, beta, spec=pallas_spec(chunk_size=24, sub_chunk=8), scale=0.2,
                       interpret=True)

  def test_config_overrides_are_pallas_only(self):
    q, k, v, g, beta, _ = _inputs(8, 1, 16, 1, 16, 16)
    with pytest.raises(ValueError, match="config_overrides"):
      api.chunk_kda(q, k, v, g, beta, implementation="xla", chunk_size=16,
                    config_overrides={"intra_bwd": "tiles"})

  def test_dense_rejects_unsafe_lower_bound(self):
    q, k, v, g, beta, _ = _inputs(8, 1, 16, 1, 16, 16)
    with pytest.raises(ValueError, match="unsafe"):
      api.chunk_kda(q, k, v, g, beta, implementation="pallas", interpret=True,
                    chunk_size=32, sub_chunk=32, lower_bound=-5.0, diagonal="dense")


class TestKdaPallasTpuInterpret(KdaPallasChecks):
  """TPU semantics on the CPU (SMEM metadata, whole-V state tiles, Mosaic params)."""
  interpret = True
  backend = "interpret"
  shape = (2, 70, 1, 16, 16)
  chunk = 32
  # Dtype handling is backend-independent (f16 inputs take bf16 operands on every backend:
  # `kernel_config`); CI time.
  test_bf16_forward_and_vjp = None
  test_f16_at_the_bound = None

  def _pallas(self, diagonal, **kw):
    spec = pallas_spec(**dict(dict(sub_chunk=self.sub_chunk, lower_bound=LOWER_BOUND), **kw),
                       chunk_size=self.chunk, diagonal=diagonal)

    def fn(q, k, v, g, beta, **kw2):
      if g.ndim == 3:
        g = jnp.broadcast_to(g[..., None], q.shape)
      return chunk_kda_pallas(q, k, v, g, beta, spec=spec, scale=q.shape[-1] ** -0.5,
                              backend="tpu_interpret", **kw2)
    return fn


@pytest.mark.gpu
class TestKdaPallasGpu(KdaPallasChecks):
  interpret = False
  backend = "triton"
  shape = (2, 300, 2, 64, 128)
  chunk = 64

  @pytest.mark.parametrize("diagonal", ["dense", "pairwise"])
  def test_bf16_accuracy_issue_shape(self, diagonal):
    """bf16 relative L2 error vs the f32 recurrence at B1 T1024 H4 D128 (<= 5e-3)."""
    xs, do, (o_ref, grads_ref) = _issue_shape_reference()
    o, grads = _o_and_vjp(self._pallas(diagonal), xs, do)
    err = rel_err(o, o_ref, jnp.bfloat16)
    print(f"bf16 fwd rel L2 ({diagonal}): {err:.2e}")
    assert err < 5e-3
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, grads_ref):
      gerr = rel_err(a.astype(jnp.float32), r, jnp.bfloat16)
      print(f"bf16 {name} rel L2 ({diagonal}): {gerr:.2e}")
      assert gerr < GRAD_TOL[("triton", "bfloat16")], f"{name}: {gerr:.2e}"

  # One xdist group per shape (`--dist loadgroup`): the three classes' runs of a
  # shape share one worker, so its reference is computed there once.
  @pytest.mark.parametrize("shape", [pytest.param(s, marks=pytest.mark.xdist_group(
      f"kda_benchmark_shape{i}")) for i, s in enumerate(BENCHMARK_SHAPES)])
  def test_benchmark_shapes_vs_xla_reference(self, shape):
    """bf16 kernels vs the f32 chunked reference (fwd and VJP) at the benchmark shapes."""
    xs, do, (o_ref, grads_ref) = _benchmark_reference(shape)
    o, grads = _o_and_vjp(self._pallas("dense"), xs, do)
    err = rel_err(o, o_ref, jnp.bfloat16)
    print(f"{shape} bf16 fwd rel L2: {err:.2e}")
    assert err < 5e-3
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, grads_ref):
      gerr = rel_err(a.astype(jnp.float32), r, jnp.bfloat16)
      print(f"{shape} bf16 {name} rel L2: {gerr:.2e}")
      assert gerr < GRAD_TOL[("triton", "bfloat16")], f"{name}: {gerr:.2e}"


@pytest.mark.tpu_export
@pytest.mark.parametrize("diagonal", ["dense", "pairwise"])
def test_lowers_for_tpu(diagonal):
  """Forward and backward lower for TPU (Mosaic) via jax.export on the CPU."""
  b, t, h, d = 1, 256, 1, 128
  q, k, v, g, beta, _ = _inputs(11, b, t, h, d, d, dtype=jnp.bfloat16)
  fn = functools.partial(chunk_kda_pallas, spec=pallas_spec(diagonal=diagonal),
                         scale=d ** -0.5, backend="tpu", block_v=128,
                         output_final_state=True)

  def fwd_bwd(q, k, v, g, beta):
    (o, ht), vjp = jax.vjp(lambda *xs: fn(*xs), q, k, v, g, beta)
    return o, ht, vjp((o, ht))

  exported = jax.export.export(jax.jit(fwd_bwd), platforms=["tpu"])(q, k, v, g, beta)
  text = exported.mlir_module()
  assert "tpu_custom_call" in text


@pytest.mark.gpu
class TestKdaPallasGpuTilesBackward(TestKdaPallasGpu):
  """The GPU checks with the full-tile intra backward forced (what the GPU
  runs when sub_chunk < 16, and the TPU body)."""

  def _pallas(self, diagonal, **kw):
    return super()._pallas(diagonal, config_overrides={"intra_bwd": "tiles"}, **kw)


@pytest.mark.gpu
class TestKdaPallasGpuSubstitutionInverse(TestKdaPallasGpu):
  """The GPU checks, gradients included, with the substitution inverse forced
  (the GPU default is "blocked")."""

  def _pallas(self, diagonal, **kw):
    return super()._pallas(diagonal, config_overrides={"inverse": "substitution"}, **kw)
