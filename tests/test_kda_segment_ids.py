"""`chunk_kda(segment_ids=...)`: the state restarts at every run of equal ids, by masks
inside the chunks of the plain grid (`tiling.RunMasks`), on every implementation.

Rows of T = 45 on chunks of 16: runs start in the middle of a chunk, at its
last position, at a chunk start, runs of one token (one at T - 1), an id
reused by a later run, and a row of one run. Checked against the naive
recurrence in float64 (forward, final states, gradients, the fused gate's
pre-activation and bias), against each run alone and the packed sequences
(`cu_seqlens`), and by perturbation: changing one run's inputs changes no
other run's outputs or gradients. The Pallas cases run interpreted, each
kernel body with the masks: sub-tiles of 8 (substitution inverse, one-program
backward), of 16 (blocked inverse, split backward; the pairwise diagonal's
own kernels), the TPU's bodies (`tpu_interpret`: fused state pass) and the
recomputing backward (`save_residuals=False`). `test_gpu_*` run bf16 on the GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import api
from pallas_kernels.kda import pallas_op
from pallas_kernels.kda import tiling
from pallas_kernels.kda.spec import KdaSpec
from tests.kda_inputs import make_inputs, rel_err, rel_max

LOWER_BOUND = -5.0
T, C, L = 45, 16, 8
# Run starts per row (position 0 implied).
STARTS = ((7, 15, 16, 17, 31, 32, 40), (16, 44), ())
F32_TOL = 2e-5


def _ids(starts=STARTS, length=T):
  """[len(starts), length] int32 ids: run r of a row gets id r % 2 + 1 (ids repeat)."""
  ids = np.zeros((len(starts), length), np.int32)
  for b, row in enumerate(starts):
    run = np.searchsorted(np.asarray(row, int), np.arange(length), side="right")
    ids[b] = run % 2 + 1
  return ids


def _runs(ids_row):
  """[(start, end)] of the runs of one row of ids."""
  edges = [0] + [t for t in range(1, len(ids_row)) if ids_row[t] != ids_row[t - 1]]
  return list(zip(edges, edges[1:] + [len(ids_row)]))


def _inputs(seed, gate="mixed", dtype=jnp.float32):
  return make_inputs(seed, batch=len(STARTS), seq_len=T, heads=2, dk=16, dv=8, gate=gate,
                     dtype=dtype)


# Pallas variants: (sub_chunk, backend, config_overrides).
PALLAS = {"pallas_l8": (8, "interpret", None),
          "pallas_l16": (16, "interpret", {"diag_kernels": True}),
          "pallas_tpu": (8, "tpu_interpret", None),
          "pallas_recompute": (16, "interpret", {"save_residuals": False})}


def _kda(implementation, diagonal="dense", fused=False, sub_chunk=L):
  """chunk_kda(q, k, v, g, beta, **kw) of one implementation (a PALLAS key runs
  the Pallas kernels interpreted)."""
  fields = dict(lower_bound=LOWER_BOUND, diagonal=diagonal, chunk_size=C)
  gate = {"gate_activation": "bounded_sigmoid"} if fused else {}
  if implementation not in PALLAS:
    return functools.partial(api.chunk_kda, implementation=implementation, sub_chunk=sub_chunk,
                             **fields, **gate)
  sub_chunk, backend, overrides = PALLAS[implementation]
  spec = KdaSpec(sub_chunk=sub_chunk, implementation="pallas", **fields)
  return functools.partial(pallas_op.chunk_kda_pallas, spec=spec, backend=backend,
                           config_overrides=overrides, **gate)


@functools.cache
def _fn(implementation, diagonal="dense", fused=False):
  """jit of (q, k, v, g, beta, h0, ids, do, dht[, bias]) -> ((o, ht), grads)."""
  kda = _kda(implementation, diagonal, fused)

  def run(q, k, v, g, beta, h0, ids, do, dht, *bias):
    def f(q, k, v, g, beta, h0, *bias):
      extra = dict(gate_bias=bias[0]) if bias else {}
      return kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                 segment_ids=ids, **extra)
    out, vjp = jax.vjp(f, q, k, v, g, beta, h0, *bias)
    return out, vjp((do.astype(out[0].dtype), dht))
  return jax.jit(run)


def _cotangents(x):
  k1, k2 = jax.random.split(jax.random.key(99))
  return jax.random.normal(k1, x.v.shape), jax.random.normal(k2, x.h0.shape)


def _naive64(x, ids, do, dht, *bias):
  """The naive recurrence's outputs and gradients in float64."""
  with jax.enable_x64(True):
    cast = lambda a: jnp.asarray(np.asarray(a, np.float64))
    args = [cast(a) for a in (*x.args(), x.h0)]
    out = _fn("naive", fused=bool(bias))(*args, jnp.asarray(ids), cast(do), cast(dht),
                                         *(cast(b) for b in bias))
    return jax.tree.map(lambda a: np.asarray(a, np.float64), out)


def test_run_masks_of_a_chunk():
  """Run starts at 2 and 3 in a chunk of 4 entered by run 0; the next chunk starts run 3."""
  masks = tiling.run_masks(jnp.asarray([[5, 5, 6, 7, 8, 8]]), 4)
  np.testing.assert_array_equal(masks.carry_bnc[0], [[1, 1, 0, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(masks.last_bnc[0], [[0, 0, 0, 1], [1, 1, 1, 1]])
  np.testing.assert_array_equal(masks.same_bncc[0, 0, 1], [1, 1, 0, 0])
  np.testing.assert_array_equal(masks.same_bncc[0, 1, 0], [1, 1, 1, 1])  # padding: last run


@pytest.mark.parametrize("implementation,diagonal,gate", [
    ("xla", "dense", "at"), ("xla", "dense", "mixed"), ("xla", "pairwise", "mixed"),
    ("pallas_l8", "dense", "at"), ("pallas_l16", "pairwise", "mixed"),
    ("pallas_tpu", "dense", "mixed"), ("pallas_recompute", "dense", "at")])
def test_outputs_and_gradients_match_the_naive_recurrence(implementation, diagonal, gate):
  """float32 chunked against float64 naive: o, final states, dq, dk, dv, dg, dbeta, dh0."""
  x = _inputs(1, gate=gate)
  ids = _ids()
  do, dht = _cotangents(x)
  got = _fn(implementation, diagonal)(*x.args(), x.h0, ids, do, dht)
  ref = _naive64(x, ids, do, dht)
  names = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")
  for name, a, r in zip(names, jax.tree.leaves(got), jax.tree.leaves(ref)):
    err = rel_max(a, r)
    assert err < F32_TOL, f"{name}: {err:.2e}"
  # Without the restarts the outputs fail the tolerance a hundredfold (gates
  # at the bound forget within a few tokens, so by less than a plain O(1)).
  plain = api.chunk_kda(*x.args(), initial_state=x.h0, implementation="naive")[0]
  assert rel_max(plain, ref[0][0]) > 100 * F32_TOL


@pytest.mark.parametrize("implementation", ["xla", "pallas_l16"])
def test_fused_gate_gradients_match_the_naive_recurrence(implementation):
  """The bounded gate's pre-activation and bias (on the Pallas path formed in the
  gate-cumsum kernels): their gradients through the masks."""
  x = _inputs(2)
  pre = jax.random.normal(jax.random.key(3), x.g.shape)
  bias = 0.5 * jax.random.normal(jax.random.key(4), (2, 16))
  ids = _ids()
  do, dht = _cotangents(x)
  x.g = pre
  got = _fn(implementation, fused=True)(*x.args(), x.h0, ids, do, dht, bias)
  ref = _naive64(x, ids, do, dht, bias)
  for i, (a, r) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(ref))):
    assert rel_max(a, r) < F32_TOL, i


@pytest.mark.parametrize("implementation", ["xla", "pallas_l16"])
def test_runs_equal_runs_alone_and_packed_rows(implementation):
  """The rows laid end to end as one packed sequence (`cu_seqlens` = every run
  start, each starting a chunk of its own) give every output; two runs alone
  (from zeros) give theirs."""
  x = _inputs(5)
  ids = _ids()
  kda = _kda(implementation)
  o = jax.jit(lambda *a: kda(*a, segment_ids=ids)[0])(*x.args())
  cu = [b * T + s for b in range(len(STARTS)) for s, _ in _runs(ids[b])] + [len(STARTS) * T]
  flat = lambda a: a.reshape((1, -1) + a.shape[2:])
  run = jax.jit(lambda *a, cu=None: kda(*a, cu_seqlens=cu)[0])
  packed = run(*(flat(a) for a in x.args()), cu=jnp.asarray(cu))
  assert rel_max(flat(o), packed) < F32_TOL
  for b, start, end in ((0, 17, 31), (1, 44, 45)):
    alone = run(*(a[b:b + 1, start:end] for a in x.args()))
    assert rel_max(o[b, start:end], alone[0]) < F32_TOL, (b, start)


def _assert_isolated(new, old, span, touched):
  """Outside `span` [B, T]: equal to `old` exactly outside the `touched` positions, to
  float32 rounding of their scale on them."""
  new, old = np.asarray(new), np.asarray(old)
  np.testing.assert_array_equal(new[~touched], old[~touched])
  near = touched & ~span
  scale = np.max(np.abs(old))
  assert np.max(np.abs(new[near] - old[near])) <= 1e-6 * scale


@pytest.mark.parametrize("implementation", ["xla", "pallas_l16"])
def test_changing_one_run_changes_no_other(implementation):
  """New q, k, v, g, beta on run [17, 31) of row 0 (chunk 1 holds it and the runs
  [16, 17) and [31, 32)): every other position's output and input gradient is
  unchanged. Exactly outside chunk 1; inside it to rounding only, as the
  chunk's cumulative gates run through the changed run: the same-run decays
  e^{G_i - G_j} there are differences of sums that include its gates (and
  the dense diagonal's factors share a reference row of that run)."""
  x = _inputs(6)
  ids = _ids()
  do, dht = _cotangents(x)
  dht = jnp.zeros_like(dht)   # the final state is the last run's
  fn = _fn(implementation)
  (o, _), grads = fn(*x.args(), x.h0, ids, do, dht)
  y = _inputs(7)
  span = np.zeros((len(STARTS), T), bool)
  span[0, 17:31] = True
  touched = np.zeros_like(span)
  touched[0, 16:32] = True
  sel = lambda a, b: jnp.where(span.reshape(span.shape + (1,) * (a.ndim - 2)), b, a)
  changed = [sel(a, b) for a, b in zip(x.args(), y.args())]
  (o2, _), grads2 = fn(*changed, x.h0, ids, do, dht)
  _assert_isolated(o2, o, span, touched)
  for a, b in zip(grads[:5], grads2[:5]):
    _assert_isolated(b, a, span, touched)
  assert rel_max(o2[0, 17:31], o[0, 17:31]) > 1e-2


def test_bad_segment_ids():
  x = _inputs(8)
  kw = dict(lower_bound=LOWER_BOUND)
  with pytest.raises(ValueError, match="pass one of them"):
    api.chunk_kda(*(a[:1] for a in x.args()), segment_ids=_ids()[:1],
                  cu_seqlens=jnp.asarray([0, T]), **kw)
  with pytest.raises(ValueError, match=r"segment_ids must be an int array \[B, T\]"):
    api.chunk_kda(*x.args(), segment_ids=_ids()[:, :-1], **kw)
  with pytest.raises(ValueError, match=r"segment_ids must be an int array \[B, T\]"):
    api.chunk_kda(*x.args(), segment_ids=_ids().astype(np.float32), **kw)


def _gpu_inputs(seed, b=2, t=1000, h=4, d=128):
  x = make_inputs(seed, batch=b, seq_len=t, heads=h, dk=d, dv=d, gate="mixed",
                  dtype=jnp.bfloat16)
  rng = np.random.default_rng(seed)
  starts = [tuple(sorted(rng.choice(np.arange(1, t), 6, replace=False))) for _ in range(b)]
  starts[0] = starts[0] + (64, 127, 128, 129)   # at, before and after a chunk edge
  return x, _ids([tuple(sorted(set(r))) for r in starts], t)


@pytest.mark.gpu
@pytest.mark.parametrize("diagonal,overrides", [
    ("dense", None), ("pairwise", {"diag_kernels": True}),
    ("dense", {"inverse": "substitution", "intra_bwd": "tiles"})])
def test_gpu_segment_ids_match_the_packed_rows(diagonal, overrides):
  """bf16, C = 64: outputs and all six gradients of the masks against each row
  run as one packed sequence (cu_seqlens, the per-row path), and against the
  f32 naive recurrence (bf16 tolerance); the GPU's default bodies, the
  pairwise diagonal's own kernels, and the substitution inverse with the
  one-program backward."""
  x, ids = _gpu_inputs(11)
  do, dht = (a.astype(jnp.float32) for a in _cotangents(x))
  kw = dict(lower_bound=LOWER_BOUND, diagonal=diagonal, implementation="pallas",
            config_overrides=overrides)

  def masks(*a):
    return api.chunk_kda(*a[:5], initial_state=a[5], output_final_state=True,
                         segment_ids=ids, **kw)

  def rows(*a):
    outs = []
    for b in range(ids.shape[0]):
      cu = jnp.asarray([s for s, _ in _runs(ids[b])] + [ids.shape[1]], jnp.int32)
      init = jnp.concatenate([a[5][b:b + 1], jnp.zeros((len(cu) - 2,) + a[5].shape[1:])])
      o, ht = api.chunk_kda(*(t[b:b + 1] for t in a[:5]), initial_state=init,
                            output_final_state=True, cu_seqlens=cu, **kw)
      outs.append((o, ht[-1:]))
    return (jnp.concatenate([o for o, _ in outs]), jnp.concatenate([h for _, h in outs]))

  def with_vjp(fn):
    def run(*a):
      out, vjp = jax.vjp(fn, *a)
      return out, vjp((do.astype(out[0].dtype), dht))
    return jax.jit(run)(*x.args(), x.h0)

  got, ref = with_vjp(masks), with_vjp(rows)
  for i, (a, r) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(ref))):
    assert rel_err(a, r, jnp.bfloat16) < 1e-2, i
  with jax.default_matmul_precision("highest"):
    naive = jax.jit(lambda *a: api.chunk_kda(
        *(t.astype(jnp.float32) for t in a[:5]), initial_state=a[5], output_final_state=True,
        segment_ids=ids, implementation="naive"))(*x.args(), x.h0)
  for a, r in zip(got[0], naive):
    assert rel_err(a, r, jnp.bfloat16) < 1e-2
