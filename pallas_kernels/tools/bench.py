"""Benchmark helpers for the KDA kernels: inputs, timing, roofline, stages.

Used by `experiments/bench/bench_kernels.py` and `experiments/bench/tune_kda.py`, and for
inputs and timing by the other benches (`document_ids`: rows of packed documents for
`bench_segments.py` and `bench_documents.py`); no timing happens at import.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda import api
from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import kernel_cumsum
from pallas_kernels.kda import kernel_diag
from pallas_kernels.kda import kernel_gate_cumsum
from pallas_kernels.kda import kernel_intra_bwd
from pallas_kernels.kda import kernel_intra_bwd_split
from pallas_kernels.kda import kernel_intra_fwd
from pallas_kernels.kda import kernel_output_mosaic
from pallas_kernels.kda import kernel_state_bwd
from pallas_kernels.kda import kernel_state_fwd
from pallas_kernels.kda import kernel_state_split
from pallas_kernels import timing


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


def document_ids(b: int, t: int, docs: int, padding: float = 0.0, seed: int = 0) -> np.ndarray:
  """[B, T] int32 segment ids: per row `docs` documents (ids 1..docs, cuts drawn uniformly)
  followed, when `padding` > 0, by a padding tail (id 0) of 0 to padding * T tokens."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((b, t), np.int32)
  for r in range(b):
    # No draw for the tail when there is none, so the cuts of a seed stay the same.
    pad = int(rng.integers(0, min(int(padding * t), t - docs) + 1)) if padding > 0 else 0
    used = t - pad
    cuts = np.sort(rng.choice(np.arange(1, used), size=docs - 1, replace=False))
    ids[r, :used] = np.searchsorted(cuts, np.arange(used), side="right") + 1
  return ids


def time_ms(fn, *args, iters=20, warmup=3):
  """Median wall time in ms of `fn(*args)` (already jitted), synchronised.

  Each call is waited for before the next is dispatched, so the time holds
  the host's dispatch and the wait as well as the GPU's work ("sync" timing,
  `timing.sync_ms`).
  """
  return timing.sync_ms(lambda: fn(*args), jax.block_until_ready, iters=iters, warmup=warmup)


def pipelined_ms(fn, *args, iters=20, rounds=5, warmup=3):
  """Time in ms per call of `fn(*args)` (already jitted) dispatched back to back.

  Each round dispatches `iters` calls without waiting and then waits for all
  of them, so the per-call time is the GPU's ("pipelined" timing,
  `timing.pipelined_ms`). Returns the median over `rounds` rounds.
  """
  return timing.pipelined_ms(lambda: fn(*args), jax.block_until_ready, iters=iters,
                             rounds=rounds, warmup=warmup)


def kda_fn(implementation, diagonal, *, chunk_size=64, sub_chunk=16, lower_bound=-5.0,
           backward=False, config_overrides=None):
  """Jitted forward (or forward+backward) of `api.chunk_kda`, as a caller runs it
  (g traced, so the dense path clamps it inside the gate-cumsum kernels).

  config_overrides: KernelConfig fields for the pallas path.
  """
  def fwd(q, k, v, g, beta):
    o, _ = api.chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, sub_chunk=sub_chunk,
                         lower_bound=lower_bound, diagonal=diagonal,
                         implementation=implementation, config_overrides=config_overrides)
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
                   config_overrides=None, interpret=False, stages=None, lower_bound=-5.0):
  """Per-kernel times (ms) of the Pallas path on the current backend.

  Stages: the g cumsum (`kernel_cumsum`; on the dense diagonal the clamped
  one, with `lower_bound`, as `chunk_kda` runs traced gates; cumsum_xla is
  XLA's plain one, for comparison), intra_fwd, state_fwd, the training forward's variants
  (intra_fwd with M, state_fwd saving the entry states and V'), state_bwd,
  intra_bwd, when the split backward runs its two kernels alone
  (intra_bwd_cc, intra_bwd_k; with the pairwise diagonal's own kernels,
  `KernelConfig.diag_kernels`, also diag_fwd, inside intra_fwd, and
  diag_bwd, before intra_bwd_k), and the reverse cumsum giving dg
  (dg_cumsum). With the split forward state pass (`kernel_state_split`),
  state_fwd is its two kernels together, also timed alone (state_rec and
  output_fwd, with the storage dtypes of training; output_fwd_mosaic, its
  Mosaic GPU body, only when `stages` names it). `interpret` runs the
  kernels emulated (CPU smoke tests; the times mean nothing). `stages`
  (names as returned) times only those: the kernels producing their inputs
  still run once, the others are neither compiled nor timed.
  """
  if stages is not None:
    unknown = set(stages) - set(ALL_STAGES)
    if unknown:
      raise ValueError(f"unknown stages {sorted(unknown)}; stages are {ALL_STAGES}")
  want = lambda name: name in stages if stages is not None else name not in OPT_IN_STAGES
  times = {}

  def timed(name, fn, *args):
    if want(name):
      times[name] = time_ms(fn, *args, iters=iters)

  b, t, h, dk = q.shape
  dv = v.shape[-1]
  c = chunk_size
  cfg = kernel_config.make_config(backend=kernel_config.default_backend(interpret), dtype=q.dtype,
                                  head_k=dk, head_v=dv, chunk_size=c, sub_chunk=sub_chunk,
                                  state_programs=b * h, overrides=config_overrides)
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
  if diagonal == "dense":
    # As chunk_kda runs a traced gate: clamped inside the cumsum passes (the
    # backward's pass reads the record the training forward writes).
    lb = float(lower_bound)
    cums = jax.jit(lambda x: kernel_cumsum.clamped_cumsum(x, lb, c, cfg=cfg))
    record = kernel_cumsum.clamped_cumsum(g2, lb, c, cfg=cfg, with_record=True)[1]
    cums_rev = jax.jit(lambda x: kernel_cumsum.clamped_cumsum_bwd(x, record, c, cfg=cfg))
  else:
    cums = jax.jit(lambda x: kernel_cumsum.chunk_cumsum(x, c, cfg=cfg))
    cums_rev = jax.jit(lambda x: kernel_cumsum.chunk_cumsum(x, c, reverse=True, cfg=cfg))
  cums_xla = jax.jit(lambda x: kernel_cumsum.chunk_cumsum_xla(x, c))
  g_cum = cums(g2)
  split_state = not cfg.is_tpu
  # What `pallas_op._forward` asks of the intra kernel (the split state pass
  # reads the gated keys and queries, in inference too).
  intra = jax.jit(lambda *a: kernel_intra_fwd.intra_fwd(
      *a, sub_chunk=sub_chunk, diagonal=diagonal, save_gated=split_state, **kw))
  intra_m = jax.jit(lambda *a: kernel_intra_fwd.intra_fwd(
      *a, sub_chunk=sub_chunk, diagonal=diagonal, save_m=True, save_gated=split_state,
      m_dtype=cfg.saved_state_dtype, **kw))
  w, u, a_qk, m, kg, qg = intra_m(q2, k2, v2, g_cum, beta_t)
  state_split = {}
  if split_state:
    # Storage dtypes as `pallas_op._forward` picks them.
    rec_kw = dict(heads=h, chunk_size=c, cfg=cfg, varlen=False)
    out_kw = dict(heads=h, chunk_size=c, cfg=cfg, out_dtype=q.dtype)
    train_kw = dict(state_dtype=cfg.saved_state_dtype,
                    v_new_dtype=cfg.intra_bwd_mm_dtype)

    def split_pass(qg, g_cum, w, u, kg, a_qk, h0, save):
      dtypes = train_kw if save else dict(state_dtype=cfg.mm_dtype)
      hs, v_new, ht = kernel_state_split.state_recurrence(meta, w, u, kg, g_cum, h0, **dtypes,
                                                          **rec_kw)
      o = kernel_state_split.output_fwd(qg, a_qk, hs, v_new, **out_kw)
      return o, ht, hs, v_new

    args = (qg, g_cum, w, u, kg, a_qk, h0)
    state = jax.jit(lambda *a: split_pass(*a, save=False)[:2])
    state_s = jax.jit(lambda *a: split_pass(*a, save=True))
    _, _, hs, v_new = state_s(*args)
    gated_qk = (qg, kg)
    rec = jax.jit(lambda *a: kernel_state_split.state_recurrence(meta, *a, **train_kw,
                                                                 **rec_kw))
    out = jax.jit(lambda *a: kernel_state_split.output_fwd(*a, **out_kw))
    state_split = {"state_rec": (rec, w, u, kg, g_cum, h0),
                   "output_fwd": (out, qg, a_qk, hs, v_new)}
    if want("output_fwd_mosaic"):
      # The Mosaic GPU body on the same operands (it needs them in one 16-bit dtype).
      mosaic = jax.jit(lambda *a: kernel_output_mosaic.output_fwd(
          *a, heads=h, chunk_size=c, out_dtype=q.dtype,
          interpret=plgpu.InterpretGPUParams() if interpret else False))
      state_split["output_fwd_mosaic"] = (mosaic, qg, a_qk, hs, v_new)
  else:
    args = (q2, k2, g_cum, w, u, a_qk, h0)
    state = jax.jit(lambda *a: kernel_state_fwd.state_fwd(meta, *a, varlen=False, **kw)[:2])
    state_s = jax.jit(lambda *a: kernel_state_fwd.state_fwd(meta, *a, varlen=False, save=True,
                                                            **kw))
    _, _, hs, v_new = state_s(*args)
    gated_qk = None
  do2 = v2
  # The reverse state kernel reads what the forward kept: the gated queries and
  # keys after the GPU's split pass, q and k after the TPU's fused one.
  sb_args = (*(gated_qk or (q2, k2)), g_cum, w, a_qk, do2, h0)
  sb = jax.jit(lambda *a: kernel_state_bwd.state_bwd(meta, *a, varlen=False,
                                                     gated=gated_qk is not None, **kw))
  needs_bwd = stages is None or {"state_bwd", "intra_bwd", "intra_bwd_cc", "diag_bwd",
                                 "intra_bwd_k"} & set(stages)
  dv_new, dhs, _ = sb(*sb_args) if needs_bwd else (None, None, None)
  intra_bwd = (kernel_intra_bwd_split.intra_bwd_split if cfg.intra_bwd == "split"
               else kernel_intra_bwd.intra_bwd_tiles)
  ib = jax.jit(lambda *a: intra_bwd(*a, sub_chunk=sub_chunk, diagonal=diagonal, **kw))
  split = {}
  if needs_bwd and cfg.intra_bwd == "split":
    # Its two kernels on their own (their sum is the "intra_bwd" stage).
    cc_args = (k2, v2, g_cum, beta_t, do2, hs, v_new, dv_new, m)
    cc_kw = {n: kw[n] for n in ("heads", "chunk_size", "cfg")}
    cc_fn = jax.jit(lambda *a: kernel_intra_bwd_split.intra_bwd_cc(*a, **cc_kw))
    split = {"intra_bwd_cc": (cc_fn, *cc_args)}
    pairwise_tiles = diagonal == "pairwise" and cfg.diag_kernels
    if want("intra_bwd_k") or (pairwise_tiles and want("diag_bwd")):
      cc = cc_fn(*cc_args)[2:]
      diag = None
      if pairwise_tiles:
        diag_fn = jax.jit(lambda *a: kernel_diag.diag_grads(*a, sub_chunk=sub_chunk, **kw))
        split["diag_bwd"] = (diag_fn, q2, k2, g_cum, beta_t, *cc[1:])
        diag = diag_fn(q2, k2, g_cum, beta_t, *cc[1:])[:3]
      k_fn = jax.jit(lambda *a, diag: kernel_intra_bwd_split.intra_bwd_k(
          *a, sub_chunk=sub_chunk, diagonal=diagonal, diag=diag, **kw))
      split["intra_bwd_k"] = (functools.partial(k_fn, diag=diag), q2, k2, g_cum, beta_t, do2,
                              hs, dhs, v_new, *cc)
  timed("cumsum", cums, g2)
  timed("cumsum_xla", cums_xla, g2)
  if diagonal == "pairwise" and cfg.diag_kernels:
    timed("diag_fwd", jax.jit(lambda *a: kernel_diag.diag_scores(*a, sub_chunk=sub_chunk, **kw)),
          q2, k2, g_cum, beta_t)
  timed("intra_fwd", intra, q2, k2, v2, g_cum, beta_t)
  timed("state_fwd", state, *args)
  timed("intra_fwd+M", intra_m, q2, k2, v2, g_cum, beta_t)
  timed("state_fwd+save", state_s, *args)
  for name, (fn, *fn_args) in state_split.items():
    timed(name, fn, *fn_args)
  timed("state_bwd", sb, *sb_args)
  timed("intra_bwd", ib, q2, k2, v2, g_cum, beta_t, do2, hs, dhs, v_new, dv_new, m)
  for name, (fn, *fn_args) in split.items():
    timed(name, fn, *fn_args)
  timed("dg_cumsum", cums_rev, g2)
  return times


# Every stage `stage_times_ms` can time, in its order.
ALL_STAGES = ("cumsum", "cumsum_xla", "diag_fwd", "intra_fwd", "state_fwd", "intra_fwd+M",
              "state_fwd+save", "state_rec", "output_fwd", "output_fwd_mosaic", "state_bwd",
              "intra_bwd", "intra_bwd_cc", "diag_bwd", "intra_bwd_k", "dg_cumsum")
# Timed only when `stages` names them: output_fwd_mosaic, the Mosaic GPU body
# of output_fwd (`kernel_output_mosaic`, Hopper only), on output_fwd's operands.
OPT_IN_STAGES = ("output_fwd_mosaic",)


def parse_overrides(items):
  """`name=value` strings -> KernelConfig fields (benchmark and tuning flags).

  `name=value` sets a field: dtype fields take a dtype name, `true`/`false`
  are booleans, integers are ints, anything else a string (e.g.
  `inverse=blocked`). `warps.<stage>=N` sets one stage's Triton warps.
  """
  overrides, warps = {}, {}
  for item in items:
    name, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"override {item!r} is not name=value")
    if name.startswith("warps."):
      stage = name[len("warps."):]
      if stage not in kernel_config.STAGES:
        raise ValueError(f"override {item!r}: stage must be one of {kernel_config.STAGES}")
      warps[stage] = int(value)
    elif name.endswith("dtype"):
      overrides[name] = jnp.dtype(value)
    elif value.lower() in ("true", "false"):
      overrides[name] = value.lower() == "true"
    else:
      try:
        overrides[name] = int(value)
      except ValueError:
        overrides[name] = value
  if warps:
    # Only the named stages; `make_config` keeps its defaults for the others.
    overrides["num_warps"] = tuple(sorted(warps.items()))
  return overrides


# Stages of the default path (saved residuals): the recompute stages are not run there.
FWD_STAGES = ("cumsum", "intra_fwd", "state_fwd")
BWD_STAGES = ("state_bwd", "intra_bwd", "dg_cumsum")


def parse_grid(text: str) -> list[list[str]]:
  """Grid text -> one override list per combination, in order.

  `"a=1,2;b=x"` -> `[["a=1", "b=x"], ["a=2", "b=x"]]`; items as `parse_overrides` takes.
  """
  fields = []
  for part in text.split(";"):
    part = part.strip()
    if not part:
      continue
    name, sep, values = part.partition("=")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not name.strip() or not vals:
      raise ValueError(f"grid field {part!r} is not name=v1,v2,...")
    fields.append([f"{name.strip()}={v}" for v in vals])
  if not fields:
    raise ValueError("the grid is empty")
  return [list(combo) for combo in itertools.product(*fields)]


def stage_table(rows: list[tuple[str, dict | str]]) -> str:
  """Markdown table of (label, `stage_times_ms` dict or error text) rows; best per column starred."""
  # Columns in first-seen order; a stage a row did not run (the split
  # backward's kernels, for the other bodies) prints as "-".
  stages = []
  for _, r in rows:
    if isinstance(r, dict):
      stages += [s for s in r if s not in stages]
  cols = stages + ["fwd sum", "bwd sum"]
  values = []
  for label, r in rows:
    if isinstance(r, dict):
      # A sum of stages none of which ran (--stages) prints as "-", not 0.
      sums = {name: sum(r[s] for s in group if s in r)
              for name, group in (("fwd sum", FWD_STAGES), ("bwd sum", BWD_STAGES))
              if any(s in r for s in group)}
      values.append((label, {**r, **sums}))
    else:
      values.append((label, r))
  best = {c: min((v[c] for _, v in values if isinstance(v, dict) and c in v), default=None)
          for c in cols}
  lines = ["| config | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
  for label, v in values:
    if isinstance(v, dict):
      cells = [f"{v[c]:.3f}{'*' if v[c] == best[c] else ''}" if c in v else "-" for c in cols]
    else:
      cells = [f"failed: {v}"] + [""] * (len(cols) - 1)
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def cumsum_passes(b, t, f, *, chunk_size, lower_bound, cfg, block_f):
  """The gate-cumsum passes `experiments/bench/bench_cumsum.py` times, on one [B, T, F] gate.

  Returns:
    {name: (jitted fn, args, bytes read + written)}: xla_copy (the floor),
    cumsum, reverse, clamped, clamped+record, clamped_bwd, gate, gate_bwd,
    cumsum_xla; g = lower_bound * sigmoid(N(0, 1)) f32 (in range), a bf16
    pre-activation and an f32 bias for the fused gate.
  """
  kc, kg = kernel_cumsum, kernel_gate_cumsum

  key_g, key_raw, key_bias = jax.random.split(jax.random.PRNGKey(0), 3)
  g = lower_bound * jax.nn.sigmoid(jax.random.normal(key_g, (b, t, f)))
  raw = jax.random.normal(key_raw, (b, t, f)).astype(jnp.bfloat16)
  bias = jax.random.normal(key_bias, (f,))
  c, lb, n = chunk_size, lower_bound, b * t * f
  kw = dict(cfg=cfg, block_f=block_f)
  record = kc.clamped_cumsum(g, lb, c, with_record=True, **kw)[1]
  return {
      "xla_copy": (jax.jit(lambda x: x + 1.0), (g,), 8 * n),
      "cumsum": (jax.jit(lambda x: kc.chunk_cumsum(x, c, **kw)), (g,), 8 * n),
      "reverse": (jax.jit(lambda x: kc.chunk_cumsum(x, c, reverse=True, **kw)), (g,), 8 * n),
      "clamped": (jax.jit(lambda x: kc.clamped_cumsum(x, lb, c, **kw)), (g,), 8 * n),
      "clamped+record": (jax.jit(lambda x: kc.clamped_cumsum(x, lb, c, with_record=True, **kw)),
                         (g,), 8 * n),
      "clamped_bwd": (jax.jit(lambda x, r: kc.clamped_cumsum_bwd(x, r, c, **kw)), (g, record),
                      8 * n),
      "gate": (jax.jit(lambda x, y: kg.gate_cumsum(x, y, lb, c, **kw)), (raw, bias), 6 * n),
      "gate_bwd": (jax.jit(lambda x, y, z: kg.gate_cumsum_bwd(x, y, z, lb, c, **kw)),
                   (g, raw, bias), 8 * n),
      "cumsum_xla": (jax.jit(lambda x: kc.chunk_cumsum_xla(x, c)), (g,), 8 * n),
  }
