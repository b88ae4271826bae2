"""Public entry point for chunked KDA / Gated DeltaNet.

    from pallas_kernels.kda import chunk_kda
    o, final_state = chunk_kda(q, k, v, g, beta, lower_bound=-5.0,
                               output_final_state=True, implementation="xla")

Arguments and layouts follow fla's `chunk_kda`: q, k [B,T,H,K]; v [B,T,H,V];
g [B,T,H,K] (KDA) or [B,T,H] (GDN), float32 log-decays; beta [B,T,H];
initial_state [N,H,K,V]; cu_seqlens [N+1] for packed sequences (B == 1).
"""
from __future__ import annotations

import functools

from pallas_kernels.kda import reference
from pallas_kernels.kda import validation

IMPLEMENTATIONS = ("pallas", "xla", "naive")


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None,
              output_final_state=False, cu_seqlens=None, chunk_size=64,
              lower_bound=None, diagonal="dense", sub_chunk=16,
              implementation="xla", interpret=False, config_overrides=None):
  """Chunked KDA: o_t = S_t^T (scale q_t) with the gated delta-rule state.

  Args:
    q, k: [B, T, H, K] (unit-norm k is expected by the delta rule).
    v: [B, T, H, V].
    g: [B, T, H, K] or [B, T, H] log-decay, every entry in [lower_bound, 0).
    beta: [B, T, H] write strength in [0, 1].
    scale: multiplies q; defaults to K ** -0.5.
    initial_state: [N, H, K, V] or None.
    output_final_state: also return the final state(s).
    cu_seqlens: [N + 1] int cumulative lengths of packed sequences, or None.
    chunk_size: C, chunk length of the inter-chunk recurrence.
    lower_bound: g_min of the gate; required by diagonal="dense", which is
      legal only when |g_min| * (sub_chunk - 1) <= tiling.MAX_EXP_ARG.
    diagonal: "dense" (bounded gates: all tiles as anchored matmuls) or
      "pairwise" (explicit position-pair decay on diagonal tiles; any gate).
    sub_chunk: L, the diagonal tile length; divides chunk_size.
    implementation: "pallas" (Pallas kernels, custom VJP), "xla" (chunked
      jnp), or "naive" (token loop; chunk arguments are ignored).
    interpret: run Pallas kernels in interpret mode (CPU tests).
    config_overrides: dict of `kernel_config.KernelConfig` fields forced on
      the pallas path (e.g. {"intra_bwd_impl": "rows"}) for A/B runs.

  Returns:
    (o [B, T, H, V] in q.dtype, final_state [N, H, K, V] float32 or None).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if config_overrides and implementation != "pallas":
    raise ValueError(f"config_overrides apply to implementation='pallas' only, got "
                     f"implementation={implementation!r}")
  if implementation == "naive":
    return reference.naive_recurrent_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens)
  kwargs = dict(scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                chunk_size=chunk_size, diagonal=diagonal, lower_bound=lower_bound,
                sub_chunk=sub_chunk)
  if implementation == "xla":
    return reference.chunk_kda_xla(q, k, v, g, beta, **kwargs)
  args = validation.validate(q, k, v, g, beta, **{n: kwargs[n] for n in (
      "scale", "initial_state", "cu_seqlens", "chunk_size", "diagonal",
      "lower_bound", "sub_chunk")})
  pallas_fn = _pallas_entry()
  kwargs["scale"] = args.scale
  return pallas_fn(q, k, v, args.g, beta, interpret=interpret,
                   config_overrides=config_overrides, **kwargs)


@functools.cache
def _pallas_entry():
  try:
    from pallas_kernels.kda import pallas_op  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise NotImplementedError(
        "implementation='pallas' is not available in this build "
        f"({e}); use implementation='xla'.") from e
  return pallas_op.chunk_kda_pallas
