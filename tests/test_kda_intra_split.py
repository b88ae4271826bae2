"""The split intra-chunk forward (`kernel_intra_split`, intra_fwd_impl="split").

Its two kernels (scores and inverse, then W/U) must give what the fused
blocked kernel gives: with f32 operands the same products in the same order,
so the same values; end to end the forward, final state and all six
gradients must match the naive f32 recurrence. Interpret mode fills kernel
outputs with NaN first, so an unwritten element fails.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import kernel_fwd
from pallas_kernels.kda import kernel_intra_split
from pallas_kernels.kda import reference
from pallas_kernels.kda.pallas_op import chunk_kda_pallas
from tests.kda_inputs import GRAD_NAMES, assert_each_within, rel_max, vjp_inputs

B, T, H, DK, DV, CHUNK, SUB = 2, 48, 2, 32, 16, 16, 8
F32_SAME = 1e-6    # same products in the same order: only M's f32 store between them
F32_TOL = 2e-5     # vs the naive recurrence (as test_kda_state_slices)


def _cfg(impl, dtype=jnp.float32, **overrides):
  return kernel_config.make_config(
      backend="interpret", dtype=dtype, head_k=DK, head_v=DV, chunk_size=CHUNK, sub_chunk=SUB,
      overrides={"inverse": "blocked", "block_k": 8, "intra_fwd_impl": impl, **overrides})


def _kernel_inputs(seed, dtype=jnp.float32):
  (q, k, v, g, beta, _), _, _ = vjp_inputs(seed, b=B, t=T, h=H, dk=DK, dv=DV, gates="spread")
  nc = T // CHUNK
  g_cum = jnp.cumsum(g.reshape(B, nc, CHUNK, H * DK), axis=2).reshape(B, T, H * DK)
  beta_t = jnp.transpose(beta, (0, 2, 1))[..., None]
  flat = lambda x: x.reshape(B, T, -1).astype(dtype)
  return flat(q), flat(k), flat(v), g_cum, beta_t


def _intra(impl, xs, *, diagonal, save_m, m_dtype=jnp.float32, dtype=jnp.float32):
  return jax.jit(functools.partial(
      kernel_fwd.intra_fwd, heads=H, chunk_size=CHUNK, sub_chunk=SUB, diagonal=diagonal,
      scale=DK ** -0.5, cfg=_cfg(impl, dtype), save_m=save_m, save_gated=True,
      m_dtype=m_dtype))(*xs)


@pytest.mark.parametrize("diagonal", ["dense", "pairwise"])
@pytest.mark.parametrize("save_m", [True, False])
def test_split_matches_fused(diagonal, save_m):
  """W, U, A_qk, (M), kg and qg of both bodies, f32."""
  xs = _kernel_inputs(0)
  fused = _intra("fused", xs, diagonal=diagonal, save_m=save_m)
  split = _intra("split", xs, diagonal=diagonal, save_m=save_m)
  names = ("w", "u", "a_qk") + ("m",) * save_m + ("kg", "qg")
  assert len(split) == len(fused) == len(names)
  for name, x, r in zip(names, split, fused):
    assert x.shape == r.shape and x.dtype == r.dtype, name
    assert np.all(np.isfinite(np.asarray(x))), name
    assert rel_max(x, r) < F32_SAME, f"{name}: {rel_max(x, r):.2e}"


def test_m_storage_dtypes():
  """bf16 inputs: M goes between the kernels in the W/U operand dtype, or
  wider when the backward keeps it wider; it is returned in m_dtype."""
  bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
  cfg = _cfg("split", jnp.bfloat16)
  assert kernel_intra_split.m_store_dtype(cfg, False, f32) == bf16
  assert kernel_intra_split.m_store_dtype(cfg, True, bf16) == bf16
  assert kernel_intra_split.m_store_dtype(cfg, True, f32) == f32
  wide_wu = _cfg("split", jnp.bfloat16, intra_mm_dtype=jnp.float32)
  assert kernel_intra_split.m_store_dtype(wide_wu, True, bf16) == f32
  xs = _kernel_inputs(1, jnp.bfloat16)
  out = _intra("split", xs, diagonal="dense", save_m=True, m_dtype=jnp.bfloat16,
               dtype=jnp.bfloat16)
  assert out[3].dtype == bf16
  fused = _intra("fused", xs, diagonal="dense", save_m=True, m_dtype=jnp.bfloat16,
                 dtype=jnp.bfloat16)
  assert len(out) == len(fused) == 6
  for name, x, r in zip(("w", "u", "a_qk", "m", "kg", "qg"), out, fused):
    # Both round M to bf16 as the W/U operand; XLA's CPU rewrites may differ
    # in where they round, so compare at bf16 resolution.
    assert rel_max(x, r) < 1e-2, f"{name}: {rel_max(x, r):.2e}"


@pytest.mark.parametrize("diagonal", ["dense", "pairwise"])
def test_forward_and_vjp_match_naive(diagonal):
  """o, final state and all six gradients through chunk_kda_pallas with the
  split intra forward; T = 40 is not a multiple of C = 16, h0 is random."""
  xs, do, dht = vjp_inputs(2, b=2, t=40, h=1, dk=DK, dv=DV, gates="spread")

  def run(fn):
    def loss(*xs):
      o, ht = fn(*xs[:5], initial_state=xs[5], output_final_state=True)
      return jnp.sum(o * do) + jnp.sum(ht * dht), (o, ht)
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(*xs)

  (_, (o_r, ht_r)), want = run(functools.partial(reference.naive_recurrent_kda,
                                                 scale=DK ** -0.5))
  (_, (o, ht)), got = run(functools.partial(
      chunk_kda_pallas, scale=DK ** -0.5, chunk_size=CHUNK, sub_chunk=SUB, diagonal=diagonal,
      interpret=True, config_overrides=dict(inverse="blocked", block_k=8,
                                            intra_fwd_impl="split")))
  assert_each_within((o, ht, *got), (o_r, ht_r, *want), ("o", "ht") + GRAD_NAMES, F32_TOL,
                     label=f"split intra forward, {diagonal}")


def test_split_needs_the_blocked_inverse():
  with pytest.raises(ValueError, match="intra_fwd_impl='split' runs the blocked inverse"):
    _cfg("split", inverse="substitution")
  with pytest.raises(ValueError, match="intra_fwd_impl must be one of"):
    _cfg("splt")
  with pytest.raises(ValueError, match="intra_fwd_impl='split' is not lowered for TPU"):
    kernel_config.make_config(backend="tpu_interpret", dtype=jnp.float32, head_k=DK,
                              head_v=DV, chunk_size=CHUNK, sub_chunk=SUB,
                              overrides={"inverse": "blocked", "intra_fwd_impl": "split"})
