"""Pure-JAX references for chunked KDA / Gated DeltaNet.

Two forms of the same recurrence (docs/design.md, "The math"):

* `naive_recurrent_kda`: the token-by-token loop, the source of truth.
* `chunk_kda_xla`: the chunked (WY) form, in plain jnp, differentiable by
  autodiff. It also serves as the `implementation="xla"` path.

Compute is float32, or float64 when the inputs are float64 (x64 tests).
Layouts follow fla: q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K] (KDA) or [B,T,H]
(GDN); beta [B,T,H]; states [N,H,K,V].
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.kda import tiling
from pallas_kernels.kda import spec as spec_lib
from pallas_kernels.kda import inputs
from pallas_kernels.kda.kernel_common import DIAG_SHIFT as _DIAG_SHIFT
from pallas_kernels.kda.spec import KdaSpec

_HIGHEST = jax.lax.Precision.HIGHEST


def _einsum(spec, *operands):
  return jnp.einsum(spec, *operands, precision=_HIGHEST)


def _compute_dtype(x: jax.Array):
  return jnp.promote_types(x.dtype, jnp.float32)


# ---------------------------------------------------------------------------
# Naive recurrence
# ---------------------------------------------------------------------------


def naive_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None, segment_ids=None):
  """Token-by-token KDA recurrence.

  Per token, with state S [K, V]:
    S <- S * exp(g_t)[:, None]
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale * q_t)

  Args:
    q, k: [B, T, H, K].
    v: [B, T, H, V].
    g: [B, T, H, K] per-channel log-decay, or [B, T, H] scalar per head.
    beta: [B, T, H].
    scale: multiplies q; defaults to K ** -0.5.
    initial_state: [N, H, K, V] or None (zeros); N = B, or the number of
      sequences when `cu_seqlens` is given.
    output_final_state: also return the state after each sequence.
    cu_seqlens: [N + 1] cumulative lengths of packed sequences (needs B == 1);
      the state restarts at every sequence start.
    segment_ids: [B, T] int or None (not with cu_seqlens): the state restarts
      from zero wherever a row's id differs from the previous position's; the
      row's first run starts from initial_state, and the final state is
      that of its last run.

  Returns:
    (o [B, T, H, V] in q.dtype, final_state [N, H, K, V] float32/64 or None).
  """
  args = inputs.validate(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, segment_ids=segment_ids)
  b, t_len, h, dk = q.shape
  dv = v.shape[-1]
  acc = _compute_dtype(q)
  qs = q.astype(acc) * args.scale
  ks, vs = k.astype(acc), v.astype(acc)
  gs = args.g.astype(acc)
  bs = beta.astype(acc)
  num_states = args.num_states
  h0 = (jnp.zeros((num_states, h, dk, dv), acc) if initial_state is None
        else initial_state.astype(acc))

  if cu_seqlens is None:
    start_t = jnp.zeros((t_len,), bool)
    last_t = jnp.zeros((t_len,), bool)
    seq_t = jnp.zeros((t_len,), jnp.int32)
    state0 = h0
  else:
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    pos = jnp.arange(t_len, dtype=jnp.int32)
    seq_t = jnp.searchsorted(cu, pos, side="right").astype(jnp.int32) - 1
    start_t = pos == cu[seq_t]
    last_t = pos == cu[seq_t + 1] - 1
    state0 = jnp.zeros((1, h, dk, dv), acc)
  # [T, B]: where a run starts (never at position 0, the initial state's run).
  run_tb = (jnp.zeros((t_len, b), jnp.int32) if segment_ids is None
            else jnp.moveaxis(tiling.run_index(segment_ids), 1, 0))
  restart_tb = jnp.concatenate([jnp.zeros_like(run_tb[:1], bool), run_tb[1:] != run_tb[:-1]])

  def step(carry, xs):
    state, final = carry
    q_t, k_t, v_t, g_t, b_t, start, last, seq, restart = xs
    if segment_ids is not None:
      state = jnp.where(restart[:, None, None, None], 0.0, state)
    if cu_seqlens is not None:
      state = jnp.where(start, h0[seq][None], state)
    state = state * jnp.exp(g_t)[..., None]
    pred = _einsum("bhk,bhkv->bhv", k_t, state)
    state = state + (b_t[..., None, None] * k_t[..., :, None]) * (v_t - pred)[..., None, :]
    o_t = _einsum("bhk,bhkv->bhv", q_t, state)
    if cu_seqlens is not None:
      final = jnp.where(last, final.at[seq].set(state[0]), final)
    return (state, final), o_t

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (qs, ks, vs, gs, bs))
  (state, final), o = jax.lax.scan(step, (state0, h0),
                                  xs + (start_t, last_t, seq_t, restart_tb))
  o = jnp.moveaxis(o, 0, 1).astype(q.dtype)
  if not output_final_state:
    return o, None
  return o, (state if cu_seqlens is None else final)


# ---------------------------------------------------------------------------
# Chunked form
# ---------------------------------------------------------------------------


def _anchored_scores(x_ck, y_ck, g_cum_ck, *, sub_chunk, diagonal, strict):
  """Causal intra-chunk scores A[i, j] = sum_d x_id y_jd exp(G_id - G_jd).

  Sub-tiles of `sub_chunk` rows; each row sub-tile r is anchored at its first
  row a_r (never a future row). Columns before a_r factor safely (both factors
  <= 1). Diagonal sub-tiles: `dense` reuses the same anchored matmul, whose
  column factor reaches exp(|g_min| (L - 1)); `pairwise` builds the explicit
  [L, L, K] position-pair decay instead.

  Args:
    x_ck, y_ck, g_cum_ck: [..., C, K]; g_cum is the within-chunk cumsum.
    strict: mask j >= i (A_kk) instead of j > i (A_qk).

  Returns:
    [..., C, C] scores, zero outside the causal mask.
  """
  c, dk = x_ck.shape[-2:]
  ell = sub_chunk
  n_tiles = c // ell
  batch = x_ck.shape[:-2]
  row = jnp.arange(c)
  tile_of = row // ell
  causal = (row[:, None] > row[None, :]) if strict else (row[:, None] >= row[None, :])

  x_rlk = x_ck.reshape(batch + (n_tiles, ell, dk))
  g_rlk = g_cum_ck.reshape(batch + (n_tiles, ell, dk))
  g_anchor_rk = g_rlk[..., 0, :]
  # The factors carry e^+-c, c = 29 ln 2, which cancel in each product:
  # unshifted, x e^{G - a} underflows float32 for entries below 0.1 when the
  # column factor reaches e^85 (`kernel_common.DIAG_SHIFT`). The shift sits
  # inside the exponent so that autodiff's cotangent of each factor, the size
  # of the other factor's reciprocal, does not underflow either.
  shift = _DIAG_SHIFT * math.log(2.0)
  x_anch = x_rlk * jnp.exp(g_rlk - g_anchor_rk[..., None, :] + shift)

  # Column factor per row tile: exp(G_a - G_j) for the columns this tile may
  # see. The exponent is masked *before* exp so that no inf (and no NaN in
  # the gradient) is ever formed for future columns.
  if diagonal == "dense":
    visible_rc = tile_of[None, :] <= jnp.arange(n_tiles)[:, None]
  else:
    visible_rc = tile_of[None, :] < jnp.arange(n_tiles)[:, None]
  expo = g_anchor_rk[..., :, None, :] - g_cum_ck[..., None, :, :]
  expo = jnp.where(visible_rc[..., None], expo, 0.0)
  y_anch = jnp.where(visible_rc[..., None], y_ck[..., None, :, :] * jnp.exp(expo - shift), 0.0)
  scores = _einsum("...rik,...rjk->...rij", x_anch, y_anch).reshape(batch + (c, c))

  if diagonal == "pairwise":
    pair_ok = jnp.tril(jnp.ones((ell, ell), bool), -1 if strict else 0)
    diff = g_rlk[..., :, None, :] - g_rlk[..., None, :, :]
    decay = jnp.exp(jnp.where(pair_ok[..., None], diff, -jnp.inf))
    diag_rij = _einsum("...rik,...rjk,...rijk->...rij", x_rlk,
                       y_ck.reshape(batch + (n_tiles, ell, dk)), decay)
    # Block-diagonal [C, C] from the per-tile [L, L] blocks; the anchored
    # scores above are zero on these blocks.
    eye_rs = jnp.eye(n_tiles, dtype=diag_rij.dtype)
    diag_full = diag_rij[..., :, :, None, :] * eye_rs[:, None, :, None]
    scores = scores + diag_full.reshape(batch + (c, c))
  return jnp.where(causal, scores, 0.0)


def _intra_chunk(q_ck, k_ck, v_cv, g_cum_ck, beta_c, *, sub_chunk, diagonal, same_cc=None):
  """Per-chunk WY quantities: W, U, A_qk and the decayed q / k.

  All inputs carry leading batch dims [..., C, *]. same_cc [..., C, C] bool
  (or None): the same-run pairs (`tiling.RunMasks`); A_kk and A_qk keep only
  these, so M is block-diagonal by run.

  Returns:
    w_ck = M (beta k e^G), u_cv = M (beta v), a_qk [C, C], q e^G,
    k e^(G_last - G), e^G_last; with M = (I + A_kk)^-1.
  """
  c = q_ck.shape[-2]
  a_kk = _anchored_scores(beta_c[..., None] * k_ck, k_ck, g_cum_ck,
                          sub_chunk=sub_chunk, diagonal=diagonal, strict=True)
  a_qk = _anchored_scores(q_ck, k_ck, g_cum_ck, sub_chunk=sub_chunk,
                          diagonal=diagonal, strict=False)
  if same_cc is not None:
    a_kk, a_qk = jnp.where(same_cc, a_kk, 0.0), jnp.where(same_cc, a_qk, 0.0)
  eye = jnp.eye(c, dtype=a_kk.dtype)
  lower = eye + a_kk
  rhs = jnp.concatenate([beta_c[..., None] * k_ck * jnp.exp(g_cum_ck),
                         beta_c[..., None] * v_cv], axis=-1)
  sol = jax.scipy.linalg.solve_triangular(lower, rhs, lower=True, unit_diagonal=True)
  dk = k_ck.shape[-1]
  w_ck, u_cv = sol[..., :dk], sol[..., dk:]
  g_last_k = g_cum_ck[..., -1, :]
  q_decay = q_ck * jnp.exp(g_cum_ck)
  k_decay = k_ck * jnp.exp(g_last_k[..., None, :] - g_cum_ck)
  return w_ck, u_cv, a_qk, q_decay, k_decay, jnp.exp(g_last_k)


def chunk_kda_xla(q, k, v, g, beta, *, scale=None, initial_state=None,
                  output_final_state=False, cu_seqlens=None, segment_ids=None,
                  spec: KdaSpec | None = None, **spec_fields):
  """Chunked KDA in plain JAX (the `xla` implementation).

  Same arguments and results as `naive_recurrent_kda`, plus the tiling: a
  validated `spec`, or these fields of one as keywords (`spec_fields`;
  None or left out: KdaSpec's defaults):
    chunk_size: C, the chunk length of the inter-chunk scan.
    diagonal: "dense" (every intra-chunk tile an anchored matmul; needs
      `lower_bound`) or "pairwise" (explicit position-pair decay on the
      diagonal sub-tiles; any gate).
    lower_bound: g_min, the gate's lower bound; validated against `sub_chunk`
      for the dense path.
    sub_chunk: L, the diagonal tile length (divides C).

  T need not be a multiple of C: the tail is zero-padded (g = 0, beta = 0),
  which leaves outputs and states unchanged.

  segment_ids restarts the state inside the chunks, by masks
  (`tiling.RunMasks`; docs/design.md, "Documents in the chunks"): the
  within-chunk cumsum G runs across run starts, as only differences of G
  within one run and masked terms are used. Every factor of the dense
  diagonal is bounded as without runs (the gates are unchanged), and the
  masks are applied to finished products, so no masked entry is ever
  inf or NaN.
  """
  spec = spec_lib.resolve(spec, **spec_fields)
  chunk_size, sub_chunk, diagonal = spec.chunk_size, spec.sub_chunk, spec.diagonal
  args = inputs.validate(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, segment_ids=segment_ids)
  b, t_len, h, dk = q.shape
  dv = v.shape[-1]
  c = chunk_size
  acc = _compute_dtype(q)
  tensors = [q.astype(acc) * args.scale, k.astype(acc), v.astype(acc),
             args.g.astype(acc), beta.astype(acc)]
  h0 = (jnp.zeros((args.num_states, h, dk, dv), acc) if initial_state is None
        else initial_state.astype(acc))

  if cu_seqlens is None:
    tensors = [tiling.pad_time(x, c) for x in tensors]
    n_chunks = tensors[0].shape[1] // c
    first_n = jnp.arange(n_chunks) == 0
    seq_n = jnp.zeros((n_chunks,), jnp.int32)
    h0_b = h0  # [B, H, K, V]: one state per batch row.
  else:
    layout = tiling.pack_varlen(cu_seqlens, t_len, c)
    tensors = [jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)[:, layout.src_index_n]
               for x in tensors]
    n_chunks = layout.num_chunks
    first_n, seq_n = layout.chunk_first_n, layout.chunk_seq_n
    h0_b = jnp.concatenate([h0, jnp.zeros_like(h0[:1])], axis=0)  # row N: unused chunks

  # [B, Nc*C, H, X] -> [Nc, B, H, C, X]
  # ([B, Nc*C, H] for beta -> [Nc, B, H, C].)
  def to_chunks(x):
    return jnp.moveaxis(x.reshape((b, n_chunks, c) + x.shape[2:]), (1, 2), (0, 3))

  qc, kc, vc, gc, bc = [to_chunks(x) for x in tensors]
  g_cum = jnp.cumsum(gc, axis=-2)
  same = None
  if segment_ids is not None:
    runs = tiling.run_masks(segment_ids, c)
    # [B, Nc, C(, C)] -> [Nc, B, 1, C(, C)], broadcast over the heads.
    same, carry, last = (jnp.moveaxis(m, 1, 0)[:, :, None] for m in
                         (runs.same_bncc, runs.carry_bnc, runs.last_bnc))
  w, u, a_qk, q_dec, k_dec, g_last_exp = _intra_chunk(
      qc, kc, vc, g_cum, bc, sub_chunk=sub_chunk, diagonal=diagonal, same_cc=same)
  if segment_ids is not None:
    # Rows of runs started inside the chunk see S = 0; only the last run
    # writes the leaving state, which keeps e^{G_last} S only if it carries S.
    w = jnp.where(carry[..., None], w, 0.0)
    q_dec = jnp.where(carry[..., None], q_dec, 0.0)
    k_dec = jnp.where(last[..., None], k_dec, 0.0)
    g_last_exp = jnp.where(carry[..., -1:], g_last_exp, 0.0)

  def step(state, xs):
    w_c, u_c, aqk_c, qd_c, kd_c, glast_c, first, seq = xs
    if cu_seqlens is None:
      state = jnp.where(first, h0_b, state)
    else:
      state = jnp.where(first, h0_b[seq][None], state)
    v_new = u_c - _einsum("bhck,bhkv->bhcv", w_c, state)
    o_c = _einsum("bhck,bhkv->bhcv", qd_c, state) + _einsum("bhij,bhjv->bhiv", aqk_c, v_new)
    state = glast_c[..., None] * state + _einsum("bhck,bhcv->bhkv", kd_c, v_new)
    return state, (o_c, state)

  state0 = jnp.zeros((b, h, dk, dv), acc)
  state, (o_n, states_n) = jax.lax.scan(
      step, state0, (w, u, a_qk, q_dec, k_dec, g_last_exp, first_n, seq_n))
  # [Nc, B, H, C, V] -> [B, Nc*C, H, V]
  o = jnp.moveaxis(o_n, (0, 3), (1, 2)).reshape(b, n_chunks * c, h, dv)
  if cu_seqlens is None:
    o = o[:, :t_len]
    final = state
  else:
    o = o[:, layout.dst_index_t]
    final = jnp.where(layout.empty_s[:, None, None, None], h0,
                      states_n[layout.last_chunk_s, 0])
  return o.astype(q.dtype), (final if output_final_state else None)
