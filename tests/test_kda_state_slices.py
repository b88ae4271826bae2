"""KDA Pallas state kernels walking K in slices of block_k channels.

`state_fwd` / `state_bwd` carry the state (and its gradient) as K/block_k
slices of [block_k, BV] and form every per-channel factor on [C, block_k]
tiles. Here K = 32 with block_k = 8 (four slices) and block_v = 8 < V, so
each program owns one V tile of four state slices; the forward and the whole
VJP go through `chunk_kda_pallas` in interpret mode and are compared with the
float32 naive recurrence. Interpret mode fills kernel outputs with NaN first,
so an unwritten state slice (final state, per-chunk states, d initial_state)
fails the finiteness check.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import kernel_common
from pallas_kernels.kda import reference
from pallas_kernels.kda.pallas_op import chunk_kda_pallas
from tests.kda_inputs import GRAD_NAMES, assert_each_within, pallas_spec, vjp_inputs

# max|x - ref| / max|ref|, float32 operands, exact (HIGHEST) matmuls on the CPU.
F32_TOL = 2e-5
DK, DV, BLOCK_K, BLOCK_V, CHUNK, SUB = 32, 16, 8, 8, 16, 8


def _inputs(seed, b, t, h, n_states):
  """Unit-norm q/k, per-channel gates spread over (g_min, 0) (every K slice
  decays differently), beta in (0, 1), h0 and cotangents."""
  return vjp_inputs(seed, b=b, t=t, h=h, dk=DK, dv=DV, gates="spread", num_states=n_states)


def _check_against_naive(xs, do, dht, *, save, impl, cu_seqlens=None):
  def run(fn):
    def loss(*xs):
      o, ht = fn(*xs[:5], initial_state=xs[5], output_final_state=True,
                 cu_seqlens=cu_seqlens)
      return jnp.sum(o * do) + jnp.sum(ht * dht), (o, ht)
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(*xs)

  (_, (o_r, ht_r)), want = run(functools.partial(reference.naive_recurrent_kda,
                                                 scale=DK ** -0.5))
  (_, (o, ht)), got = run(functools.partial(
      chunk_kda_pallas, spec=pallas_spec(chunk_size=CHUNK, sub_chunk=SUB), scale=DK ** -0.5,
      backend="tpu_interpret" if impl == "fused" else "interpret", block_v=BLOCK_V,
      config_overrides=dict(block_k=BLOCK_K, save_residuals=save)))
  assert_each_within((o, ht, *got), (o_r, ht_r, *want), ("o", "ht") + GRAD_NAMES, F32_TOL,
                     label=f"save_residuals={save}, state pass {impl}")


@pytest.mark.parametrize("impl", ["fused", "split"])
@pytest.mark.parametrize("save", [True, False])
def test_sliced_state_forward_and_vjp_match_naive(save, impl):
  """o, final state and all six gradients; T = 40 is not a multiple of C = 16.

  impl: the forward state pass, "split" (the GPU's, in interpret mode) or
  "fused" (the TPU's, with TPU semantics on the CPU)."""
  xs, do, dht = _inputs(0, 2, 40, 1, n_states=2)
  _check_against_naive(xs, do, dht, save=save, impl=impl)


@pytest.mark.parametrize("impl", ["fused", "split"])
def test_sliced_state_varlen_matches_naive(impl):
  """Packed sequences (one shorter than a chunk): per-sequence h0 / ht / dh0 slices."""
  cu = jnp.asarray([0, 5, 23, 40], jnp.int32)
  xs, do, dht = _inputs(1, 1, 40, 1, n_states=3)
  _check_against_naive(xs, do, dht, save=True, impl=impl, cu_seqlens=cu)


def test_k_slices():
  cfg = kernel_config.make_config(backend="interpret", dtype=jnp.float32, head_k=DK,
                                  head_v=DV, chunk_size=CHUNK, sub_chunk=SUB,
                                  overrides=dict(block_k=BLOCK_K))
  slices = kernel_common.k_slices(cfg, DK)
  assert [(s.start, s.size) for s in slices] == [(0, 8), (8, 8), (16, 8), (24, 8)]
  # block_k wider than K: one slice of all of K.
  assert [(s.start, s.size) for s in kernel_common.k_slices(cfg, 4)] == [(0, 4)]
  # K not a multiple of block_k: power-of-two slices, widest first.
  assert [(s.start, s.size) for s in kernel_common.k_slices(cfg, 12)] == [(0, 8), (8, 4)]
  with pytest.raises(ValueError, match="slice width must be a power of two, got 12"):
    kernel_common.k_slices(cfg, DK, 12)
  # An explicit width (the split backward's bwd_block_k) replaces block_k.
  assert [(s.start, s.size) for s in kernel_common.k_slices(cfg, DK, 16)] == [(0, 16), (16, 16)]
