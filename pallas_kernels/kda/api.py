"""Public entry point for chunked KDA / Gated DeltaNet.

    from pallas_kernels.kda import chunk_kda
    o, final_state = chunk_kda(q, k, v, g, beta, lower_bound=-5.0,
                               output_final_state=True, implementation="xla")

Arguments and layouts follow fla's `chunk_kda`: q, k [B,T,H,K]; v [B,T,HV,V];
g [B,T,HV,K] (KDA) or [B,T,HV] (GDN), float32 log-decays; beta [B,T,HV];
initial_state [N,HV,K,V]; cu_seqlens [N+1] for packed sequences (B == 1), or
segment_ids [B,T] for documents packed in the rows.
HV = H unless value heads are grouped. The tiling and implementation choices
travel as one `KdaSpec`; the optional fused gate, q/k L2 norm and grouped
value heads are described in `inputs`.
"""
from __future__ import annotations

from pallas_kernels.kda import inputs
from pallas_kernels.kda import pallas_op
from pallas_kernels.kda import reference
from pallas_kernels.kda import spec as spec_lib
from pallas_kernels.kda.spec import IMPLEMENTATIONS, KdaSpec

__all__ = ["IMPLEMENTATIONS", "KdaSpec", "chunk_kda"]


def chunk_kda(q, k, v, g, beta, *, spec: KdaSpec | None = None, scale=None, initial_state=None,
              output_final_state=False, cu_seqlens=None, segment_ids=None, implementation=None,
              interpret=False, config_overrides=None, gate_activation=None, gate_bias=None,
              qk_l2norm=False, checked=False, **spec_fields):
  """Chunked KDA: o_t = S_t^T (scale q_t) with the gated delta-rule state.

  Args:
    q, k: [B, T, H, K] (unit-norm k is expected by the delta rule).
    v: [B, T, HV, V]; HV = G * H (G > 1: grouped value heads, value head j
      reads q/k head j // G).
    g: [B, T, HV, K] or [B, T, HV] log-decay, every entry in [lower_bound, 0]
      (dense diagonal) or <= 0 (pairwise, naive); with gate_activation, the
      gate's pre-activation (any float dtype). Concrete log-decays outside
      that range, or NaN, raise ValueError; traced ones raise only with
      `checked`, and by default the dense path (xla and pallas) clamps g into
      [lower_bound, 0] (gradient 0 outside the range); a NaN passes the
      clamp (see "Non-finite inputs").
    beta: [B, T, HV] write strength in [0, 1]: a concrete beta outside it (or
      NaN) raises ValueError, a traced one only with `checked`.
    spec: the tiling and implementation (`KdaSpec`, validated when built).
    implementation, spec_fields: without `spec`, KdaSpec's fields
      (chunk_size, sub_chunk, diagonal, lower_bound, implementation) as
      keywords build one (None or left out: KdaSpec's defaults: 64, 16,
      "dense", None, "xla"); with it they must be left out.
    scale: multiplies q; defaults to K ** -0.5.
    initial_state: [N, H, K, V] or None.
    output_final_state: also return the final state(s).
    cu_seqlens: [N + 1] int cumulative lengths of packed sequences, or None.
      A concrete one must rise from 0 to T (ValueError otherwise); a traced
      one is checked only with `checked`, else made valid by clipping into
      [0, T], a running maximum and ends pinned to 0 and T.
    segment_ids: [B, T] int or None; not with cu_seqlens. The state restarts
      from zero wherever a row's id differs from the previous position's
      (every run of equal ids is its own document; ids need not be
      distinct across runs). The first run of row b starts from
      initial_state[b] (zeros without one), and the final state is that of
      the row's last run. The chunk grid stays that of the plain call: the
      restarts are masks inside the chunk computations
      (`tiling.RunMasks`), on every implementation.
    interpret: run Pallas kernels in interpret mode (CPU tests).
    config_overrides: dict of `kernel_config.KernelConfig` fields forced on
      the pallas path (e.g. {"intra_bwd": "tiles"}) for A/B runs.
    gate_activation: None (g is the log-decay) or "bounded_sigmoid": the
      log-decay is lower_bound * sigmoid(g + gate_bias), formed inside the
      Pallas gate-cumsum kernels (and in jnp by the other implementations).
      Needs a lower_bound. The activated gate lies in [lower_bound, 0] by
      construction, so only NaN pre-activations and cu_seqlens are checked then.
    gate_bias: [HV, K] (or [HV] for a [B, T, HV] gate) added to g before the
      sigmoid; None: zeros. Only with gate_activation.
    qk_l2norm: normalise q and k over K first (eps
      `inputs.QK_L2NORM_EPS`), gradients included.
    checked: under jit, emit `jax.experimental.checkify` checks of the gate
      range, of NaN gates, of beta's range and of cu_seqlens; wrap the caller
      in `checkify.checkify` and call `err.throw()` (without the wrapper, jit
      refuses the checks).

  Returns:
    (o [B, T, HV, V] in q.dtype, final_state [N, HV, K, V] float32 or None).

  Non-finite inputs: the chunked forms (xla, pallas) mix the tokens of a
  chunk through matmuls, so a NaN or inf in k, v, g or beta at position t
  also reaches the outputs (and gradients) of earlier positions of its chunk
  (C tokens, or its sequence's chunk with cu_seqlens); the naive form keeps
  it causal. Finite inputs are unaffected. Unchecked traced calls do not
  look for NaN: a NaN gate or beta gives NaN outputs over its chunk.
  """
  impl = spec.implementation if isinstance(spec, KdaSpec) else implementation or "xla"
  if config_overrides and impl != "pallas":
    raise ValueError(f"config_overrides apply to implementation='pallas' only, got "
                     f"implementation={impl!r}")
  spec = spec_lib.resolve(spec, implementation=implementation, **spec_fields)
  inputs.check_without_gate(gate_activation, gate_bias)
  groups = inputs.value_groups(q, v)  # shapes before values
  total_len = q.shape[1] if q.ndim > 1 else 0
  clamp = False  # the activated gate is in [lower_bound, 0] by construction
  inputs.check_beta(beta, checked=checked)
  if gate_activation is None:
    clamp, cu_seqlens = inputs.check_inputs(g, cu_seqlens, spec=spec, total_len=total_len,
                                                  checked=checked)
  else:
    inputs.check_not_nan("g (the gate's pre-activation)", g, checked=checked)
    cu_seqlens = inputs.check_cu_seqlens(cu_seqlens, total_len, checked=checked)
  kwargs = dict(scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                segment_ids=segment_ids)
  if qk_l2norm:
    q, k = inputs.l2_normalize(q), inputs.l2_normalize(k)
  q = inputs.expand_value_groups(q, groups)
  k = inputs.expand_value_groups(k, groups)
  if gate_activation is not None and spec.implementation == "pallas":
    return pallas_op.chunk_kda_pallas(
        q, k, v, g, beta, spec=spec, interpret=interpret, config_overrides=config_overrides,
        gate_activation=gate_activation, gate_bias=gate_bias, **kwargs)
  if gate_activation is not None:
    g = inputs.apply_gate(gate_activation, g, gate_bias, spec)
  if spec.implementation == "naive":
    return reference.naive_recurrent_kda(q, k, v, g, beta, **kwargs)
  if spec.implementation == "xla":
    if clamp:  # elementwise in the same XLA program as the chunked form
      g = spec.clamp(g)
    return reference.chunk_kda_xla(q, k, v, g, beta, spec=spec, **kwargs)
  # The kernels clamp inside the gate cumsum, which reads g anyway: a clamp
  # here would be a separate pass over the f32 gate (and its VJP another over
  # dg), about 5-9% of the op's GPU time.
  return pallas_op.chunk_kda_pallas(q, k, v, g, beta, spec=spec, interpret=interpret,
                                    config_overrides=config_overrides, clamp_gates=clamp,
                                    **kwargs)
