"""The GPU's split forward state pass (`kernel_state_split`) against the TPU's fused one.

The split pass runs the chunk recurrence alone and forms the outputs in a
parallel kernel; with f32 operands it must reproduce the fused
`kernel_state_fwd.state_fwd` (run with TPU semantics on the CPU: outputs,
final states, and the entry states and V' the backward keeps). Interpret mode fills kernel outputs with NaN first, so
an unwritten element fails the finiteness checks. End to end (o, final state
and the VJP against the naive recurrence, K sliced, V tiled, varlen) it runs
as the interpret default in `test_kda_state_slices.py` and
`test_kda_pallas.py`; `TestKdaPallasGpu*` run it on the GPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import kernel_intra_fwd
from pallas_kernels.kda import kernel_state_bwd
from pallas_kernels.kda import kernel_state_fwd
from pallas_kernels.kda import kernel_state_split
from tests.kda_inputs import rel_max, vjp_inputs

B, T, H, DK, DV, CHUNK, SUB = 2, 48, 2, 32, 16, 16, 8
F32_TOL = 2e-6  # same products, same order: only the f32 rounding of the output sum


def _cfg(backend="interpret", **overrides):
  return kernel_config.make_config(backend=backend, dtype=jnp.float32, head_k=DK, head_v=DV,
                                   chunk_size=CHUNK, sub_chunk=SUB, block_v=8,
                                   overrides=dict(block_k=16 if backend == "triton" else 8,
                                                  **overrides))


def _kernel_inputs(seed):
  """Kernel-layout q, k, v, G (chunk cumsum), beta and h0 [B, H, K, V]."""
  (q, k, v, g, beta, h0), _, _ = vjp_inputs(seed, b=B, t=T, h=H, dk=DK, dv=DV, gates="spread")
  nc = T // CHUNK
  g_cum = jnp.cumsum(g.reshape(B, nc, CHUNK, H * DK), axis=2).reshape(B, T, H * DK)
  beta_t = jnp.transpose(beta, (0, 2, 1))[..., None]
  flat = lambda x: x.reshape(B, T, -1)
  return flat(q), flat(k), flat(v), g_cum, beta_t, h0


def _meta():
  chunk = jnp.arange(T // CHUNK, dtype=jnp.int32)
  return ((chunk == 0).astype(jnp.int32), (chunk == T // CHUNK - 1).astype(jnp.int32),
          jnp.zeros_like(chunk))


@pytest.mark.parametrize("inverse", ["substitution", "blocked"])
def test_intra_kernel_writes_gated_keys_and_queries(inverse):
  """kg = k e^{G_last - G} and qg = (scale q) e^G per chunk, from both intra
  bodies, K sliced; W, U and A_qk do not depend on whether they are asked."""
  q, k, v, g_cum, beta_t, _ = _kernel_inputs(0)
  cfg = _cfg(inverse=inverse)
  run = lambda gated: jax.jit(functools.partial(
      kernel_intra_fwd.intra_fwd, heads=H, chunk_size=CHUNK, sub_chunk=SUB, diagonal="dense",
      scale=DK ** -0.5, cfg=cfg, save_m=True, save_gated=gated))(q, k, v, g_cum, beta_t)
  outs = run(True)
  assert len(outs) == 6
  g_c = g_cum.reshape(B, T // CHUNK, CHUNK, H * DK)
  want_kg = (k.reshape(g_c.shape) * jnp.exp(g_c[:, :, -1:] - g_c)).reshape(k.shape)
  want_qg = q * DK ** -0.5 * jnp.exp(g_cum)
  for name, x, want in (("kg", outs[4], want_kg), ("qg", outs[5], want_qg)):
    assert x.dtype == cfg.mm_dtype and x.shape == q.shape, name
    assert rel_max(x, want) < F32_TOL, f"{name}: {rel_max(x, want):.2e}"
  assert np.all(np.abs(np.asarray(outs[4])) <= 1.0 + 1e-6)  # unit-norm keys, decay <= 1
  plain = run(False)
  assert plain.kg is None and plain.qg is None
  for name, x, r in zip(("w", "u", "a_qk", "m"), plain, outs):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(r), err_msg=name)


def _intra_outputs(seed):
  """(kernel inputs, state-kernel kwargs, (W, U, A_qk, kg, qg) of the intra kernel)."""
  q, k, v, g_cum, beta_t, h0 = _kernel_inputs(seed)
  kw = dict(heads=H, chunk_size=CHUNK, scale=DK ** -0.5, cfg=_cfg())
  intra = jax.jit(functools.partial(
      kernel_intra_fwd.intra_fwd, sub_chunk=SUB, diagonal="dense", save_gated=True, **kw))(
          q, k, v, g_cum, beta_t)
  return (q, k, v, g_cum, beta_t, h0), kw, (intra.w, intra.u, intra.a_qk, intra.kg, intra.qg)


@pytest.mark.parametrize("save,rec_block_v", [(True, None), (False, None), (True, 16)])
def test_split_matches_fused(save, rec_block_v):
  """o and ht (and with save, the entry states and V') of both state passes.

  rec_block_v: the recurrence's V tile other than block_v = 8 (one tile).
  """
  (q, k, v, g_cum, beta_t, h0), kw, (w, u, a_qk, kg, qg) = _intra_outputs(1)
  cfg = kw["cfg"]
  meta = _meta()
  if rec_block_v:
    cfg = dataclasses.replace(cfg, rec_block_v=rec_block_v)
  tpu = dict(kw, cfg=dataclasses.replace(cfg, backend="tpu_interpret", level_anchors="select"))
  fused = jax.jit(functools.partial(kernel_state_fwd.state_fwd, varlen=False, save=True,
                                    out_dtype=jnp.float32, **tpu))(
                                        meta, q, k, g_cum, w, u, a_qk, h0)

  @jax.jit
  def split(meta, qg, g_cum, w, u, kg, a_qk, h0):
    hs, v_new, ht = kernel_state_split.state_recurrence(
        meta, w, u, kg, g_cum, h0, heads=H, chunk_size=CHUNK, cfg=cfg, varlen=False,
        state_dtype=jnp.float32 if save else cfg.mm_dtype)
    o = kernel_state_split.output_fwd(qg, a_qk, hs, v_new, heads=H, chunk_size=CHUNK, cfg=cfg,
                                      out_dtype=jnp.float32)
    return o, ht, hs, v_new

  got = split(meta, qg, g_cum, w, u, kg, a_qk, h0)
  names = ("o", "ht", "hs", "v_new")
  for name, x, r in zip(names, got, fused):
    assert x.shape == r.shape, name
    assert rel_max(x, r) < F32_TOL, f"{name}: {rel_max(x, r):.2e}"


@pytest.mark.parametrize("bwd_block_v", [None, DV])
def test_state_bwd_reads_the_gated_operands(bwd_block_v):
  """The reverse state kernel given qg and kg (as the split pass keeps them)
  gives the gradients it forms from q, k and G itself: dV', every chunk's dS
  and dh0. With bwd_block_v the gated run takes one V tile (the reference
  keeps block_v = 8, two tiles)."""
  (q, k, v, g_cum, beta_t, h0), kw, (w, u, a_qk, kg, qg) = _intra_outputs(2)
  cfg = kw["cfg"]
  do = jax.random.normal(jax.random.key(3), v.shape, jnp.float32)
  dht = jax.random.normal(jax.random.key(4), h0.shape, jnp.float32)
  tiled = dict(kw, cfg=dataclasses.replace(cfg, bwd_block_v=bwd_block_v))
  run = lambda x, y, gated: jax.jit(functools.partial(
      kernel_state_bwd.state_bwd, varlen=False, gated=gated, **(tiled if gated else kw)))(
          _meta(), x, y, g_cum, w, a_qk, do, dht)
  want = run(q, k, False)
  got = run(qg, kg, True)
  for name, x, r in zip(("dv_new", "dhs", "dh0"), got, want):
    assert np.all(np.isfinite(np.asarray(x))), name
    assert rel_max(x, r) < F32_TOL, f"{name}: {rel_max(x, r):.2e}"
  # The gated kernel does read qg: queries it was not given change dS.
  other = run(qg * 0.5, kg, True)
  assert rel_max(other[1], want[1]) > 1e-2


def test_each_state_pass_refuses_the_other_backend():
  """The split pass is the GPU's (and interpret mode's), the fused one the TPU's."""
  (q, k, v, g_cum, beta_t, h0), kw, (w, u, a_qk, kg, qg) = _intra_outputs(5)
  with pytest.raises(ValueError, match="the TPU state pass"):
    kernel_state_fwd.state_fwd(_meta(), q, k, g_cum, w, u, a_qk, h0, varlen=False, **kw)
  tpu = dataclasses.replace(kw["cfg"], backend="tpu_interpret", level_anchors="select")
  with pytest.raises(ValueError, match="not lowered for TPU"):
    kernel_state_split.state_recurrence(_meta(), w, u, kg, g_cum, h0, heads=H,
                                        chunk_size=CHUNK, cfg=tpu, varlen=False)
