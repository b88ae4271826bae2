"""The pairwise diagonal's own kernels (`kernel_diag`, `KernelConfig.diag_kernels`).

`diag_scores` against the pair decay formed in float64; the whole op (forward,
final state, all six gradients) with the tiles in their own kernels against
the same op with the levels inside the intra-chunk kernels and against the
naive recurrence, for unbounded gates (a softplus baseline's, with steps of
-40 that no anchored product could take); the config's default and check.
Interpret mode on the CPU, the `gpu` twin on the GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import api
from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import kernel_diag
from pallas_kernels.kda import reference
from tests.kda_inputs import make_inputs, rel_err, rel_max

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _unbounded_gates(key, shape):
  """-softplus(3 z) per step, with one step in eight at -40 (far past any bound)."""
  k1, k2 = jax.random.split(key)
  g = -jax.nn.softplus(3.0 * jax.random.normal(k1, shape))
  return jnp.where(jax.random.bernoulli(k2, 0.125, shape), -40.0, g)


@pytest.mark.parametrize("diag_rows,loop", [(None, False), (8, False), (16, True)])
def test_diag_scores_are_the_pair_decay_tiles(diag_rows, loop):
  """Both compact tiles, two chunks of four L = 8 tiles, K = 32 in slices of
  16; one chunk, one tile or two tiles per program; levels unrolled or in a
  loop."""
  b, h, c, ell, dk, nc = 1, 2, 32, 8, 32, 2
  tp = nc * c
  ks = jax.random.split(jax.random.key(0), 4)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, tp, h, dk)))
  k = unit(jax.random.normal(ks[1], (b, tp, h, dk)))
  g = _unbounded_gates(ks[2], (b, nc, c, h, dk))
  g_cum = jnp.cumsum(g, axis=2).reshape(b, tp, h, dk)
  beta = jax.nn.sigmoid(jax.random.normal(ks[3], (b, tp, h)))
  cfg = kernel_config.make_config(backend="interpret", dtype=jnp.float32, head_k=dk, head_v=dk,
                                  chunk_size=c, sub_chunk=ell,
                                  overrides={"block_k": 16, "diag_rows": diag_rows,
                                             "diag_level_loop": loop})
  scale = 0.3
  d_qk, d_kk = kernel_diag.diag_scores(
      q.reshape(b, tp, -1), k.reshape(b, tp, -1), g_cum.reshape(b, tp, -1),
      jnp.transpose(beta, (0, 2, 1))[..., None], heads=h, chunk_size=c, sub_chunk=ell,
      scale=scale, cfg=cfg)
  qn, kn, gn, bn = (np.asarray(x, np.float64) for x in (q, k, g_cum, beta))
  want_qk = np.zeros((b, h, tp, ell))
  want_kk = np.zeros((b, h, tp, ell))
  for ih in range(h):
    for i in range(tp):
      t0 = i - i % ell
      for j in range(t0, i + 1):
        decay = np.exp(gn[0, i, ih] - gn[0, j, ih])
        want_qk[0, ih, i, j - t0] = scale * np.sum(qn[0, i, ih] * kn[0, j, ih] * decay)
        if j < i:
          want_kk[0, ih, i, j - t0] = bn[0, i, ih] * np.sum(kn[0, i, ih] * kn[0, j, ih] * decay)
  assert rel_max(d_qk, want_qk) < 1e-5
  assert rel_max(d_kk, want_kk) < 1e-5


def _unbounded_case(seed: int, seq_len: int, *, gdn: bool = False):
  """(inputs with the initial state, do, dht) of an f32 B1 H2 K32 V16 case whose
  gates are unbounded (`_unbounded_gates`, key seed + 1; do and dht from seed + 2)."""
  x = make_inputs(seed, batch=1, seq_len=seq_len, heads=2, dk=32, dv=16, scalar_gate=gdn)
  x.g = _unbounded_gates(jax.random.key(seed + 1), x.g.shape)
  k1, k2 = jax.random.split(jax.random.key(seed + 2))
  return (*x.args(), x.h0), jax.random.normal(k1, x.v.shape), jax.random.normal(k2, x.h0.shape)


def _vjp(fn, xs, do, dht):
  def run(xs, do, dht):
    out, vjp = jax.vjp(lambda *a: fn(*a[:5], initial_state=a[5], output_final_state=True), *xs)
    return out, vjp((do, dht))
  return jax.jit(run)(xs, do, dht)


# Layouts of the two kernels: the defaults at L = 16 (rows per program: one
# tile for the scores, a chunk for the gradients; levels unrolled), then rows
# the other way round with the levels in a loop (the default from L = 32).
_ROWS = ({}, {"diag_rows": None, "diag_bwd_rows": 16, "diag_level_loop": True})


@pytest.mark.parametrize("gdn,rows", [(False, _ROWS[0]), (True, _ROWS[0]), (False, _ROWS[1])])
def test_own_kernels_equal_the_levels_in_the_intra_kernels(gdn, rows):
  """T = 72 on C = 32 (off the grid), L = 16 (levels 8, 4, 2, 1), K = 32 in
  slices of 16: the op with `diag_kernels` (each kernel at a chunk or one
  tile per program) against the op without it and against the naive
  recurrence, f32, unbounded gates."""
  xs, do, dht = _unbounded_case(1, 72, gdn=gdn)

  def pallas(diag_kernels):
    return functools.partial(api.chunk_kda, implementation="pallas", interpret=True,
                             chunk_size=32, sub_chunk=16, diagonal="pairwise",
                             config_overrides=dict(diag_kernels=diag_kernels, block_k=16,
                                                   bwd_block_k=16,
                                                   **(rows if diag_kernels else {})))

  own = _vjp(pallas(True), xs, do, dht)
  inside = _vjp(pallas(False), xs, do, dht)
  naive = _vjp(reference.naive_recurrent_kda, xs, do, dht)
  names = ("o", "ht") + GRAD_NAMES
  for name, a, r, n in zip(names, jax.tree.leaves(own), jax.tree.leaves(inside),
                           jax.tree.leaves(naive)):
    assert rel_err(a, r, jnp.float32) < 2e-6, name
    assert rel_err(a, n, jnp.float32) < 2e-5, name


def test_wide_tiles_at_their_defaults():
  """L = 32 (the decay ablation's tile-32 arm) at its defaults, where the
  diagonal kernels loop over their five levels: the op against the naive
  recurrence, f32, unbounded gates, T = 100 on C = 64 (off the grid)."""
  xs, do, dht = _unbounded_case(5, 100)
  cfg = kernel_config.make_config(backend="interpret", dtype=jnp.float32, head_k=32, head_v=16,
                                  chunk_size=64, sub_chunk=32)
  assert cfg.diag_kernels and cfg.diag_level_loop
  own = _vjp(functools.partial(api.chunk_kda, implementation="pallas", interpret=True,
                               chunk_size=64, sub_chunk=32, diagonal="pairwise"), xs, do, dht)
  naive = _vjp(reference.naive_recurrent_kda, xs, do, dht)
  for name, a, n in zip(("o", "ht") + GRAD_NAMES, jax.tree.leaves(own), jax.tree.leaves(naive)):
    assert rel_err(a, n, jnp.float32) < 2e-5, name


def test_default_and_check():
  make = functools.partial(kernel_config.make_config, dtype=jnp.bfloat16, head_k=128,
                           head_v=128, chunk_size=64)
  assert make(backend="triton", sub_chunk=16).diag_kernels
  assert make(backend="interpret", sub_chunk=32).diag_kernels
  assert not make(backend="interpret", sub_chunk=8).diag_kernels      # substitution body
  assert not make(backend="tpu", sub_chunk=16).diag_kernels
  # A body that forms its own tiles turns them off unless they are asked for.
  assert not make(backend="triton", sub_chunk=16,
                  overrides={"inverse": "substitution"}).diag_kernels
  with pytest.raises(ValueError, match="diag_kernels=True needs inverse='blocked'"):
    make(backend="interpret", sub_chunk=16,
         overrides={"intra_bwd": "tiles", "diag_kernels": True})
  # One tile per score program, a chunk per gradient program; from L = 32
  # the levels in a loop, more warps and (at 64) narrower K slices.
  for ell, loop, warps, width in ((16, False, (2, 4), 64), (32, True, (4, 8), 64),
                                  (64, True, (8, 8), 32)):
    cfg = make(backend="triton", sub_chunk=ell)
    assert (cfg.diag_rows, cfg.diag_bwd_rows) == (ell, None)
    assert (cfg.diag_level_loop, cfg.diag_block_k) == (loop, width), ell
    assert (dict(cfg.num_warps)["diag_fwd"], dict(cfg.num_warps)["diag_bwd"]) == warps, ell
    # A block_v override resets the state kernels' warps, not these.
    cfg = make(backend="triton", sub_chunk=ell, overrides={"block_v": 32})
    assert (dict(cfg.num_warps)["diag_fwd"], dict(cfg.num_warps)["diag_bwd"]) == warps, ell
  for name in ("diag_rows", "diag_bwd_rows"):
    for rows in (8, 24, 128):
      with pytest.raises(ValueError, match=f"{name} must be None or a multiple of sub_chunk=16 "
                                           "dividing chunk_size=64"):
        make(backend="triton", sub_chunk=16, overrides={name: rows})


@pytest.mark.gpu
@pytest.mark.parametrize("sub_chunk,rows", [(16, _ROWS[0]), (16, _ROWS[1]), (32, {})])
def test_gpu_bf16_own_kernels_against_the_f32_recurrence(sub_chunk, rows):
  """bf16 at B1 T1024 H4 K = V = 128 with unbounded gates, L = 16 (each
  kernel at a chunk or one tile per program, levels unrolled or looped) and
  L = 32 (its defaults): the error bounds of the dense diagonal's twin (o 5e-3,
  gradients 1e-2), and within bf16 noise of the levels inside the
  intra-chunk kernels."""
  x = make_inputs(4, batch=1, seq_len=1024, heads=4, dk=128, dv=128, dtype=jnp.bfloat16)
  g = _unbounded_gates(jax.random.key(5), x.g.shape)
  args = (x.q, x.k, x.v, g, x.beta)
  do = jax.random.normal(jax.random.key(6), x.v.shape, jnp.bfloat16)

  def run(fn, args, do):
    o, vjp = jax.vjp(lambda *a: fn(*a)[0], *args)
    return o, vjp(do)

  def pallas(diag_kernels):
    return functools.partial(api.chunk_kda, implementation="pallas", diagonal="pairwise",
                             sub_chunk=sub_chunk,
                             config_overrides={"diag_kernels": diag_kernels,
                                               **(rows if diag_kernels else {})})

  own = jax.jit(functools.partial(run, pallas(True)))(args, do)
  inside = jax.jit(functools.partial(run, pallas(False)))(args, do)
  f32 = tuple(a.astype(jnp.float32) for a in args)
  want = jax.jit(functools.partial(run, reference.naive_recurrent_kda))(f32,
                                                                        do.astype(jnp.float32))
  names = ("o", "dq", "dk", "dv", "dg", "dbeta")
  for name, a, r, w in zip(names, jax.tree.leaves(own), jax.tree.leaves(inside),
                           jax.tree.leaves(want)):
    err = rel_err(a.astype(jnp.float32), w, jnp.bfloat16)
    assert err < (5e-3 if name == "o" else 1e-2), f"{name}: {err:.2e}"
    base = rel_err(r.astype(jnp.float32), w, jnp.bfloat16)
    assert err < 1.25 * base + 1e-3, f"{name}: {err:.2e} against {base:.2e} inside"
