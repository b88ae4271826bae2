"""Context-parallel KDA: the time axis split over the mesh's context axis.

The delta-rule state update is linear in the state, so over one device's
block of tokens the state map is affine:

    S_end = A S_start + B,      A = prod_t (I - beta_t k_t k_t^T) Diag(exp(g_t))   [K, K]
                                B = the state reached from S_start = 0            [K, V]

and so are the outputs: with A_t the product up to token t,

    o_t = o_t(zero start) + S_start^T (A_t^T scale q_t).

Both pieces come out of one local `chunk_kda` call on augmented inputs: the
value columns [v | 0_K] and the start state [0 | I_K]. Each value column of
the state evolves independently, so the first V columns give the zero-start
outputs and B, the last K give `A_t^T scale q_t` (per token) and A.

Devices then all-gather the (A, B) summaries of the context axis, compose
them in order from the true initial state (a scan of n affine maps of size
[K, K] x [K, V], tiny next to the chunk work), and each device adds the
correction for its own incoming state. Gradients come from autodiff through
`shard_map` (the transpose of the all-gather is a reduce-scatter); the
Pallas path keeps its custom VJP for the local call.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from k3jax.sharding import mesh as mesh_lib
from pallas_kernels.kda import api as kda_api
from pallas_kernels.kda import inputs
from pallas_kernels.kda import spec as kda_spec
from pallas_kernels.kda.kernel_config import is_pow2
from pallas_kernels.kda.spec import KdaSpec

_HIGHEST = jax.lax.Precision.HIGHEST


def _batch_axes(mesh: Mesh, batch_axes: Sequence[str], context_axis: str) -> tuple[str, ...]:
  axes = tuple(a for a in batch_axes if a in mesh.axis_names)
  if context_axis in axes:
    raise ValueError(f"context axis {context_axis!r} cannot also shard the batch: {batch_axes}")
  return axes


def _local_summary(q, k, v, g, beta, kernel_kwargs):
  """Zero-start outputs and the affine state map of this device's tokens.

  Returns:
    o0 [B, T, H, V] (q.dtype), qa [B, T, H, K] = A_t^T scale q_t (q.dtype),
    a [B, H, K, K] float32, b [B, H, K, V] float32.
  """
  bsz, _, h, dk = q.shape
  dv = v.shape[-1]
  eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (bsz, h, dk, dk))
  zero_v = jnp.zeros(v.shape[:-1] + (dk,), v.dtype)
  zero_s = jnp.zeros((bsz, h, dk, dv), jnp.float32)
  if kernel_kwargs["spec"].implementation != "pallas" or is_pow2(dk + dv):
    o_aug, s_aug = kda_api.chunk_kda(
        q, k, jnp.concatenate([v, zero_v], -1), g, beta,
        initial_state=jnp.concatenate([zero_s, eye], -1), output_final_state=True,
        **kernel_kwargs)
    return o_aug[..., :dv], o_aug[..., dv:], s_aug[..., dv:], s_aug[..., :dv]
  # Pallas tiles need power-of-two value widths: two calls instead of one.
  o0, b = kda_api.chunk_kda(q, k, v, g, beta, output_final_state=True, **kernel_kwargs)
  qa, a = kda_api.chunk_kda(q, k, zero_v, g, beta, initial_state=eye,
                            output_final_state=True, **kernel_kwargs)
  return o0, qa, a, b


def _batch_sharded(q, k, v, g, beta, h0, output_final_state, mesh, b_axes, kernel_kwargs,
                   gate_activation=None, gate_bias=None, segment_ids=None):
  """`chunk_kda` on each device's own sequences (batch over `b_axes`, whole time axis).

  The compiler cannot split a Pallas kernel call by itself: left to it, every
  device would gather the whole batch and run all of it. Inside `shard_map`
  each device runs only its B / n sequences. h0: [B, H, K, V] float32.
  A fused gate's bias travels as one copy per sequence ([B, ...], sharded
  like the batch; each device reads its first row), so its gradient is the
  plain sum over B of the broadcast, outside the shard_map. segment_ids
  [B, T] (documents in a row) is split like the batch.
  """
  spec = P(b_axes)
  if gate_activation is None:
    bias_b = jnp.zeros((q.shape[0],), jnp.float32)   # unused placeholder
  else:
    bias_b = jnp.broadcast_to(gate_bias[None], (q.shape[0],) + gate_bias.shape)

  def local(q, k, v, g, beta, h0, bias_b, segment_ids):
    gate = ({} if gate_activation is None
            else dict(gate_activation=gate_activation, gate_bias=bias_b[0]))
    return kda_api.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                             segment_ids=segment_ids, **kernel_kwargs, **gate)

  o, final = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 8, out_specs=(spec, spec),
                           check_vma=False)(q, k, v, g, beta, h0, bias_b, segment_ids)
  return o, (final if output_final_state else None)


def _check_documents(segment_ids, n_ctx, context_axis):
  """Documents in a row (segment_ids) run with a context axis of 1."""
  if segment_ids is None:
    return
  if n_ctx > 1:
    raise ValueError(f"the context axis {context_axis!r} is {n_ctx}, and context parallelism "
                     "does not carry document segments; use parallel.context=1, or train "
                     "without segment ids (data.reset_at_boundaries=False)")


def chunk_kda_context_parallel(q, k, v, g, beta, *, mesh: Mesh,
                               context_axis: str = mesh_lib.CONTEXT,
                               batch_axes: Sequence[str] = (mesh_lib.DATA, mesh_lib.FSDP,
                                                            mesh_lib.EXPERT),
                               scale=None, initial_state=None, output_final_state=False,
                               spec: KdaSpec | None = None, implementation=None,
                               interpret=False, gate_activation=None, gate_bias=None,
                               segment_ids=None, **spec_fields):
  """`chunk_kda` with the time axis sharded over `context_axis` of `mesh`.

  Same arguments and results as `pallas_kernels.kda.chunk_kda` (the spec, or
  its fields to build one from, and fla layouts:
  q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] or [B, T, H]; beta
  [B, T, H]; initial_state [B, H, K, V]), except packed sequences
  (cu_seqlens) and grouped value heads, which are not supported here. The
  fused gate (gate_activation, gate_bias) is: inside the kernels when the
  context axis is 1, applied in jnp before the sharded scan otherwise. The
  batch is sharded over
  those of `batch_axes` present in the mesh. With a context axis of 1 this is
  plain `chunk_kda`, except that the Pallas kernels run inside `shard_map` on
  each device's own sequences.

  segment_ids [B, T] (documents packed in each row; the layers pass
  `Segments.run_bt`) restarts the state at every run, as in `chunk_kda`; it
  needs a context axis of 1 (a ValueError names the fix otherwise).

  Requirements: T divisible by the context size (each device's T / n need
  not be a multiple of chunk_size: the local call pads), B divisible by the
  product of the batch axes.

  Returns:
    (o [B, T, H, V] in q.dtype, final_state [B, H, K, V] float32 or None).
  """
  n_ctx = mesh_lib.axis_size(mesh, context_axis)
  _check_documents(segment_ids, n_ctx, context_axis)
  b_axes = _batch_axes(mesh, batch_axes, context_axis)
  spec = kda_spec.resolve(spec, implementation=implementation, **spec_fields)
  kernel_kwargs = dict(scale=scale, spec=spec, interpret=interpret)
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, H, K], got shape {q.shape}")
  bsz, t_len, h, dk = q.shape
  dv = v.shape[-1]
  if t_len % n_ctx:
    raise ValueError(f"sequence length T={t_len} must be divisible by the context axis "
                     f"size {n_ctx}: pad the sequences to a multiple of {n_ctx}")
  n_batch = 1
  for a in b_axes:
    n_batch *= mesh_lib.axis_size(mesh, a)
  if bsz % n_batch:
    raise ValueError(f"batch B={bsz} must be divisible by the batch axes {b_axes} "
                     f"(product {n_batch}): pad the batch to a multiple of {n_batch}")
  if initial_state is not None and initial_state.shape != (bsz, h, dk, dv):
    raise ValueError(f"initial_state must be [B, H, K, V] = {(bsz, h, dk, dv)}, got "
                     f"{initial_state.shape}")
  h0 = (jnp.zeros((bsz, h, dk, dv), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  inputs.check_without_gate(gate_activation, gate_bias)
  if n_ctx == 1:
    if spec.implementation == "pallas" and n_batch > 1:
      return _batch_sharded(q, k, v, g, beta, h0, output_final_state, mesh, b_axes,
                            kernel_kwargs, gate_activation,
                            inputs.gate_bias_or_zeros(gate_activation, g, gate_bias,
                                                      spec.bounded)
                            if gate_activation else None, segment_ids)
    return kda_api.chunk_kda(q, k, v, g, beta, initial_state=initial_state,
                             output_final_state=output_final_state, gate_activation=gate_activation,
                             gate_bias=gate_bias, segment_ids=segment_ids, **kernel_kwargs)
  if gate_activation is not None:
    g = inputs.apply_gate(gate_activation, g, gate_bias, spec)
  bspec = b_axes if b_axes else None
  seq = P(bspec, context_axis)
  # Per-device copies of the start state and of the final state, laid out
  # over the context axis: every value and every cotangent then has exactly
  # one owner, which keeps autodiff through shard_map exact without
  # replication typing (the local chunk_kda scan is not typed for it).
  per_device_state = P(context_axis, bspec)
  h0_n = jnp.broadcast_to(h0[None], (n_ctx,) + h0.shape)

  def local(q, k, v, g, beta, h0_1):
    o0, qa, a, b = _local_summary(q, k, v, g, beta, kernel_kwargs)
    a_all = jax.lax.all_gather(a, context_axis)  # [n, B, H, K, K]
    b_all = jax.lax.all_gather(b, context_axis)  # [n, B, H, K, V]
    s = h0_1[0]
    incoming = []
    for i in range(n_ctx):  # n is small and static: an unrolled composition.
      incoming.append(s)
      s = jnp.einsum("bhij,bhjv->bhiv", a_all[i], s, precision=_HIGHEST) + b_all[i]
    me = jax.lax.axis_index(context_axis)
    s_in = jnp.stack(incoming)[me]
    o = o0.astype(jnp.float32) + jnp.einsum(
        "bthk,bhkv->bthv", qa.astype(jnp.float32), s_in, precision=_HIGHEST)
    return o.astype(q.dtype), s[None]

  o, final_n = jax.shard_map(
      local, mesh=mesh, in_specs=(seq, seq, seq, seq, seq, per_device_state),
      out_specs=(seq, per_device_state), check_vma=False)(q, k, v, g, beta, h0_n)
  # Every device composed the same final state; the last one's is used.
  return o, (final_n[-1] if output_final_state else None)
