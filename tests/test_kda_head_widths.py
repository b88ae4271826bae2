"""Head widths K, V that are not powers of two on the Pallas path.

Multiples of 16 (96, 48, 80) run in the GPU's kernels as they are, through
power-of-two slices; other widths are zero-padded inside the op
(`head_pad`). Forward, final state and every gradient against the float32
naive recurrence; the interpret twin runs on the CPU, the `gpu` twin on the
GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import api
from pallas_kernels.kda import head_pad
from pallas_kernels.kda import kernel_common
from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import pallas_op
from pallas_kernels.kda import reference
from pallas_kernels.kda.spec import KdaSpec
from tests.kda_inputs import make_inputs, rel_err

LOWER_BOUND = -5.0
TOL = {"interpret": 2e-5, "triton": 2e-4}
# (K, V, GDN gate): widths run without a copy (multiples of 16), and padded ones.
NO_COPY_WIDTHS = [(96, 96, False), (48, 80, False), (80, 48, True)]
PADDED_WIDTHS = [(12, 20, False), (40, 24, True)]


def _fwd_vjp(fn, xs, do, dht):
  """Jitted ((o, ht), grads of q, k, v, g, beta, h0) of fn with cotangents (do, dht)."""
  def run(xs, do, dht):
    out, vjp = jax.vjp(lambda *a: fn(*a[:5], initial_state=a[5], output_final_state=True), *xs)
    return out, vjp((do, dht))
  return jax.jit(run)(xs, do, dht)


def _assert_matches_naive(fn, x, seed: int, tol: float, cu_seqlens=None, naive=None):
  """o, final state and the six gradients of `fn` (a chunk_kda with the head
  widths of `x`) within `tol` (relative max) of the f32 naive recurrence
  (`naive`, default `reference.naive_recurrent_kda`), under random cotangents."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  do = jax.random.normal(k1, x.v.shape)
  dht = jax.random.normal(k2, x.h0.shape)
  naive = functools.partial(naive or reference.naive_recurrent_kda, cu_seqlens=cu_seqlens)
  xs = (*x.args(), x.h0)
  (o, ht), grads = _fwd_vjp(fn, xs, do, dht)
  (o_r, ht_r), grads_r = _fwd_vjp(naive, xs, do, dht)
  for name, a, r in zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"),
                        (o, ht, *grads), (o_r, ht_r, *grads_r)):
    assert a.shape == r.shape, name
    err = rel_err(a, r, jnp.float32)
    assert err < tol, f"{name}: {err:.2e}"


class HeadWidthChecks:
  interpret: bool
  backend: str
  seq_len: int
  chunk: int

  def _pallas(self, **kw):
    return functools.partial(api.chunk_kda, implementation="pallas", interpret=self.interpret,
                             chunk_size=self.chunk, **kw)

  @pytest.mark.parametrize("dk,dv,gdn", NO_COPY_WIDTHS + PADDED_WIDTHS)
  def test_matches_naive(self, dk, dv, gdn):
    """o, final state and all six gradients, with and without the pad copy."""
    x = make_inputs(11, batch=1, seq_len=self.seq_len, heads=2, dk=dk, dv=dv, gate="mixed",
                    scalar_gate=gdn)
    _assert_matches_naive(self._pallas(lower_bound=LOWER_BOUND), x, 12, TOL[self.backend])

  @pytest.mark.parametrize("dk,dv", [(96, 48), (24, 40)])
  def test_varlen_matches_naive(self, dk, dv):
    """Packed sequences (one shorter than a chunk) at a width run as it is and a padded one."""
    t = self.seq_len
    cu = jnp.asarray([0, 5, t // 2 + 3, t], jnp.int32)
    x = make_inputs(13, batch=1, seq_len=t, heads=2, dk=dk, dv=dv, num_states=3)
    _assert_matches_naive(self._pallas(lower_bound=LOWER_BOUND, cu_seqlens=cu), x, 14,
                          TOL[self.backend], cu_seqlens=cu)

  def test_pairwise_without_copy(self):
    """The pairwise diagonal at K, V = 96, 48 (its level products per 64 + 32 K slice)."""
    x = make_inputs(25, batch=1, seq_len=self.seq_len, heads=2, dk=96, dv=48, gate="mixed")
    _assert_matches_naive(self._pallas(diagonal="pairwise"), x, 26, TOL[self.backend])

  def test_fused_gate_without_copy(self):
    """The gate activation fused into the gate cumsums (g the pre-activation,
    an [H, K] bias) at K, V = 96, 48, against the naive form of the same options."""
    x = make_inputs(29, batch=1, seq_len=self.seq_len, heads=2, dk=96, dv=48)
    x.g = jax.random.normal(jax.random.key(30), x.q.shape)
    gate = dict(gate_activation="bounded_sigmoid", lower_bound=LOWER_BOUND,
                gate_bias=0.5 * jax.random.normal(jax.random.key(31), (2, 96)))
    naive = functools.partial(api.chunk_kda, implementation="naive", **gate)
    _assert_matches_naive(self._pallas(**gate), x, 32, TOL[self.backend], naive=naive)


class TestHeadWidthsInterpret(HeadWidthChecks):
  interpret = True
  backend = "interpret"
  seq_len = 40   # not a multiple of the chunk
  chunk = 16   # = sub_chunk: the GPU's sliced bodies


@pytest.mark.gpu
class TestHeadWidthsGpu(HeadWidthChecks):
  interpret = False
  backend = "triton"
  seq_len = 300
  chunk = 64

  def test_whole_tile_bodies_pad(self):
    """sub_chunk = 8 on the GPU takes the whole-tile bodies, which pad 48 to 64.

    (At f32 and K = V = 128, 96 padded included, the one-program backward asks
    for 288 KiB of shared memory, more than the H200's 227 KiB: a limit of
    that body, not of the padding.)"""
    x = make_inputs(27, batch=1, seq_len=self.seq_len, heads=2, dk=48, dv=48, gate="mixed")
    _assert_matches_naive(self._pallas(sub_chunk=8, lower_bound=LOWER_BOUND), x, 28,
                          TOL[self.backend])

  @pytest.mark.parametrize("dk,dv", [(128, 48), (128, 96), (128, 192), (96, 96), (48, 80),
                                     (192, 64)])
  def test_bf16_issue_widths(self, dk, dv):
    """bf16 at widths run as they are (multiples of 16) against the f32
    recurrence, forward and VJP."""
    x = make_inputs(15, batch=1, seq_len=512, heads=2, dk=dk, dv=dv, dtype=jnp.bfloat16)
    do = jax.random.normal(jax.random.key(16), x.v.shape, jnp.bfloat16)

    def run(fn, xs, do):
      o, vjp = jax.vjp(lambda *a: fn(*a)[0], *xs)
      return o, vjp(do)
    pallas = functools.partial(api.chunk_kda, implementation="pallas", lower_bound=LOWER_BOUND)
    o, grads = jax.jit(functools.partial(run, pallas))(x.args(), do)
    f32 = tuple(a.astype(jnp.float32) for a in x.args())
    o_r, grads_r = jax.jit(functools.partial(run, reference.naive_recurrent_kda))(
        f32, do.astype(jnp.float32))
    assert rel_err(o, o_r, jnp.bfloat16) < 5e-3
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, grads_r):
      err = rel_err(a.astype(jnp.float32), r, jnp.bfloat16)
      assert err < 1e-2, f"{name}: {err:.2e}"


def test_tpu_path_pads_to_lane_tiles():
  """The TPU lowering (`tpu_interpret`: its semantics on the CPU) at H = 2 and
  K, V = 96, 48, which it runs padded to 128 (Mosaic's lane tile), fixed
  length off the chunk grid."""
  x = make_inputs(23, batch=1, seq_len=40, heads=2, dk=96, dv=48, gate="mixed")
  assert head_pad.padded_widths(96, 48, "tpu_interpret", heads=2) == (128, 128)
  spec = KdaSpec(chunk_size=16, lower_bound=LOWER_BOUND, implementation="pallas")
  tpu = functools.partial(pallas_op.chunk_kda_pallas, spec=spec, backend="tpu_interpret")
  _assert_matches_naive(tpu, x, 24, TOL["interpret"])


def test_padded_widths():
  """Powers of two stay as they are; on the GPU multiples of 16 too (others
  round up to one), unless the bodies take whole tiles (sub_chunk < 16); on
  TPU with H > 1 a multiple of 128."""
  assert head_pad.padded_widths(128, 128, "triton") == (128, 128)
  assert head_pad.padded_widths(64, 8, "interpret") == (64, 8)
  assert head_pad.padded_widths(96, 96, "triton") == (96, 96)
  assert head_pad.padded_widths(48, 96, "triton", heads=16) == (48, 96)
  assert head_pad.padded_widths(100, 20, "triton") == (112, 32)
  assert head_pad.padded_widths(96, 40, "triton", sliced=False) == (128, 64)
  assert head_pad.padded_widths(192, 200, "tpu") == (256, 256)
  assert head_pad.padded_widths(96, 48, "tpu") == (128, 64)
  assert head_pad.padded_widths(32, 96, "tpu", heads=2) == (128, 128)
  assert head_pad.padded_widths(256, 64, "tpu_interpret", heads=4) == (256, 128)
  assert head_pad.padded_widths(8, 3, "triton") == (16, 8)
  assert head_pad.padded_widths(8, 3, "interpret") == (8, 8)
  assert head_pad.padded_widths(512, 1024, "triton") == (512, 1024)
  assert head_pad.padded_widths(320, 96, "triton") == (320, 96)


def test_sliced_bodies_follow_the_config():
  """The GPU's blocked forward with the split backward slice the widths; the
  whole-tile bodies (sub_chunk < 16, an override, TPU) do not."""
  assert kernel_config.sliced_bodies("triton", 16)
  assert kernel_config.sliced_bodies("interpret", 32)
  assert not kernel_config.sliced_bodies("triton", 8)
  assert not kernel_config.sliced_bodies("interpret", 16, {"intra_bwd": "tiles"})
  assert not kernel_config.sliced_bodies("triton", 16, {"inverse": "substitution"})
  assert not kernel_config.sliced_bodies("tpu", 16)


def _primitives(jaxpr) -> set[str]:
  """Names of every primitive in a jaxpr and its sub-jaxprs (pallas kernels not entered)."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    if eqn.primitive.name == "pallas_call":
      continue
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= _primitives(sub)
  return names


@pytest.mark.parametrize("dk,dv,sub_chunk,padded", [(96, 96, 16, False), (48, 80, 16, False),
                                                    (96, 96, 8, True), (40, 80, 16, True)])
def test_pad_copy_only_where_needed(dk, dv, sub_chunk, padded):
  """The forward and VJP of the op at K, V (T on the chunk grid) pad and
  slice the head widths only where the kernels cannot run them: at multiples
  of 16 with the sliced bodies nothing is copied."""
  x = make_inputs(19, batch=1, seq_len=32, heads=2, dk=dk, dv=dv)
  fn = functools.partial(api.chunk_kda, implementation="pallas", interpret=True,
                         chunk_size=16, sub_chunk=sub_chunk, lower_bound=LOWER_BOUND)
  xs = (*x.args(), x.h0)
  prims = _primitives(jax.make_jaxpr(functools.partial(_fwd_vjp, fn))(xs, x.v, x.h0).jaxpr)
  assert "pallas_call" in prims
  assert ("pad" in prims) == padded


def test_pad_heads_is_identity_at_kernel_widths():
  """No pad or slice op is added at kernel widths (the same program as before)."""
  x = make_inputs(17, batch=1, seq_len=8, heads=1, dk=16, dv=16)
  out = head_pad.pad_heads(x.q, x.k, x.v, x.g, x.h0, 16, 16)
  assert all(a is b for a, b in zip(out, (x.q, x.k, x.v, x.g, x.h0)))
  o, ht = head_pad.unpad_outputs(x.v, x.h0, 16, 16)
  assert o is x.v and ht is x.h0


def test_rejects_wide_odd_widths():
  """A width the kernels cannot run and the op does not pad: the error says
  why and names the fixes."""
  x = make_inputs(18, batch=1, seq_len=16, heads=1, dk=16, dv=300)
  with pytest.raises(ValueError, match="V = 300 is neither a power of two nor a multiple of 16"
                     ".*pad head widths up to 256 only.*implementation='xla'"):
    api.chunk_kda(*x.args(), implementation="pallas", interpret=True, chunk_size=16,
                  lower_bound=LOWER_BOUND)
  np.testing.assert_equal(head_pad.MAX_PADDED_WIDTH, 256)


@pytest.mark.parametrize("backend,dk,overrides,why", [
    ("interpret", 96, {"intra_bwd": "tiles"}, "K = 96 is not a power of two, which the "
     "substitution inverse and the one-program intra backward"),
    ("triton", 40, {}, "K = 40 is neither a power of two nor a multiple of 16"),
    ("tpu_interpret", 96, {}, "K = 96 is not a power of two"),
])
def test_make_config_names_the_width_rule(backend, dk, overrides, why):
  """Called directly (without chunk_kda's padding) the config says which rule a width breaks."""
  with pytest.raises(ValueError, match=why + ".*chunk_kda zero-pads"):
    kernel_config.make_config(backend=backend, dtype=jnp.float32, head_k=dk, head_v=64,
                              chunk_size=64, sub_chunk=16, overrides=overrides)
  with pytest.raises(ValueError, match="V = 64 is not a multiple of 128 at H = 2"):
    kernel_config.make_config(backend="tpu", dtype=jnp.float32, head_k=128, head_v=64,
                              chunk_size=64, sub_chunk=16, heads=2)


def test_slice_defaults_at_multiples_of_16():
  """In-kernel K slices of at most 64, widest first (64 + 32 at K = 96); the
  tiles that are grid axes (bwd_block_k, block_v) are the largest power of
  two dividing the width, capped as at powers of two; the intra backward
  takes the input dtype from 96 x 96."""
  make = lambda dk, dv: kernel_config.make_config(
      backend="triton", dtype=jnp.bfloat16, head_k=dk, head_v=dv, chunk_size=64, sub_chunk=16,
      state_programs=64)
  cfg = make(96, 96)
  assert (cfg.block_k, cfg.bwd_block_k, cfg.block_v) == (64, 32, 32)
  assert cfg.rec_block_v is None and cfg.bwd_block_v is None
  assert cfg.intra_bwd_mm_dtype == jnp.bfloat16
  cfg = make(48, 80)
  assert (cfg.block_k, cfg.bwd_block_k, cfg.block_v) == (32, 16, 16)
  assert cfg.intra_bwd_mm_dtype == jnp.float32
  assert (make(192, 64).block_k, make(192, 64).bwd_block_k) == (64, 32)
  assert make(64, 128).intra_bwd_mm_dtype == jnp.float32    # as before: 64 x 128 is f32
  slices = lambda n, cap=None: [(s.start, s.size) for s in kernel_common.width_slices(n, cap)]
  assert slices(96, 64) == [(0, 64), (64, 32)] and slices(96, 32) == [(0, 32), (32, 32), (64, 32)]
  assert slices(80) == [(0, 64), (64, 16)] and slices(128, 64) == [(0, 64), (64, 64)]
  assert slices(128) == [(0, 128)]


def test_block_k_may_leave_a_narrower_slice():
  """At a K that is not a power of two block_k only caps the slices; the
  split backward's grid slice must still divide K."""
  make = lambda **kw: kernel_config.make_config(
      backend="triton", dtype=jnp.bfloat16, head_k=96, head_v=96, chunk_size=64, sub_chunk=16,
      overrides=kw)
  assert make(block_k=32).block_k == 32
  with pytest.raises(ValueError, match="block_k must be a power of two at most K=96"):
    make(block_k=128)
  with pytest.raises(ValueError, match="bwd_block_k must be a power of two dividing K=96"):
    make(bwd_block_k=64)
