"""Benchmark helpers for the KDA kernels: inputs, timing, roofline, stages.

Used by `experiments/bench_kernels.py`; no timing happens at import.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels.kda import api
from pallas_kernels.kda import kernel_bwd
from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import kernel_fwd
from pallas_kernels.kda import pallas_op


def make_inputs(key, b, t, h, d, dtype=jnp.bfloat16, lower_bound=-5.0):
  """Random KDA inputs as in the peer's benchmark.

  Returns q, k (unit-norm) [B,T,H,D], v [B,T,H,D] in `dtype`,
  g = lower_bound * sigmoid(N(0,1)) [B,T,H,D] f32, beta = sigmoid(N) [B,T,H].
  """
  kq, kk, kv, kg, kb = jax.random.split(key, 5)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(kq, (b, t, h, d))).astype(dtype)
  k = unit(jax.random.normal(kk, (b, t, h, d))).astype(dtype)
  v = jax.random.normal(kv, (b, t, h, d)).astype(dtype)
  g = lower_bound * jax.nn.sigmoid(jax.random.normal(kg, (b, t, h, d)))
  beta = jax.nn.sigmoid(jax.random.normal(kb, (b, t, h))).astype(dtype)
  return q, k, v, g, beta


def time_ms(fn, *args, iters=20, warmup=3):
  """Median wall time in ms of `fn(*args)` (already jitted), synchronised."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


def kda_fn(implementation, diagonal, *, chunk_size=64, sub_chunk=16, lower_bound=-5.0,
           backward=False, config_overrides=None):
  """Jitted forward (or forward+backward) of `api.chunk_kda`.

  config_overrides: KernelConfig fields for the pallas path (then called
  directly, g must be [B, T, H, K]).
  """
  def fwd(q, k, v, g, beta):
    if implementation == "pallas" and config_overrides:
      o, _ = pallas_op.chunk_kda_pallas(q, k, v, g, beta, scale=q.shape[-1] ** -0.5,
                                        chunk_size=chunk_size, sub_chunk=sub_chunk,
                                        diagonal=diagonal, config_overrides=config_overrides)
      return o
    o, _ = api.chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, sub_chunk=sub_chunk,
                         lower_bound=lower_bound, diagonal=diagonal,
                         implementation=implementation)
    return o

  if not backward:
    return jax.jit(fwd)

  def fwd_bwd(q, k, v, g, beta, do):
    o, vjp = jax.vjp(fwd, q, k, v, g, beta)
    return o, vjp(do)

  return jax.jit(fwd_bwd)


@dataclasses.dataclass(frozen=True)
class Ceilings:
  """Measured machine rates: bytes/s (read + write) and bf16 matmul FLOP/s."""
  bandwidth: float
  matmul: float


def measure_ceilings(n_bytes=2 ** 32, mm_size=8192) -> Ceilings:
  """Copy bandwidth of an f32 array and the bf16 matmul rate, measured now."""
  x = jnp.ones((n_bytes // 4,), jnp.float32)
  copy = jax.jit(lambda x: x * 1.0001)
  bw = 2 * n_bytes / (time_ms(copy, x) * 1e-3)
  del x
  a = jnp.ones((mm_size, mm_size), jnp.bfloat16)
  mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
  rate = 2 * mm_size ** 3 / (time_ms(mm, a, a) * 1e-3)
  return Ceilings(bandwidth=bw, matmul=rate)


def kda_cost(b, t, h, d, *, chunk_size=64, in_bytes=2):
  """Minimal bytes and FLOPs of the KDA forward and forward+backward.

  Bytes: q, k, v, o in `in_bytes`, g in f32, beta (forward); the backward
  adds a re-read of the inputs, dO, and dq, dk, dv (in_bytes), dg (f32).
  FLOPs (K = V = d, C = chunk): per chunk and head, the useful halves of
  A_kk and A_qk (C^2 d), W and U (C^2 d), and the state products w S, q S,
  k^T V' (3 C d^2) plus A_qk V' (C^2 d / 2), times 2 for multiply-add.
  The backward is counted as twice the forward's FLOPs.
  """
  tok = b * t * h
  fwd_bytes = tok * d * (4 * in_bytes + 4) + tok * in_bytes
  bwd_bytes = fwd_bytes + tok * d * (4 * in_bytes + 4 + 4)
  chunks = b * h * (t // chunk_size)
  c = chunk_size
  fwd_flops = 2 * chunks * (c * c * d + c * c * d + 3 * c * d * d + c * c * d / 2)
  return dict(fwd_bytes=fwd_bytes, fwdbwd_bytes=fwd_bytes + bwd_bytes,
              fwd_flops=fwd_flops, fwdbwd_flops=3 * fwd_flops)


def roofline_ms(cost, ceil: Ceilings):
  """Floor times (ms): max(bytes / bandwidth, FLOPs / matmul rate)."""
  f = max(cost["fwd_bytes"] / ceil.bandwidth, cost["fwd_flops"] / ceil.matmul)
  fb = max(cost["fwdbwd_bytes"] / ceil.bandwidth, cost["fwdbwd_flops"] / ceil.matmul)
  return f * 1e3, fb * 1e3


def stage_times_ms(q, k, v, g, beta, *, diagonal, chunk_size=64, sub_chunk=16, iters=10,
                   config_overrides=None):
  """Per-kernel times (ms) of the Pallas path on the current backend.

  Stages: the g cumsum (XLA), intra_fwd, state_fwd, the backward's
  recompute (intra_fwd with M + state_fwd saving states), state_bwd, intra_bwd.
  """
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  c = chunk_size
  cfg = kernel_config.make_config(backend=kernel_config.default_backend(False), dtype=q.dtype,
                                  head_k=dk, head_v=dv, chunk_size=c, sub_chunk=sub_chunk,
                                  overrides=config_overrides)
  t_pad = -(-t // c) * c
  nc = t_pad // c
  pad = lambda x: jnp.pad(x, [(0, 0), (0, t_pad - t)] + [(0, 0)] * (x.ndim - 2))
  q, k, v, g, beta = map(pad, (q, k, v, g, beta))
  scale = dk ** -0.5
  q2, k2, v2 = q.reshape(b, t_pad, -1), k.reshape(b, t_pad, -1), v.reshape(b, t_pad, -1)
  g2 = g.reshape(b, t_pad, -1).astype(jnp.float32)
  beta_t = jnp.transpose(beta.astype(jnp.float32), (0, 2, 1))[..., None]
  chunk = jnp.arange(nc, dtype=jnp.int32)
  meta = ((chunk == 0).astype(jnp.int32), (chunk == nc - 1).astype(jnp.int32),
          jnp.zeros((nc,), jnp.int32))
  h0 = jnp.zeros((b, h, dk, dv), jnp.float32)
  kw = dict(heads=h, chunk_size=c, scale=scale, cfg=cfg)
  cums = jax.jit(lambda x: pallas_op._chunk_cumsum(x, c))  # pylint: disable=protected-access
  g_cum = cums(g2)
  intra = jax.jit(lambda *a: kernel_fwd.intra_fwd(*a, sub_chunk=sub_chunk, diagonal=diagonal,
                                                  **kw))
  intra_m = jax.jit(lambda *a: kernel_fwd.intra_fwd(*a, sub_chunk=sub_chunk, diagonal=diagonal,
                                                    save_m=True, **kw))
  w, u, a_qk, m = intra_m(q2, k2, v2, g_cum, beta_t)
  state = jax.jit(lambda *a: kernel_fwd.state_fwd(meta, *a, varlen=False, **kw))
  state_s = jax.jit(lambda *a: kernel_fwd.state_fwd(meta, *a, varlen=False, save=True, **kw))
  _, _, hs, v_new = state_s(q2, k2, g_cum, w, u, a_qk, h0)
  do2 = v2
  sb = jax.jit(lambda *a: kernel_bwd.state_bwd(meta, *a, varlen=False, **kw))
  dv_new, dhs, _ = sb(q2, k2, g_cum, w, a_qk, do2, h0)
  ib = jax.jit(lambda *a: kernel_bwd.intra_bwd(*a, sub_chunk=sub_chunk, diagonal=diagonal,
                                               **kw))
  return {
      "cumsum": time_ms(cums, g2, iters=iters),
      "intra_fwd": time_ms(intra, q2, k2, v2, g_cum, beta_t, iters=iters),
      "state_fwd": time_ms(state, q2, k2, g_cum, w, u, a_qk, h0, iters=iters),
      "intra_fwd+M": time_ms(intra_m, q2, k2, v2, g_cum, beta_t, iters=iters),
      "state_fwd+save": time_ms(state_s, q2, k2, g_cum, w, u, a_qk, h0, iters=iters),
      "state_bwd": time_ms(sb, q2, k2, g_cum, w, a_qk, do2, h0, iters=iters),
      "intra_bwd": time_ms(ib, q2, k2, v2, g_cum, beta_t, do2, hs, dhs, v_new, dv_new, m,
                           iters=iters),
  }
