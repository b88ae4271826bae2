"""`implementation="pallas"` of chunked KDA: layout, varlen packing, custom VJP.

The Pallas kernels work on a chunk grid: every sequence starts at a chunk
boundary and the time axis is a multiple of C. Stages, in order: the gate
cumsum (`kernel_cumsum`), the intra-chunk forward (`kernel_intra_fwd`), the
state pass (`kernel_state_split` on the GPU, `kernel_state_fwd` on TPU);
backward: the reverse state pass (`kernel_state_bwd`), the intra-chunk
backward (`kernel_intra_bwd_split` or `kernel_intra_bwd`, by
`KernelConfig.intra_bwd`) and the reverse cumsum. This module

* pads T (fixed length) or gathers packed sequences onto the grid
  (`tiling.pack_varlen`), and scatters the outputs back; plain autodiff
  differentiates these gathers;
* computes the within-chunk cumsum G of the gates (and the reverse cumsum of
  dG in the backward) with `kernel_cumsum` (XLA on TPU), with `chunk_kda`'s
  clamp of traced gates folded into the same passes (`clamp_gates`), or, with
  `gate_activation="bounded_sigmoid"`, the gate itself from its
  pre-activation in the same pass (`kernel_gate_cumsum`);
* joins the forward and backward kernels with `jax.custom_vjp`;
* with `segment_ids` (fixed length), hands every intra and
  state kernel, forward and backward, the run codes of
  `kernel_common.run_codes`, which restart the state inside chunks by masks
  (docs/design.md, "Documents in the chunks").
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import head_pad
from pallas_kernels.kda import inputs
from pallas_kernels.kda import kernel_common
from pallas_kernels.kda import kernel_config
from pallas_kernels.kda import kernel_cumsum
from pallas_kernels.kda import kernel_gate_cumsum
from pallas_kernels.kda import kernel_intra_bwd
from pallas_kernels.kda import kernel_intra_bwd_split
from pallas_kernels.kda import kernel_intra_fwd
from pallas_kernels.kda import kernel_output_mosaic
from pallas_kernels.kda import kernel_state_bwd
from pallas_kernels.kda import kernel_state_fwd
from pallas_kernels.kda import kernel_state_split
from pallas_kernels.kda import platform_lowering
from pallas_kernels.kda import spec as spec_lib
from pallas_kernels.kda import tiling
from pallas_kernels.kda.spec import KdaSpec
from pallas_kernels.mgpu_common import plgpu

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Static:
  """Hashable static arguments of the custom-VJP core."""
  # The call's tiling (chunk_size, sub_chunk, diagonal) and gate bound; the
  # "clamp" and "fused" modes' cumsum kernels read its bound.
  spec: KdaSpec
  scale: float
  varlen: bool
  # The backend's choices (None until `_chunk_kda_grid` picks the backend's).
  cfg: kernel_config.KernelConfig | None
  # What g is and what the cumsum passes do with it: "log_decay"
  # (summed as is), "clamp" (clamped into the spec's range first, gradient 0
  # outside) or "fused" (the pre-activation of the spec's bounded gate).
  gate_mode: str = "log_decay"
  # The state restarts inside chunks (`segment_ids`): the kernels take run codes.
  runs: bool = False

  @property
  def fused(self) -> bool:
    return self.gate_mode == "fused"


def _kernel_layout(q, k, v, beta):
  """The kernels' layouts of the inputs: q2, k2 [B, Tp, H*K], v2 [B, Tp, H*V], beta_t [B, H, Tp, 1] f32."""
  b, tp, h, dk = q.shape
  return dict(q2=q.reshape(b, tp, h * dk), k2=k.reshape(b, tp, h * dk),
              v2=v.reshape(b, tp, h * v.shape[-1]),
              beta_t=jnp.transpose(beta.astype(_F32), (0, 2, 1))[..., None])


def _gate_cumsum(st: _Static, g, gate_bias, save: bool):
  """(G [B, Tp, H*K] f32, clamp record or None): the cumsum of g (clamped into
  st.spec's range in the "clamp" mode; the record, kept for the backward when `save`, says
  where), or of the fused gate of pre-activation g."""
  b, tp, h, dk = g.shape
  g2 = g.reshape(b, tp, h * dk)
  if st.fused:
    return kernel_gate_cumsum.spec_gate_cumsum(g2, gate_bias.reshape(h * dk), st.spec,
                                               cfg=st.cfg), None
  if st.gate_mode == "log_decay":
    return kernel_cumsum.chunk_cumsum(g2.astype(_F32), st.spec.chunk_size, cfg=st.cfg), None
  out = kernel_cumsum.spec_clamped_cumsum(g2.astype(_F32), st.spec, cfg=st.cfg,
                                          with_record=save)
  return out if save else (out, None)


def _output_fwd(qg, a_qk, hs, v_new, *, heads, chunk_size, cfg, out_dtype):
  """The GPU forward's output kernel on the body `cfg.output_body` names."""
  if cfg.output_body == "mosaic_gpu":
    interpret = plgpu.InterpretGPUParams() if cfg.backend == "interpret" else False
    return kernel_output_mosaic.output_fwd(qg, a_qk, hs, v_new, heads=heads,
                                           chunk_size=chunk_size, out_dtype=out_dtype,
                                           interpret=interpret)
  return kernel_state_split.output_fwd(qg, a_qk, hs, v_new, heads=heads,
                                       chunk_size=chunk_size, cfg=cfg, out_dtype=out_dtype)


def _forward(st: _Static, q, k, v, g, beta, gate_bias, h0, meta, *, save=False, runs=None):
  """Kernel forward on the chunk grid. Shapes as in `_core`."""
  b, tp, h, dk = q.shape
  dv = v.shape[-1]
  cfg = st.cfg
  lay = _kernel_layout(q, k, v, beta)
  q2, k2, v2, beta_t = lay["q2"], lay["k2"], lay["v2"], lay["beta_t"]
  g_cum, clamp_record = _gate_cumsum(st, g, gate_bias, save)
  kw = dict(heads=h, chunk_size=st.spec.chunk_size, scale=st.scale, cfg=cfg)
  split = not cfg.is_tpu   # the GPU's state pass: recurrence, then outputs
  # Kept for the backward: M and (split pass) the entry states are written
  # straight in cfg.saved_state_dtype (bf16 by default on the GPU with bf16
  # intra-backward operands).
  res_dtype = cfg.saved_state_dtype
  intra = kernel_intra_fwd.intra_fwd(q2, k2, v2, g_cum, beta_t, sub_chunk=st.spec.sub_chunk,
                                     diagonal=st.spec.diagonal, save_m=save, save_gated=split,
                                     m_dtype=res_dtype, runs=runs, **kw)
  if split:
    # Without the backward only the output kernel reads the entry states and
    # V', as matmul operands. The backward keeps the states in res_dtype and
    # V' in its matmul dtype, V''s only use there.
    hs, v_new, ht = kernel_state_split.state_recurrence(
        meta, intra.w, intra.u, intra.kg, g_cum, h0, heads=h, chunk_size=st.spec.chunk_size,
        cfg=cfg, varlen=st.varlen, state_dtype=res_dtype if save else cfg.mm_dtype,
        v_new_dtype=cfg.intra_bwd_mm_dtype if save else cfg.mm_dtype,
        run_code=None if runs is None else runs[0])
    o = _output_fwd(intra.qg, intra.a_qk, hs, v_new, heads=h,
                    chunk_size=st.spec.chunk_size, cfg=cfg, out_dtype=q.dtype)
  else:
    o, ht, hs, v_new = kernel_state_fwd.state_fwd(
        meta, q2, k2, g_cum, intra.w, intra.u, intra.a_qk, h0, varlen=st.varlen, save=save,
        out_dtype=q.dtype, run_code=None if runs is None else runs[0], **kw)
  o = o.reshape(b, tp, h, dv)
  if not save:
    return o, ht
  # The GPU's reverse state kernel reads the gated queries and keys instead of
  # forming e^G and e^{G_last - G} on [C, K] tiles in its sequential loop.
  return o, ht, dict(lay, g_cum=g_cum, w=intra.w, a_qk=intra.a_qk, m=intra.m, hs=hs,
                     v_new=v_new, qg=intra.qg, kg=intra.kg, clamp_record=clamp_record)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(st: _Static, q, k, v, g, beta, gate_bias, h0, first_n, last_n, seq_n, runs=None):
  """Chunk-grid KDA.

  Args:
    q, k: [B, Tp, H, K]; v: [B, Tp, H, V]; g: [B, Tp, H, K] f32 log-decay,
      or in the fused gate mode the gate pre-activation (any float dtype);
      beta: [B, Tp, H]; gate_bias: [H, K] f32 with the fused gate, else None;
      h0: [Nh, H, K, V] f32; first_n, last_n, seq_n: [NC] int32;
      runs: None, or the run codes (code [B, Tp, 1], run [B, NC, 1, C] int32;
      `kernel_common.run_codes`) with st.runs.

  Returns:
    o [B, Tp, H, V] (q.dtype), ht [Nh, H, K, V] f32.
  """
  return _forward(st, q, k, v, g, beta, gate_bias, h0, (first_n, last_n, seq_n), runs=runs)


def _core_fwd(st, q, k, v, g, beta, gate_bias, h0, first_n, last_n, seq_n, runs=None):
  """Forward of the custom VJP; what it keeps depends on `cfg.save_residuals`.

  save_residuals=True keeps the forward's intermediates so the backward need
  not rerun the intra-chunk and state kernels: the cumulative gates G (f32,
  kept instead of g), W and A_qk (cfg.mm_dtype), and M, the per-chunk entry
  states and V' in cfg.saved_state_dtype (written so by the GPU kernels; the
  TPU's f32 states and V' take one cast pass). The GPU's split state pass also
  keeps the gated queries and keys qg = (scale q) e^G and
  kg = k e^{G_last - G} (cfg.mm_dtype) for the reverse state kernel. Per
  token and head beyond the inputs, with bf16 inputs and bf16 M, states and
  V', that is 2K + 2C + 2C + 2KV/C + 2V + 4K bytes (G takes g's place):
  1792 bytes at K = V = 128, C = 64.
  With the clamp (gate mode "clamp") the cumsum's record of where it acted is
  kept too: int32 flags per cumsum block and an int8 mask [B, Tp, H*K] that
  only flagged blocks wrote (`kernel_cumsum.clamped_cumsum`).
  save_residuals=False keeps only the inputs and recomputes
  everything in the backward (costing a second forward's intra and state
  kernels).
  With the fused gate the pre-activation g (its input dtype) is kept as well:
  the backward's gate derivative reads it.
  """
  meta = (first_n, last_n, seq_n)
  if not st.cfg.save_residuals:
    out = _forward(st, q, k, v, g, beta, gate_bias, h0, meta, runs=runs)
    return out, (q, k, v, g, beta, gate_bias, h0, meta, runs, None)
  o, ht, r = _forward(st, q, k, v, g, beta, gate_bias, h0, meta, save=True, runs=runs)
  saved = {name: r[name] for name in ("g_cum", "w", "a_qk", "m", "hs", "v_new", "qg", "kg",
                                      "clamp_record")}
  for name in ("m", "hs", "v_new"):
    saved[name] = saved[name].astype(st.cfg.saved_state_dtype)
  # g itself is not needed once G is kept (it is [B, Tp, H, K] f32, like q's shape).
  keep_g = g if st.fused else None
  return (o, ht), (q, k, v, keep_g, beta, gate_bias, h0, meta, runs, saved)


def _core_bwd(st, res, cts):
  q, k, v, g, beta, gate_bias, h0, meta, runs, saved = res
  first_n, _, seq_n = meta
  do, dht = cts
  b, tp, h, dk = q.shape
  dv = v.shape[-1]
  cfg = st.cfg
  if saved is None:
    # Recompute the forward's intermediates (M, entry states, V').
    _, _, r = _forward(st, q, k, v, g, beta, gate_bias, h0, meta, save=True, runs=runs)
  else:
    r = dict(saved, **_kernel_layout(q, k, v, beta))  # what _forward(save=True) returns
  kw = dict(heads=h, chunk_size=st.spec.chunk_size, scale=st.scale, cfg=cfg)
  do2 = do.reshape(b, tp, h * dv).astype(cfg.mm_dtype)
  gated = r["qg"] is not None
  q_state, k_state = (r["qg"], r["kg"]) if gated else (r["q2"], r["k2"])
  dv_new, dhs, dh0 = kernel_state_bwd.state_bwd(meta, q_state, k_state, r["g_cum"], r["w"],
                                                r["a_qk"], do2, dht.astype(_F32),
                                                varlen=st.varlen, gated=gated,
                                                run_code=None if runs is None else runs[0], **kw)
  # dq, dk, dv leave the kernels in the inputs' dtype when they share one.
  same = q.dtype == k.dtype == v.dtype
  intra_bwd = (kernel_intra_bwd_split.intra_bwd_split if cfg.intra_bwd == "split"
               else kernel_intra_bwd.intra_bwd_tiles)
  dq, dk_, dv_, dg_cum, dbeta = intra_bwd(
      r["q2"], r["k2"], r["v2"], r["g_cum"], r["beta_t"], do2, r["hs"], dhs,
      r["v_new"], dv_new, r["m"], sub_chunk=st.spec.sub_chunk, diagonal=st.spec.diagonal,
      grad_dtype=q.dtype if same else _F32, runs=runs, **kw)
  if not st.fused:
    if st.gate_mode == "log_decay":
      dg = kernel_cumsum.chunk_cumsum(dg_cum, st.spec.chunk_size, reverse=True, cfg=cfg)
    else:
      dg = kernel_cumsum.clamped_cumsum_bwd(dg_cum, r["clamp_record"], st.spec.chunk_size,
                                            cfg=cfg)
    dg, dbias = dg.reshape(q.shape).astype(_F32), None
  else:
    dg, dbias = kernel_gate_cumsum.spec_gate_cumsum_bwd(
        dg_cum, g.reshape(b, tp, h * dk), gate_bias.reshape(h * dk), st.spec, cfg=cfg)
    dg, dbias = dg.reshape(g.shape), dbias.reshape(gate_bias.shape)
  # Only rows of sequences that start somewhere were written by the kernel.
  if st.varlen:
    started = jnp.zeros((h0.shape[0],), jnp.int32).at[seq_n].max(first_n)
    dh0 = jnp.where(started[:, None, None, None] != 0, dh0, 0.0)
  return (dq.reshape(q.shape).astype(q.dtype), dk_.reshape(k.shape).astype(k.dtype),
          dv_.reshape(v.shape).astype(v.dtype), dg,
          jnp.transpose(dbeta[..., 0], (0, 2, 1)).astype(beta.dtype), dbias, dh0,
          None, None, None, None)


_core.defvjp(_core_fwd, _core_bwd)


def segment_layout(num_chunks: int, segment_chunks: int | None) -> tuple[int, int]:
  """(segments, chunks per segment) of a fixed-length call of `num_chunks`
  chunks: one segment unless `segment_chunks` (KernelConfig) is smaller,
  else as few segments as allowed, of equal length (the last ones may end
  in padding chunks)."""
  if segment_chunks is None or segment_chunks >= num_chunks:
    return 1, num_chunks
  segments = -(-num_chunks // segment_chunks)
  return segments, -(-num_chunks // segments)


def _segment(x, s, seg_len: int):
  """Time slice s of x [B, S * Ts, ...] (Ts = seg_len)."""
  return jax.lax.dynamic_slice_in_dim(x, s * seg_len, seg_len, axis=1)


def _segmented_forward(st: _Static, segments: int, tensors, gate_bias, h0, meta):
  """The forward over `segments` equal time segments, in order, keeping no
  residuals: (o [B, S * Ts, H, V], ht, the state entering each segment [S, Nh, H, K, V])."""
  q, v = tensors[0], tensors[2]
  seg_len = q.shape[1] // segments

  def body(s, carry):
    h, o, entry = carry
    entry = entry.at[s].set(h)
    o_s, h = _forward(st, *(_segment(x, s, seg_len) for x in tensors), gate_bias, h, meta)
    return h, jax.lax.dynamic_update_slice_in_dim(o, o_s, s * seg_len, axis=1), entry

  o = jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)
  entry = jnp.zeros((segments,) + h0.shape, _F32)
  ht, o, entry = jax.lax.fori_loop(0, segments, body, (h0, o, entry))
  return o, ht, entry


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _segmented_core(st: _Static, segments: int, q, k, v, g, beta, gate_bias, h0, first_n,
                    last_n, seq_n):
  """`_core` over `segments` equal segments of the time axis, the state
  handed from one to the next (fixed-length sequences only).

  The backward walks the segments in reverse: it reruns one segment's
  forward from its saved entry state (keeping that segment's residuals, as
  `_core_fwd` does), takes its backward, and writes the segment's gradients
  into whole-length buffers in place. So beyond the inputs, outputs and
  gradients, memory holds one segment's residuals and temporaries, at the
  cost of a second forward pass. Shapes as `_core`, with Tp = S * Ts.
  """
  o, ht, _ = _segmented_forward(st, segments, (q, k, v, g, beta), gate_bias, h0,
                                (first_n, last_n, seq_n))
  return o, ht


def _segmented_core_fwd(st, segments, q, k, v, g, beta, gate_bias, h0, first_n, last_n, seq_n):
  tensors = (q, k, v, g, beta)
  meta = (first_n, last_n, seq_n)
  o, ht, entry = _segmented_forward(st, segments, tensors, gate_bias, h0, meta)
  return (o, ht), (tensors, gate_bias, entry, meta)


def _segmented_core_bwd(st, segments, res, cts):
  tensors, gate_bias, entry, meta = res
  do, dht = cts
  seg_len = tensors[0].shape[1] // segments

  def body(i, carry):
    s = segments - 1 - i
    dh, grads, dbias = carry
    core = lambda *xs, gb, h: _core(st, *xs, gb, h, *meta)
    _, vjp = jax.vjp(lambda *a: core(*a[:5], gb=a[5], h=a[6]),
                     *(_segment(x, s, seg_len) for x in tensors), gate_bias, entry[s])
    *d_seg, d_bias, dh = vjp((_segment(do, s, seg_len), dh))
    grads = tuple(jax.lax.dynamic_update_slice_in_dim(buf, d.astype(buf.dtype), s * seg_len,
                                                      axis=1)
                  for buf, d in zip(grads, d_seg))
    if dbias is not None:
      dbias = dbias + d_bias
    return dh, grads, dbias

  grads = tuple(jnp.zeros_like(x) for x in tensors)
  dbias = None if gate_bias is None else jnp.zeros_like(gate_bias)
  dh0, grads, dbias = jax.lax.fori_loop(0, segments, body, (dht, grads, dbias))
  return (*grads, dbias, dh0, None, None, None)


_segmented_core.defvjp(_segmented_core_fwd, _segmented_core_bwd)


def _next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def chunk_kda_pallas(q, k, v, g, beta, *, spec: KdaSpec, scale=None, initial_state=None,
                     output_final_state=False, cu_seqlens=None, segment_ids=None,
                     interpret=False, backend=None, block_v=None, config_overrides=None,
                     gate_activation=None, gate_bias=None, clamp_gates=False):
  """Chunked KDA with Pallas kernels; differentiable (custom VJP).

  Args:
    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] or [B, T, H] float32
    log-decay; beta: [B, T, H]. K, V: widths the kernels run
    (`kernel_config.width_rule`: on the GPU powers of two and multiples of
    16), or any other width up to `head_pad.MAX_PADDED_WIDTH` (zero-padded
    inside the op, exact).
    scale: multiplies q; defaults to K ** -0.5.
    initial_state: [N, H, K, V] or None.
    output_final_state: also return the final states.
    cu_seqlens: [N + 1] int cumulative lengths of packed sequences (B == 1).
    segment_ids: [B, T] int or None (not with cu_seqlens): the state
      restarts wherever a row's id changes, as in `api.chunk_kda`, by masks
      in the kernels; not with long-sequence segments
      (`KernelConfig.segment_chunks`).
    spec: the tiling (chunk_size C, sub_chunk L, diagonal) and the gate's
      bound, a `KdaSpec` (validated when built; `chunk_kda` passes its own).
      The kernels read the bound only to clamp g or to form the fused gate.
    interpret: emulate the kernels on the CPU.
    backend: override of the lowering (a `kernel_config.BACKENDS` entry);
      None: "interpret" with `interpret`, else the host's GPU or TPU, else
      (a CPU host) the platform the program is lowered for
      (`platform_lowering`, for jax.export).
    block_v: V-tile of the state kernels (default min(V, 64)).
    config_overrides: dict of `kernel_config.KernelConfig` fields to force
      (e.g. {"block_k": 32}) for benchmarks and ablations.
    gate_activation, gate_bias: the fused gate, as in `api.chunk_kda`: g is
      the pre-activation ([B, T, H, K] or [B, T, H], read in its dtype) and
      `kernel_gate_cumsum` forms the spec's gate of g + gate_bias.
    clamp_gates: clamp the log-decay g into the spec's range (gradient 1
      inside, 0 outside), as `api.chunk_kda` does for traced gates on the
      dense diagonal; applied inside the gate-cumsum passes
      (`kernel_cumsum.clamped_cumsum`), so it adds no pass over g. Needs a
      bound and no gate_activation.

  Returns:
    (o [B, T, H, V] in q.dtype, final_state [N, H, K, V] f32 or None).
  """
  if not isinstance(spec, KdaSpec):
    raise TypeError(f"spec must be a KdaSpec, got {type(spec).__name__}")
  args = inputs.validate(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, segment_ids=segment_ids)
  inputs.check_without_gate(gate_activation, gate_bias)
  fused = gate_activation is not None
  if clamp_gates:
    spec_lib.check_clamp(spec, gate_activation)
  b, t_len, h, dk = q.shape
  if fused:
    # The pre-activation stays in its dtype, broadcast over K for a GDN gate.
    bias = inputs.gate_bias_or_zeros(gate_activation, g, gate_bias, spec.bounded)
    g_in = g
    if g_in.ndim == 3:
      g_in, bias = jnp.broadcast_to(g_in[..., None], q.shape), bias[:, None]
    gate_bias, gate_mode = jnp.broadcast_to(bias, (h, dk)), "fused"
  else:
    g_in, gate_bias = args.g.astype(_F32), None
    gate_mode = "clamp" if clamp_gates else "log_decay"
  if backend is None:
    backend = platform_lowering.host_backend(interpret)
  # The kernel config is chosen per backend (`_chunk_kda_grid`).
  st = _Static(spec=spec, scale=float(args.scale), varlen=cu_seqlens is not None, cfg=None,
               gate_mode=gate_mode, runs=segment_ids is not None)
  run = functools.partial(_chunk_kda_on, st=st, output_final_state=output_final_state,
                          block_v=block_v, config_overrides=config_overrides)
  operands = (q, k, v, g_in, beta, initial_state, cu_seqlens, gate_bias, segment_ids)
  if backend is None:
    return platform_lowering.per_platform(run, *operands)
  return run(backend, *operands)


def _chunk_kda_on(backend, q, k, v, g, beta, initial_state, cu_seqlens, gate_bias, segment_ids,
                  *, st: _Static, output_final_state, block_v, config_overrides):
  """`chunk_kda_pallas` on one backend, after validation; g [B, T, H, K] (f32
  log-decay, or the fused gate's pre-activation with gate_bias [H, K]); st
  without its cfg.

  Head widths that are not kernel widths are zero-padded (`head_pad`); the
  padded key channels are zero, so whatever gate they get never reaches the
  state.
  """
  b, t_len, h, dk = q.shape
  dv = v.shape[-1]
  dk_run, dv_run = head_pad.padded_widths(
      dk, dv, backend, heads=h,
      sliced=kernel_config.sliced_bodies(backend, st.spec.sub_chunk, config_overrides))
  q, k, v, g, initial_state = head_pad.pad_heads(q, k, v, g, initial_state, dk_run, dv_run)
  if gate_bias is not None and dk_run != dk:
    gate_bias = jnp.pad(gate_bias, ((0, 0), (0, dk_run - dk)))
  o, ht = _chunk_kda_grid(backend, q, k, v, g, beta, initial_state, cu_seqlens, gate_bias,
                          segment_ids, st=st, output_final_state=output_final_state,
                          block_v=block_v, config_overrides=config_overrides)
  return head_pad.unpad_outputs(o, ht, dk, dv)


def _chunk_kda_grid(backend, q, k, v, g, beta, initial_state, cu_seqlens, gate_bias, segment_ids,
                    *, st: _Static, output_final_state, block_v, config_overrides):
  """Pads T or packs the sequences onto the chunk grid and runs `_core` under
  st with this backend's KernelConfig; kernel widths."""
  b, t_len, h, dk = q.shape
  dv = v.shape[-1]
  c = st.spec.chunk_size
  varlen = st.varlen
  # Chunks on the grid: T padded to whole chunks, or the packed layout's
  # static ceil(T / C) + N (`tiling.pack_varlen`).
  grid_chunks = -(-t_len // c) + (cu_seqlens.shape[0] - 1 if varlen else 0)
  cfg = kernel_config.make_config(backend=backend, dtype=q.dtype, head_k=dk, head_v=dv,
                                  chunk_size=c, sub_chunk=st.spec.sub_chunk,
                                  block_v=block_v, state_programs=q.shape[0] * h,
                                  token_heads=b * grid_chunks * c * h,
                                  overrides=config_overrides, heads=h)
  st = dataclasses.replace(st, cfg=cfg)
  # Padded rows of a fused gate get -inf, where the gate is exactly 0 (an
  # explicit zero gate), and so is its derivative.
  g_pad = -jnp.inf if st.fused else 0.0
  tensors = (q, k, v, g, beta)

  fills = (0.0, 0.0, 0.0, g_pad, 0.0)

  if not varlen:
    segments, seg_chunks = segment_layout(grid_chunks, cfg.segment_chunks)
    tp = segments * seg_chunks * c
    if tp != t_len:
      tensors = [jnp.pad(x, [(0, 0), (0, tp - t_len)] + [(0, 0)] * (x.ndim - 2),
                         constant_values=fill) for x, fill in zip(tensors, fills)]
    chunk = jnp.arange(seg_chunks, dtype=jnp.int32)
    meta = ((chunk == 0).astype(jnp.int32), (chunk == seg_chunks - 1).astype(jnp.int32),
            jnp.zeros((seg_chunks,), jnp.int32))
    h0 = (jnp.zeros((b, h, dk, dv), _F32) if initial_state is None
          else initial_state.astype(_F32))
    if st.runs:
      if segments > 1:
        raise NotImplementedError(
            f"segment_ids with long-sequence segments (T = {t_len} runs as {segments}); pass "
            "config_overrides={'segment_chunks': None}, or implementation='xla'")
      masks = tiling.run_masks(segment_ids, c)
      runs = kernel_common.run_codes(masks.run_bnc, masks.carry_bnc, masks.last_bnc)
      o, ht = _core(st, *tensors, gate_bias, h0, *meta, runs)
    elif segments == 1:
      o, ht = _core(st, *tensors, gate_bias, h0, *meta)
    else:
      o, ht = _segmented_core(st, segments, *tensors, gate_bias, h0, *meta)
    o = o[:, :t_len]
    return o, (ht if output_final_state else None)

  num_seqs = cu_seqlens.shape[0] - 1
  layout = tiling.pack_varlen(cu_seqlens, t_len, c)
  tensors = [jnp.concatenate([x, jnp.full_like(x[:, :1], fill)], axis=1)[:, layout.src_index_n]
             for x, fill in zip(tensors, fills)]
  seq_n = layout.chunk_seq_n
  last_n = jnp.concatenate([seq_n[1:] != seq_n[:-1], jnp.ones((1,), bool)])
  meta = (layout.chunk_first_n.astype(jnp.int32), last_n.astype(jnp.int32), seq_n)
  # Row N collects the unused trailing chunks; rows padded to a power of two.
  nh = _next_pow2(num_seqs + 1)
  h0 = (jnp.zeros((num_seqs, h, dk, dv), _F32) if initial_state is None
        else initial_state.astype(_F32))
  h0_rows = jnp.concatenate([h0, jnp.zeros((nh - num_seqs, h, dk, dv), _F32)], axis=0)
  o, ht = _core(st, *tensors, gate_bias, h0_rows, *meta)
  o = o[:, layout.dst_index_t]
  if not output_final_state:
    return o, None
  final = jnp.where(layout.empty_s[:, None, None, None], h0, ht[:num_seqs])
  return o, final
