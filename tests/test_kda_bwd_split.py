"""KDA Pallas backward: the split intra kernels (`intra_bwd="split"`).

Checked in interpret mode against the one-program "tiles" kernel on random
chunk operands with four K slices, and end to end (the whole VJP) against the
float32 naive recurrence with four K slices, for dense gates at the bound and
GDN-style gates with the pairwise diagonal. Interpret mode fills kernel
outputs with NaN first, so an unwritten slice fails. "split"
is the Triton default, so `test_kda_pallas.TestKdaPallasGpu` checks it on
the GPU.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from pallas_kernels.kda import reference
from pallas_kernels.kda.pallas_op import chunk_kda_pallas
from tests.kda_inputs import (GRAD_NAMES, assert_each_within, intra_bwd_by_impl, intra_bwd_operands,
                               pallas_spec, state_loss_grads, vjp_inputs)

# max|x - ref| / max|ref|, float32 operands, exact (HIGHEST) matmuls on the CPU.
F32_TOL = 2e-5


@pytest.mark.parametrize("diagonal", ["dense", "pairwise"])
def test_split_kernels_match_full_tile_kernel(diagonal, impl="split"):
  """intra_bwd "split" == "tiles" on random chunk operands (all five outputs).

  K = 64 in bwd_block_k = 16 slices (four programs per chunk), C = 32, L = 8
  (four row tiles), two chunks and two heads, so the slice, head and chunk
  index maps of both kernels are exercised; pairwise: three levels per tile.
  """
  ops = intra_bwd_operands(0, b=1, h=2, nc=2, c=32, dk=64, dv=16)
  outs = intra_bwd_by_impl(ops, (impl, "tiles"), heads=2, chunk=32, sub_chunk=8,
                           diagonal=diagonal, bwd_block_k=16)
  assert_each_within(outs[impl], outs["tiles"], ("dq", "dk", "dv", "dG", "dbeta"), F32_TOL,
                     label=f"{impl} {diagonal}")
  assert [a.dtype for a in outs[impl]] == [r.dtype for r in outs["tiles"]]


@pytest.mark.parametrize("diagonal,gdn", [("dense", False), ("pairwise", True)])
def test_split_vjp_matches_naive(diagonal, gdn, impl="split"):
  """All six gradients vs the naive recurrence with the split backward.

  K = 32 in bwd_block_k = 8 slices (block_k too, for the forward), T = 40 (not a multiple of C = 32), four row
  tiles of L = 8, an initial state and a final-state cotangent. Dense: KDA
  gates at the bound. Pairwise: GDN-style gates (one per head, broadcast over K),
  level anchors by reshape (the other pickers: `test_kda_pallas`).
  """
  dk = 32
  xs, do, dht = vjp_inputs(1, b=1, t=40, h=2, dk=dk, dv=16, gates="gdn" if gdn else "at_bound")
  grads = lambda fn: state_loss_grads(fn, xs, do, dht)
  want = grads(functools.partial(reference.naive_recurrent_kda, scale=dk ** -0.5))
  got = grads(functools.partial(
      chunk_kda_pallas, spec=pallas_spec(chunk_size=32, sub_chunk=8, diagonal=diagonal),
      scale=dk ** -0.5,
      interpret=True, config_overrides=dict(intra_bwd=impl, block_k=8, bwd_block_k=8,
                                            level_anchors="reshape")))
  assert_each_within(got, want, GRAD_NAMES, F32_TOL, label=f"{impl} {diagonal}")


def test_split_is_rejected_for_tpu():
  """"split" is a ValueError on TPU backends, through the public entry too
  (`test_kda_bwd_residuals.test_intra_bwd_body_choice` covers the choice itself)."""
  x = jnp.ones((1, 16, 1, 128), jnp.float32)
  fn = functools.partial(chunk_kda_pallas, spec=pallas_spec(chunk_size=16, sub_chunk=16),
                         scale=0.1, backend="tpu_interpret",
                         config_overrides=dict(intra_bwd="split"))
  with pytest.raises(ValueError, match="not lowered for TPU"):
    fn(x, x, x, -x, jnp.ones((1, 16, 1)))
