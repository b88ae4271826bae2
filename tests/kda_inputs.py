"""Fresh random KDA inputs and dtype-keyed tolerances shared by the KDA tests."""
from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda import kernel_config, kernel_intra_bwd, kernel_intra_bwd_split
from pallas_kernels.kda.spec import KdaSpec

# Relative tolerance per compute dtype for ||a - b|| / ||b|| (relative L2) of
# two exact-arithmetic-equivalent forms. Reductions grow with T; the factor
# below scales by sqrt of the number of chunks crossed.
RTOL = {jnp.dtype(jnp.float64): 1e-11, jnp.dtype(jnp.float32): 2e-5,
        jnp.dtype(jnp.bfloat16): 1e-2}


def rtol_for(dtype, seq_len: int, chunk: int = 64) -> float:
  return RTOL[jnp.dtype(dtype)] * max(1.0, (seq_len / chunk) ** 0.5)


_STATIC = ("scale", "output_final_state", "chunk_size", "lower_bound", "diagonal",
           "sub_chunk", "implementation", "interpret")


def jitted(fn):
  """`fn` under jit with the KDA configuration arguments static.

  Tests call the references through this: one compilation per shape instead
  of op-by-op dispatch, which keeps the CPU suite fast.
  """
  params = inspect.signature(fn).parameters
  # KdaSpec's fields arrive as **spec_fields where a function builds its spec from keywords.
  takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
  return functools.wraps(fn)(jax.jit(fn, static_argnames=[
      n for n in _STATIC if n in params or takes_any]))


@dataclasses.dataclass
class KdaInputs:
  q: jax.Array
  k: jax.Array
  v: jax.Array
  g: jax.Array
  beta: jax.Array
  h0: jax.Array

  def args(self):
    return self.q, self.k, self.v, self.g, self.beta


def make_inputs(seed: int, *, batch=2, seq_len=65, heads=2, dk=16, dv=8, g_min=-5.0,
                scalar_gate=False, gate="near", dtype=jnp.float32, num_states=None) -> KdaInputs:
  """Unit-norm q/k, gates g = g_min * sigmoid(N(0,1)) ("near"), g == g_min
  ("at"), or a mix of both ("mixed"); beta in (0, 1); a random initial state."""
  keys = jax.random.split(jax.random.key(seed), 7)
  shape = (batch, seq_len, heads, dk)

  def unit(key):
    x = jax.random.normal(key, shape, jnp.float32)
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

  gshape = (batch, seq_len, heads) if scalar_gate else shape
  near = g_min * jax.nn.sigmoid(jax.random.normal(keys[3], gshape))
  if gate == "near":
    g = near
  elif gate == "at":
    g = jnp.full(gshape, g_min)
  else:
    g = jnp.where(jax.random.bernoulli(keys[6], 0.5, gshape), g_min, near)
  n = batch if num_states is None else num_states
  cast = lambda x: x.astype(dtype)
  return KdaInputs(
      q=cast(unit(keys[0])), k=cast(unit(keys[1])),
      v=cast(jax.random.normal(keys[2], (batch, seq_len, heads, dv))),
      g=g.astype(jnp.promote_types(dtype, jnp.float32)),
      beta=cast(jax.nn.sigmoid(jax.random.normal(keys[4], (batch, seq_len, heads)))),
      h0=jax.random.normal(keys[5], (n, heads, dk, dv)).astype(jnp.promote_types(dtype, jnp.float32)))


def rel_l2(actual, expected) -> float:
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def assert_close(actual, expected, tol, what=""):
  err = rel_l2(actual, expected)
  assert np.all(np.isfinite(np.asarray(actual, np.float64))), f"{what}: non-finite values"
  assert err <= tol, f"{what}: relative L2 error {err:.3e} > {tol:.1e}"
  return err


def rel_max(x, ref) -> float:
  """max|x - ref| / max|ref| in float64; fails on non-finite x (unwritten output)."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  assert np.all(np.isfinite(x)), "non-finite values (unwritten output?)"
  return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def rel_err(x, ref, dtype) -> float:
  """`rel_max` for float32 `dtype`, `rel_l2` otherwise; fails on non-finite x
  (an unwritten output) either way."""
  x = jnp.asarray(x, jnp.float32)
  if jnp.dtype(dtype) == jnp.float32:
    return rel_max(x, ref)
  assert np.all(np.isfinite(np.asarray(x, np.float64))), "non-finite values (unwritten output?)"
  return rel_l2(x, ref)


def pallas_spec(**fields) -> KdaSpec:
  """The KdaSpec of a direct `chunk_kda_pallas` call: `fields`, the bound of
  `bounded_gates` (-5) unless given."""
  return KdaSpec(**{"lower_bound": -5.0, "implementation": "pallas", **fields})


def bounded_gates(key, shape, at_bound: bool, g_min: float = -5.0):
  """g_min * sigmoid(.): at the bound (sigmoid(6 + z)) or spread (sigmoid(2 z))."""
  z = jax.random.normal(key, shape)
  return g_min * jax.nn.sigmoid(6.0 + z if at_bound else 2.0 * z)


def intra_bwd_operands(seed: int, *, b: int, h: int, nc: int, c: int, dk: int, dv: int):
  """Random operands of the intra backward kernels in their layout (f32).

  q, k unit-norm [B, Tp, H*K]; v [B, Tp, H*V]; within-chunk cumsum of gates
  off the bound [B, Tp, H*K]; beta [B, H, Tp, 1]; dO, V', dV' [B, Tp, H*V];
  entry states and exit-state gradients [B, H, NC*K, V]; M unit lower
  triangular [B, H, Tp, C] (any such matrix exercises the algebra). Gates stay
  off the bound: two f32 summation orders of the e^{|g_min| (L-1)} dense
  diagonal factors differ by ~2e-5 of dG's max at the bound.
  """
  tp = nc * c
  ks = jax.random.split(jax.random.PRNGKey(seed), 11)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, tp, h, dk))).reshape(b, tp, h * dk)
  k = unit(jax.random.normal(ks[1], (b, tp, h, dk))).reshape(b, tp, h * dk)
  v = jax.random.normal(ks[2], (b, tp, h * dv))
  g = bounded_gates(ks[3], (b, nc, c, h * dk), at_bound=False)
  g_cum = jnp.cumsum(g, axis=2).reshape(b, tp, h * dk)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, h, tp, 1)))
  do = jax.random.normal(ks[5], (b, tp, h * dv))
  hs = jax.random.normal(ks[6], (b, h, nc * dk, dv))
  dhs = jax.random.normal(ks[7], (b, h, nc * dk, dv))
  v_new = jax.random.normal(ks[8], (b, tp, h * dv))
  dv_new = jax.random.normal(ks[9], (b, tp, h * dv))
  low = jnp.tril(0.3 * jax.random.normal(ks[10], (b, h, nc, c, c)), -1)
  m = (low + jnp.eye(c)).reshape(b, h, tp, c)
  return q, k, v, g_cum, beta, do, hs, dhs, v_new, dv_new, m


def intra_bwd_by_impl(operands, impls, *, heads: int, chunk: int, sub_chunk: int,
                      diagonal: str = "dense", **overrides) -> dict:
  """{impl: IntraBwdOut} of the interpret-mode intra backward for each body
  ("split", "tiles"; `KernelConfig.intra_bwd`)."""
  q, v = operands[0], operands[2]
  dk, dv = q.shape[-1] // heads, v.shape[-1] // heads
  outs = {}
  for impl in impls:
    cfg = kernel_config.make_config(backend="interpret", dtype=jnp.float32, head_k=dk,
                                    head_v=dv, chunk_size=chunk, sub_chunk=sub_chunk,
                                    overrides=dict(intra_bwd=impl, **overrides))
    body = (kernel_intra_bwd_split.intra_bwd_split if impl == "split"
            else kernel_intra_bwd.intra_bwd_tiles)
    fn = jax.jit(functools.partial(body, heads=heads, chunk_size=chunk,
                                   sub_chunk=sub_chunk, diagonal=diagonal, scale=dk ** -0.5,
                                   cfg=cfg))
    outs[impl] = fn(*operands)
  return outs


def vjp_inputs(seed: int, *, b: int, t: int, h: int, dk: int, dv: int, gates: str,
               num_states: int | None = None):
  """(q, k, v, g, beta, h0), dO and the final-state cotangent, f32, [B, T, H, *] layout.

  gates: "at_bound" (per-channel KDA gates at g_min), "spread" (per-channel,
  spread over (g_min, 0)) or "gdn" (one gate per head, spread, broadcast over
  K). num_states: rows of h0 and of the cotangent (default B; the number of
  sequences with cu_seqlens).
  """
  n = b if num_states is None else num_states
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, t, h, dk)))
  k = unit(jax.random.normal(ks[1], (b, t, h, dk)))
  v = jax.random.normal(ks[2], (b, t, h, dv))
  if gates == "gdn":
    g = jnp.broadcast_to(bounded_gates(ks[3], (b, t, h, 1), at_bound=False), (b, t, h, dk))
  elif gates in ("at_bound", "spread"):
    g = bounded_gates(ks[3], (b, t, h, dk), at_bound=gates == "at_bound")
  else:
    raise ValueError(f"gates must be 'at_bound', 'spread' or 'gdn', got {gates!r}")
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
  h0 = jax.random.normal(ks[5], (n, h, dk, dv))
  do = jax.random.normal(ks[6], (b, t, h, dv))
  dht = jax.random.normal(ks[7], (n, h, dk, dv))
  return (q, k, v, g, beta, h0), do, dht


def state_loss_grads(fn, xs, do, dht):
  """Jitted gradients of sum(o * dO) + sum(h_T * dht) w.r.t. xs = (q, k, v, g, beta, h0)."""
  def loss(*xs):
    o, ht = fn(*xs[:5], initial_state=xs[5], output_final_state=True)
    return jnp.sum(o * do) + jnp.sum(ht * dht)
  return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*xs)


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def assert_each_within(got, want, names, tol: float, label: str = ""):
  """Each pair has the same shape and rel_max(got, want) < tol; the message names the worst."""
  for name, a, r in zip(names, got, want):
    assert a.shape == r.shape, f"{label} {name}: shape {a.shape} != {r.shape}"
    err = rel_max(a, r)
    assert err < tol, f"{label} {name}: {err:.2e}"
