"""Recurrent KDA decode step: a few new tokens against a batch of states.

`kda_decode_step` advances the float32 state S [B, H, K, V] by T_new tokens
(1 to `MAX_DECODE_TOKENS`) with the naive recurrence, per token t:

    S <- S * exp(g_t)[:, None]
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale * q_t)

Decoding is memory-bound: per token the work is a few multiply-adds per state
element, so the floor is the state's bytes (read once, written once) over the
memory bandwidth (`state_roofline_s`). Implementations (`DECODE_IMPLEMENTATIONS`):

* "pallas": one kernel, grid (B, H, V/BV). A program loads its [K, BV] f32
  state tile once, loops over the tokens with the tile in registers, and
  writes it back once into the same buffer (`input_output_aliases`). Runs on
  the GPU (Triton lowering) or interpreted (`interpret=True`, CPU tests).
* "fused": the same loop in element-wise jnp (multiply + reduce, no matmul),
  unrolled over the tokens, for XLA to fuse; any backend.
* "naive": `reference.naive_recurrent_kda` (a `lax.scan` of einsums), the
  source of truth.

"auto" (`resolve_decode`) picks what measured fastest: on the GPU the kernel
for steps of 2 or more tokens, and for single tokens once the batch holds
`MIN_KERNEL_STATES_ONE_TOKEN` states (B * H); the fused step for smaller
single-token steps and on every other backend. At H16, K = V = 128, bf16
(docs/benchmarks.md, "Decode step") the kernel with BV 128 and 8 warps took
0.78x / 0.72x the fused step's time at 4 tokens (B 8 / 64) and 0.53x at 16
(B 8) on one H200. At 1 token it took 0.97x (H200) and 0.90x (H100) at B 64,
but at B 8 1.31x (H200) against 0.96x (H100), and 1.40x at B 1 (H100).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kda import reference
from pallas_kernels.kda import inputs
from pallas_kernels.platform import interprets
from pallas_kernels.sizes import is_pow2

DECODE_IMPLEMENTATIONS = ("pallas", "fused", "naive")
# Tokens per call: the kernel unrolls its token loop, so the step is meant for
# decoding and short drafts; longer spans belong to the chunked prefill.
MAX_DECODE_TOKENS = 16
# The kernel's default tiling: V tiles of up to 128 columns, 8 warps (on the
# H200 2.0x faster than BV 32 with 4 warps at 1 token, 1.6x at 4, B 8).
DEFAULT_BLOCK_V = 128
DEFAULT_NUM_WARPS = 8
# States (B * H) from which "auto" runs a single-token step on the kernel. The
# kernel's grid holds B * H * V / BV programs: 1024 at B 64, H 16 (several per
# SM), where it beat the fused step on both GPUs; at 128 (B 8) the GPUs disagreed.
MIN_KERNEL_STATES_ONE_TOKEN = 1024

_F32 = jnp.float32


def resolve_decode(implementation: str, t_new: int | None = None, head_k: int | None = None,
                   platform: str | None = None, *, states: int | None = None) -> str:
  """The implementation a step of `t_new` tokens over `states` (B * H) states of
  head width `head_k` runs on `platform`.

  "auto" is "pallas" on the GPU ("gpu") when K is a power of two (the kernel's
  Triton tiles) and either t_new >= 2 or states >= `MIN_KERNEL_STATES_ONE_TOKEN`,
  else "fused" (module docstring); t_new None (unknown) resolves like 1 and
  states None like a small batch. platform defaults to `jax.default_backend()`.
  Other names are checked and returned.
  """
  if implementation == "auto":
    platform = jax.default_backend() if platform is None else platform
    multi = t_new is not None and t_new >= 2
    wide = states is not None and states >= MIN_KERNEL_STATES_ONE_TOKEN
    tiles = head_k is None or is_pow2(head_k)
    compiled = not interprets("kda_decode", platform)
    return "pallas" if compiled and (multi or wide) and tiles else "fused"
  if implementation not in DECODE_IMPLEMENTATIONS:
    raise ValueError(f"decode implementation must be 'auto' or one of {DECODE_IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  return implementation


def state_bytes(batch: int, heads: int, dk: int, dv: int) -> int:
  """Bytes of the f32 state [B, H, K, V] read plus written by one decode step."""
  return 2 * 4 * batch * heads * dk * dv


def state_roofline_s(batch: int, heads: int, dk: int, dv: int,
                     bandwidth_bytes_s: float = 3.5e12) -> float:
  """The memory floor of one step: `state_bytes` over `bandwidth_bytes_s` (seconds)."""
  return state_bytes(batch, heads, dk, dv) / bandwidth_bytes_s


def _validate(q, k, v, g, beta, state, scale):
  """Shared checks; returns (scale, g [B, T, H, K] f32)."""
  if state is None:
    raise ValueError("state must be the [B, H, K, V] float32 decode state, got None")
  args = inputs.validate(q, k, v, g, beta, scale=scale, initial_state=state)
  if state.dtype != _F32:
    raise TypeError(f"state must be float32 (the decode state is kept exact), got {state.dtype}")
  t_new = q.shape[1]
  if not 1 <= t_new <= MAX_DECODE_TOKENS:
    raise ValueError(f"kda_decode_step takes 1 to {MAX_DECODE_TOKENS} new tokens, got "
                     f"T_new={t_new} (q shape {q.shape}); run longer spans through chunk_kda "
                     "with initial_state")
  return args.scale, args.g


def kda_decode_step(q, k, v, g, beta, state, *, scale=None, implementation: str = "auto",
                    block_v: int | None = None, num_warps: int | None = None,
                    interpret: bool = False):
  """Advances the decode states by T_new tokens.

  Args:
    q, k: [B, T_new, H, K] (unit-norm k for a contracting update), 1 <= T_new
      <= MAX_DECODE_TOKENS.
    v: [B, T_new, H, V].
    g: [B, T_new, H, K] per-channel log-decay, or [B, T_new, H] (GDN).
    beta: [B, T_new, H].
    state: [B, H, K, V] float32, the state before the first new token.
    scale: multiplies q; defaults to K ** -0.5.
    implementation: "auto" or one of DECODE_IMPLEMENTATIONS (module docstring).
    block_v: "pallas" only: V tile BV of one program (a power of two dividing
      V; default the largest power of two dividing V, at most DEFAULT_BLOCK_V).
    num_warps: "pallas" on the GPU only: warps per program (default
      DEFAULT_NUM_WARPS).
    interpret: "pallas" only: run the kernel interpreted (CPU tests).

  Returns:
    (o [B, T_new, H, V] in q.dtype, new state [B, H, K, V] float32).
  """
  scale, g = _validate(q, k, v, g, beta, state, scale)
  impl = resolve_decode(implementation, q.shape[1], q.shape[-1], states=q.shape[0] * q.shape[2])
  if impl != "pallas" and (block_v is not None or num_warps is not None):
    raise ValueError(f"block_v / num_warps tune the 'pallas' decode kernel; implementation="
                     f"{implementation!r} resolved to {impl!r}")
  if impl == "naive":
    o, new_state = reference.naive_recurrent_kda(q, k, v, g, beta, scale=scale,
                                                 initial_state=state, output_final_state=True)
    return o, new_state.astype(_F32)
  if impl == "fused":
    return _fused_step(q, k, v, g, beta, state, scale=scale)
  if not interpret and interprets("kda_decode"):
    raise ValueError(f"the pallas decode kernel runs on the GPU or with interpret=True; the "
                     f"default backend is {jax.default_backend()!r}: use implementation='fused'")
  return decode_step_pallas(q, k, v, g, beta, state, scale=scale, block_v=block_v,
                            num_warps=num_warps, interpret=interpret)


def _fused_step(q, k, v, g, beta, state, *, scale):
  """The recurrence unrolled over T_new in element-wise f32 jnp."""
  s = state
  outs = []
  for t in range(q.shape[1]):
    q_t = q[:, t].astype(_F32)[..., None] * scale    # [B, H, K, 1]
    k_t = k[:, t].astype(_F32)[..., None]
    s = s * jnp.exp(g[:, t])[..., None]
    pred = jnp.sum(k_t * s, axis=-2)                   # [B, H, V]
    delta = beta[:, t].astype(_F32)[..., None] * (v[:, t].astype(_F32) - pred)
    s = s + k_t * delta[..., None, :]
    outs.append(jnp.sum(q_t * s, axis=-2))
  return jnp.stack(outs, axis=1).astype(q.dtype), s


def _decode_kernel(q_ref, k_ref, g_ref, beta_ref, v_ref, s_ref, o_ref, s_out_ref, *,
                   t_new: int, scale: float):
  """One (batch row, head, V tile): the state tile [K, BV] stays in registers.

  q/k/g refs are [Tp, K], beta [Tp, 1], v and o [Tp, BV]: one row per token.
  A token's q, k and g rows are turned into [K, 1] columns against the tile.
  Only the first t_new rows are real; padded rows are neither read nor written.
  """
  s = s_ref[...].astype(_F32)
  column = lambda ref, row: jnp.transpose(ref[row, :].astype(_F32))  # [1, K] -> [K, 1]
  for t in range(t_new):
    row = pl.ds(t, 1)
    k_t = column(k_ref, row)
    s = s * jnp.exp(column(g_ref, row))
    pred = jnp.sum(k_t * s, axis=0, keepdims=True)               # [1, BV]
    delta = beta_ref[row, :].astype(_F32) * (v_ref[row, :].astype(_F32) - pred)
    s = s + k_t * delta
    q_t = column(q_ref, row) * scale
    o_ref[row, :] = jnp.sum(q_t * s, axis=0, keepdims=True).astype(o_ref.dtype)
  s_out_ref[...] = s


def decode_step_pallas(q, k, v, g, beta, state, *, scale: float, block_v: int | None = None,
                       num_warps: int | None = None, interpret: bool = False):
  """The "pallas" decode kernel on validated inputs (`kda_decode_step` checks them).

  Shapes as `kda_decode_step`, with g already [B, T_new, H, K] f32. Lowers
  for the GPU (Triton) whatever the default backend, so it can be lowered
  for CUDA on a CPU machine (`pallas_kernels.tools.decode_ir`).

  Returns:
    (o [B, T_new, H, V] in q.dtype, new state [B, H, K, V] float32).
  """
  b, t_new, h, dk = q.shape
  dv = v.shape[-1]
  bv = min(DEFAULT_BLOCK_V, dv & -dv) if block_v is None else block_v
  if not (isinstance(bv, int) and is_pow2(bv) and dv % bv == 0):
    raise ValueError(f"block_v must be a power of two dividing V={dv}, got {block_v!r}")
  if not is_pow2(dk):
    raise ValueError(f"the pallas decode kernel needs K a power of two (Triton tiles), got "
                     f"K={dk}; use implementation='fused'")
  warps = DEFAULT_NUM_WARPS if num_warps is None else num_warps
  if not (isinstance(warps, int) and is_pow2(warps)):
    raise ValueError(f"num_warps must be a power of two, got {num_warps!r}")
  # Triton tiles are powers of two: pad the token axis (never read back).
  # Otherwise the kernel reads the inputs where they lie (free reshapes).
  tp = 1 << (t_new - 1).bit_length()
  pad = lambda x: x if tp == t_new else jnp.pad(
      x, ((0, 0), (0, tp - t_new)) + ((0, 0),) * (x.ndim - 2))
  rows = lambda x: pad(x).reshape(b, tp, -1)                    # [B, Tp, H*X]
  nv = dv // bv
  head_spec = pl.BlockSpec((None, tp, dk), lambda ib, ih, iv: (ib, 0, ih))
  beta_spec = pl.BlockSpec((None, tp, None, 1), lambda ib, ih, iv: (ib, 0, ih, 0))
  v_spec = pl.BlockSpec((None, tp, bv), lambda ib, ih, iv: (ib, 0, ih * nv + iv))
  state_spec = pl.BlockSpec((None, None, dk, bv), lambda ib, ih, iv: (ib, ih, 0, iv))
  params = None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=1)
  o, new_state = pl.pallas_call(
      functools.partial(_decode_kernel, t_new=t_new, scale=float(scale)),
      grid=(b, h, nv),
      in_specs=[head_spec, head_spec, head_spec, beta_spec, v_spec, state_spec],
      out_specs=[v_spec, state_spec],
      out_shape=[jax.ShapeDtypeStruct((b, tp, h * dv), q.dtype),
                 jax.ShapeDtypeStruct(state.shape, _F32)],
      input_output_aliases={5: 1}, compiler_params=params, interpret=interpret,
      name="kda_decode_step",
  )(rows(q), rows(k), rows(g), pad(beta)[..., None], rows(v), state)
  o = o.reshape(b, tp, h, dv)
  return (o if tp == t_new else o[:, :t_new]), new_state
