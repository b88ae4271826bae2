"""Pallas backward kernels of chunked KDA (backend-neutral bodies).

The backward takes the forward's intra-chunk quantities (M = (I + A_kk)^-1,
W, A_qk) and per-chunk entry states and V' (saved by the forward, or
recomputed; `KernelConfig.save_residuals`), then runs:

* `state_bwd`: grid (V/BV, B, H) on the GPU, chunks in reverse. Carries dS, the
  gradient of the state leaving the chunk:
    dV' = A_qk^T dO + (k e^{G_last - G}) dS
    dS  <- e^{G_last} dS + (q e^G)^T dO - W^T dV'
  and writes dV', the per-chunk dS and d initial_state.
* `intra_bwd`: grid (B, H, chunks), all parallel. From dO, dV', the entry
  state S and dS of one chunk it forms dq, dk, dv, dbeta and dG (the
  gradient of the within-chunk cumsum G; `pallas_op` turns it into dg with a
  reverse cumsum). The anchored score gradients use the same row sub-tiles
  and anchors as the forward; `pairwise` handles diagonal tiles with the
  explicit position-pair decay, one column at a time. Bodies (see
  `intra_bwd_body` for which runs where): `_intra_bwd_rows_kernel` (row
  blocks; the interpret-mode default), `_intra_bwd_kernel`
  (whole-chunk tiles; the TPU default), `kernel_bwd_split` (two kernels, the
  second per K slice; the Triton default; these two share
  `add_score_grads`) and its opt-in row-tile variant
  `kernel_bwd_split_rows`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_config import KernelConfig
from pallas_kernels.kda.kernel_fwd import (chunk_specs, dot, exp, iota, k_slices, onehot_rows,
                                           state_grid, state_launch_options, tile_factors)

_F32 = jnp.float32


# ---------------------------------------------------------------------------
# Reverse state kernel
# ---------------------------------------------------------------------------


def state_decay_grad(ds, s, g_last):
  """Gradient of dG's last row from the state decay S_next = e^{G_last} S + ...

  Args:
    ds: [K', V'] gradient of the state leaving the chunk; s: [K', V'] state
      entering it (either may be stored in bf16; the product and sum are f32).
    g_last: [1, K'] the chunk's last row of G.

  Returns:
    [1, K'] f32: (sum_v dS * S)^T e^{G_last}.
  """
  prod = ds.astype(_F32) * s.astype(_F32)
  return jnp.transpose(jnp.sum(prod, axis=1, keepdims=True)) * exp(g_last)


def state_term_grads(q, k, g, beta, g_ref, do_ref, vn_ref, du_ref, s, ds, cfg: KernelConfig, *,
                     last_row: bool = False):
  """Gradients through a chunk's state terms, for some of its rows and one K slice.

  The terms: O += (q e^G) S (entry state S), S_next = e^{G_last} S +
  (k e^{G_last - G})^T V', and W = M (beta k e^G), whose gradient
  d(beta k e^G) = M^T dW = -dU~ S^T. Shared by the split intra backward's
  second kernel (all rows) and its row-tile variant (one tile's rows).

  Args:
    q (scaled), k, g: [R, K'] f32 rows of the chunk; beta: [R, 1] f32.
    g_ref: [C, K'] ref of the chunk's G (its last row is G_last).
    do_ref, vn_ref, du_ref: [R, V] refs of dO, V' and dU~ of those rows.
    s, ds: [K', V] the slice's rows of the entry state and of the exit-state
      gradient (either dtype). cfg: the intra-backward config.
    last_row: also return dG's last-row term from the state decay,
      sum_rows (k e^{G_last - G}) * (V' dS^T) + (sum_v dS * S)^T e^{G_last}
      (meaningful only when the R rows are the whole chunk).

  Returns:
    dq [R, K'] (w.r.t. the scaled q), dk [R, K'], dG [R, K'], dbeta [R, 1],
    all f32; then the [1, K'] last-row term if last_row.
  """
  eg = exp(g)
  g_last = g_ref[pl.ds(g_ref.shape[0] - 1, 1), :]
  kdec = exp(g_last - g)
  # O += (q e^G) S.
  dqt = dot(do_ref[...], s, cfg, tb=True)
  dq = eg * dqt
  dgc = q * eg * dqt
  # S_next = e^{G_last} S + (k e^{G_last - G})^T V'.
  dkt = dot(vn_ref[...], ds, cfg, tb=True)
  kk = k * kdec
  dk = kdec * dkt
  dgc = dgc - kk * dkt
  if last_row:
    dglast = (jnp.sum(kk * dkt, axis=0, keepdims=True)
              + state_decay_grad(ds, s, g_last))
  # W = M (beta k e^G): d(beta k e^G) = M^T dW = -dU~ S^T.
  dbkg = -dot(du_ref[...], s, cfg, tb=True)
  dbeta = jnp.sum(dbkg * k * eg, axis=1, keepdims=True)
  dk = dk + beta * eg * dbkg
  dgc = dgc + beta * k * eg * dbkg
  return (dq, dk, dgc, dbeta) + ((dglast,) if last_row else ())


def state_bwd_chunk(ds, rows, last_row, q_ref, k_ref, g_ref, w_ref, aqk_ref, do_ref, dvn_ref,
                    *, scale, gated: bool, cfg: KernelConfig):
  """One chunk of the reverse state recurrence (shared by the GPU and TPU kernels).

  Writes dV' = A_qk^T dO + sum_kb (k e^{G_last - G})_kb dS_kb into dvn_ref's
  `rows`. Every element-wise factor is formed on a [C, BK] column slice
  (BK = cfg.block_k; see `kernel_fwd.k_slices`) so only [C, BK] f32
  tiles are live at once.

  Args:
    ds: tuple of K/BK f32 [BK, BV] slices of dS [K, BV], the gradient of the
      state leaving the chunk.
    q_ref, k_ref: the queries and keys, or, when `gated`, the gated queries
      qg = (scale q) e^G and keys kg = k e^{G_last - G} the forward stored
      (cfg.mm_dtype, the dtype these products round them to anyway): then
      no exp is formed on a [C, BK] tile and `scale` is unused.

  Returns:
    dS entering the chunk as a tuple of [BK, BV] slices:
    dS_kb <- e^{G_last,kb} dS_kb + (q e^G)_kb^T dO - W_kb^T dV'.
  """
  slices = k_slices(cfg, q_ref.shape[-1])
  if len(ds) != len(slices):
    raise ValueError(f"dS has {len(ds)} K slices, expected {len(slices)}")

  def gated_k(ks):
    if gated:
      return k_ref[rows, ks]
    return k_ref[rows, ks].astype(_F32) * exp(g_ref[last_row, ks] - g_ref[rows, ks])

  def gated_q(ks):
    if gated:
      return q_ref[rows, ks]
    return q_ref[rows, ks].astype(_F32) * scale * exp(g_ref[rows, ks])

  do = do_ref[rows, :]
  dvn = dot(aqk_ref[rows, :], do, cfg, ta=True)
  for ks, ds_kb in zip(slices, ds):
    dvn = dvn + dot(gated_k(ks), ds_kb, cfg)
  dvn_ref[rows, :] = dvn.astype(dvn_ref.dtype)
  ds_prev = []
  for ks, ds_kb in zip(slices, ds):
    g_last = g_ref[last_row, ks]
    ds_prev.append(jnp.transpose(exp(g_last)) * ds_kb + dot(gated_q(ks), do, cfg, ta=True)
                   - dot(w_ref[rows, ks], dvn, cfg, ta=True))
  return tuple(ds_prev)


def _state_bwd_kernel(first_ref, last_ref, seq_ref, q_ref, k_ref, g_ref, w_ref, aqk_ref,
                      do_ref, dht_ref, dvn_ref, dhs_ref, dh0_ref, *, scale, gated, chunk_size,
                      cfg, varlen):
  """Chunks last to first. Fixed length (not `varlen`) the rows are one
  sequence: dht enters the last chunk and dh0 is stored after the loop (as in
  `kernel_fwd.chunk_state_loop`), without per-chunk metadata reads."""
  c = chunk_size
  tp, dk = q_ref.shape
  nc = tp // c
  bv = do_ref.shape[-1]
  slices = k_slices(cfg, dk)

  def body(j, ds):
    i = nc - 1 - j
    if varlen:
      seq = seq_ref[i]
      ds = tuple(jnp.where(last_ref[i] != 0, dht_ref[seq, ks, :].astype(_F32), ds_kb)
                 for ks, ds_kb in zip(slices, ds))
    base = pl.multiple_of(i * dk, dk)
    for ks, ds_kb in zip(slices, ds):
      dhs_ref[pl.ds(pl.multiple_of(base + ks.start, ks.size), ks.size), :] = (
          ds_kb.astype(dhs_ref.dtype))
    start = pl.multiple_of(i * c, c)
    ds = state_bwd_chunk(ds, pl.ds(start, c), pl.ds(start + c - 1, 1), q_ref, k_ref, g_ref,
                         w_ref, aqk_ref, do_ref, dvn_ref, scale=scale, gated=gated, cfg=cfg)

    if varlen:
      @pl.when(first_ref[i] != 0)
      def _():
        for ks, ds_kb in zip(slices, ds):
          dh0_ref[seq, ks, :] = ds_kb

    return ds

  if varlen:
    lax.fori_loop(0, nc, body, tuple(jnp.zeros((ks.size, bv), _F32) for ks in slices))
    return
  ds_first = lax.fori_loop(0, nc, body,
                           tuple(dht_ref[0, ks, :].astype(_F32) for ks in slices))
  for ks, ds_kb in zip(slices, ds_first):
    dh0_ref[0, ks, :] = ds_kb


def _state_bwd_kernel_tpu(first_ref, last_ref, seq_ref, q_ref, k_ref, g_ref, w_ref, aqk_ref,
                          do_ref, dht_ref, dvn_ref, dhs_ref, dh0_ref, ds_ref, *, scale, gated,
                          cfg):
  """One chunk per grid step, last chunk first; dS in VMEM scratch.

  The scratch holds the whole [K, BV] dS; it is read and written in the same
  K slices as on the GPU (one slice with the TPU default block_k = K).
  """
  nc = pl.num_programs(3)
  i = nc - 1 - pl.program_id(3)
  c = q_ref.shape[0]
  seq = seq_ref[i]
  slices = k_slices(cfg, q_ref.shape[-1])

  @pl.when(last_ref[i] != 0)
  def _():
    ds_ref[...] = dht_ref[seq].astype(_F32)

  ds = tuple(ds_ref[ks, :] for ks in slices)
  for ks, ds_kb in zip(slices, ds):
    dhs_ref[ks, :] = ds_kb.astype(dhs_ref.dtype)
  ds = state_bwd_chunk(ds, pl.ds(0, c), pl.ds(c - 1, 1), q_ref, k_ref, g_ref, w_ref, aqk_ref,
                       do_ref, dvn_ref, scale=scale, gated=gated, cfg=cfg)
  for ks, ds_kb in zip(slices, ds):
    ds_ref[ks, :] = ds_kb

  @pl.when(first_ref[i] != 0)
  def _():
    for ks, ds_kb in zip(slices, ds):
      dh0_ref[seq, ks, :] = ds_kb


def state_bwd(meta, q, k, g_cum, w, a_qk, do, dht, *, heads, chunk_size, scale,
              cfg: KernelConfig, varlen: bool, gated: bool = False):
  """Runs the reverse state kernel.

  Each program carries dS [K, BV] as K/block_k slices of [block_k, BV] and
  does the per-channel work on [C, block_k] tiles (`kernel_fwd.k_slices`).

  Args:
    meta: (first_n, last_n, seq_n) int32 [NC], as for `state_fwd`.
    q, k, g_cum, w: [B, Tp, H*K]; a_qk: [B, H, Tp, C]; do: [B, Tp, H*V].
      With `gated`, q and k are the gated queries (scale q) e^G and keys
      k e^{G_last - G} in cfg.mm_dtype (`kernel_fwd.intra_fwd`'s
      save_gated outputs): the chunk loop then
      forms no exp on a [C, K] tile, the same products with the same
      rounded operands.
    dht: [Nh, H, K, V] f32, gradient of the final states.

  Returns:
    dv_new [B, Tp, H*V] in the intra backward's matmul dtype
    (`KernelConfig.intra(backward=True)`; every later use is an operand of
    such a matmul, so storing it rounded loses nothing), dS per chunk
    [B, H, NC*K, V] in `cfg.saved_state_dtype`, like the entry states
    (gradient of the state leaving each chunk; the loop carries it in f32,
    and the intra backward uses it as a matmul operand, rounded to its
    matmul dtype, and in dG's f32 last-row sum(dS * S), `state_decay_grad`), dh0
    [Nh, H, K, V] f32 (rows of sequences that start; others untouched).
  """
  b, tp, _ = q.shape
  dv = do.shape[-1] // heads
  if cfg.bwd_block_v is not None:
    cfg = dataclasses.replace(cfg, block_v=cfg.bwd_block_v)
  grid = state_grid(q.shape, dv, heads=heads, chunk_size=chunk_size, cfg=cfg, varlen=varlen,
                    num_state_rows=dht.shape[0], reverse=True)
  if cfg.is_tpu:
    kernel = functools.partial(_state_bwd_kernel_tpu, scale=scale, gated=gated, cfg=cfg)
  else:
    kernel = functools.partial(_state_bwd_kernel, scale=scale, gated=gated,
                               chunk_size=chunk_size, cfg=cfg, varlen=varlen)
  return pl.pallas_call(
      kernel, grid=grid.grid,
      in_specs=[grid.meta] * 3 + [grid.k] * 4 + [grid.a, grid.v, grid.state],
      out_specs=[grid.v, grid.chunk_states, grid.state],
      out_shape=[jax.ShapeDtypeStruct((b, tp, heads * dv), cfg.intra(backward=True).mm_dtype),
                 jax.ShapeDtypeStruct((b, heads, (tp // chunk_size) * grid.dk, dv),
                                      cfg.saved_state_dtype),
                 jax.ShapeDtypeStruct(dht.shape, _F32)],
      interpret=cfg.interpret, name="kda_state_bwd",
      **state_launch_options(cfg, "state_bwd", grid),
  )(*meta, q, k, g_cum, w, a_qk, do, dht)


# ---------------------------------------------------------------------------
# Intra-chunk backward kernel
# ---------------------------------------------------------------------------


def pair_tile_grads(q_ref, k_ref, g_ref, beta_ref, daq_l, da_l, start, scale):
  """Gradients through one diagonal tile's explicit pair decay (`pairwise`).

  For rows/columns i, j of the tile (L of them, from `start`):
    A_qk[i, j] = sum_d q_id k_jd e^{G_id - G_jd} (j <= i),
    A_kk[i, j] = beta_i sum_d k_id k_jd e^{G_id - G_jd} (j < i).
  One column j per loop step, as [L, K] work: no [L, L, K] tensor is formed.

  Returns [L, K] each: dq (from dA_qk), dk (column side of dA_qk),
  R = sum_j dA_ij k_j e^{G_i - G_j}, and dk (column side of dA_kk).
  """
  ell = daq_l.shape[0]
  rows = pl.ds(start, ell)
  q_l = q_ref[rows, :].astype(_F32) * scale
  g_l = g_ref[rows, :]
  bk_l = beta_ref[rows, :] * k_ref[rows, :].astype(_F32)
  row_l = iota((ell, 1), 0)
  col_l = iota((1, ell), 1)

  def body(j, carry):
    dq_l, dk_l, r_l, dkc_l = carry
    k_j = k_ref[pl.ds(start + j, 1), :].astype(_F32)
    g_j = g_ref[pl.ds(start + j, 1), :]
    aq_j = jnp.sum(jnp.where(col_l == j, daq_l, 0.0), axis=1, keepdims=True)
    a_j = jnp.sum(jnp.where(col_l == j, da_l, 0.0), axis=1, keepdims=True)
    seen = row_l >= j
    dec = jnp.where(seen, exp(jnp.where(seen, g_l - g_j, 0.0)), 0.0)
    dq_l = dq_l + aq_j * k_j * dec
    r_l = r_l + a_j * k_j * dec
    at_j = row_l == j
    dk_l = jnp.where(at_j, dk_l + jnp.sum(aq_j * q_l * dec, axis=0, keepdims=True), dk_l)
    dkc_l = jnp.where(at_j, dkc_l + jnp.sum(a_j * bk_l * dec, axis=0, keepdims=True), dkc_l)
    return dq_l, dk_l, r_l, dkc_l

  zeros = jnp.zeros(q_l.shape, _F32)
  return lax.fori_loop(0, ell, body, (zeros, zeros, zeros, zeros))


def fold_pair_tile_grads(grads, q_l, k_l, beta_l, refs, daq_l, da_l, start, scale):
  """Adds one diagonal tile's pair-decay gradients (`pair_tile_grads`) to its rows' gradients.

  Args:
    grads: (dq, R, dk, dG) of the tile's L rows, [L, K'] f32 each (R the
      score sum sum_j dA_ij k_j e^{G_i - G_j}, folded into dk and dbeta later).
    q_l (scaled), k_l: [L, K'] f32; beta_l: [L, 1] f32, the tile's rows.
    refs: (q_ref, k_ref, g_ref, beta_ref); daq_l, da_l: the [L, L] diagonal
      blocks of dA_qk and dA (f32); start: the tile's first row.
  """
  dq, r_acc, dk, dg = grads
  p_q, p_qc, p_k, p_kc = pair_tile_grads(*refs, daq_l, da_l, start, scale)
  return (dq + p_q, r_acc + p_k, dk + p_qc + p_kc,
          dg + q_l * p_q - k_l * p_qc + beta_l * k_l * p_k - k_l * p_kc)


def add_score_grads(grads, q, k, g, beta, refs, *, ell, diagonal, cfg: KernelConfig, scale,
                    tile_product, pair_blocks):
  """Adds the gradients through a chunk's anchored score products (all row tiles).

  Scores: A_qk = sum_r (q row_r)(k col_r)^T, A_kk = beta (k row_r)(k col_r)^T,
  with tile r's anchored factors (`tile_factors`). The gate gradient of a
  score is (row operand) * (row-side product) minus (column operand) *
  (column-side product); both sides must use the same rounded operands, or the
  reverse cumsum of dG stops cancelling (with bf16 score operands, dg's
  relative L2 error at B1 T512 H2 D64 was 3.6e-2 without this and 3.1e-3 with
  it). Shared by the one-program and the split intra backward, which differ
  only in how they get the [C, C] gradients of the scores.

  Each product is folded into dq, dk, dG (or R) as soon as it is formed, so
  one [C, K'] product is live at a time next to the accumulators: on the
  GPU these programs run at the register cap.

  Every product takes a whole [C, C] score gradient, not the rows of tile r:
  the column side's right operands (xq, xk) are zero outside tile r, so the
  other rows add exact zeros; the row side's result rows outside tile r are
  not zero but reach the gradients only through row_f, xq and xk, which are
  zero there (they are sums over the same column operand yk as the tile's
  own rows, so of their size). The left operands are then the same for
  every tile: no per-tile mask, and on the GPU each is staged for the
  tensor cores once (the split kernel's SASS fell from 2,920 to 2,552
  instructions).

  Args:
    grads: (dq, dk, dbeta, dG) so far: [C, K'], [C, K'], [C, 1], [C, K'] f32.
    q, k, g: [C, K'] f32 (q scaled; K' the columns this program handles);
      beta: [C, 1] f32.
    refs: (q_ref, k_ref, g_ref, beta_ref) of the same columns (anchors and the
      pairwise diagonal read them).
    tile_product(side, x): for side "q_row" dA_qk x, "q_col" dA_qk^T x,
      "k_row" dA x, "k_col" dA^T x, with the whole [C, C] gradients (their
      operands rounded to the score dtype); x [C, K'] in the score dtype,
      result [C, K'] f32.
    pair_blocks(r, e_cl): the [L, L] diagonal blocks (dA_qk, dA) of tile r,
      f32 (`pairwise` only; e_cl is the tile's exact one-hot embedding).

  Returns:
    grads plus the score terms: dq += the row side of dA_qk; dk += both
    column sides and beta R, with R = sum_j dA_ij k_j e^{G_i - G_j};
    dbeta += sum_d k R; dG += the gate terms.
  """
  dq, dk, dbeta, dgc = grads
  q_ref, k_ref, g_ref, beta_ref = refs
  c = q.shape[0]
  rnd = lambda x: x.astype(cfg.score_mm_dtype).astype(_F32)
  r_acc = jnp.zeros_like(q)
  bk = beta * k
  for r in range(c // ell):
    anchor = g_ref[pl.ds(r * ell, 1), :]
    row_f, col_f = tile_factors(g, anchor, r, ell, diagonal)
    yk = rnd(k * col_f)
    xq = rnd(q * row_f)
    xk = rnd(bk * row_f)
    t = tile_product("q_row", yk)
    dq = dq + row_f * t
    dgc = dgc + xq * t
    t = tile_product("k_row", yk)
    r_acc = r_acc + row_f * t
    dgc = dgc + xk * t
    # Both column sides share col_f and yk: one sum, one fold (and one chain
    # of accumulating matmuls on the GPU).
    t = tile_product("q_col", xq) + tile_product("k_col", xk)
    dk = dk + col_f * t
    dgc = dgc - yk * t
    if diagonal == "pairwise":
      e_cl = onehot_rows(c, ell, r)
      daq_l, da_l = pair_blocks(r, e_cl)
      parts = pair_tile_grads(q_ref, k_ref, g_ref, beta_ref, daq_l, da_l, r * ell, scale)
      p_q, p_qc, p_k, p_kc = (dot(e_cl, x, cfg, dtype=_F32) for x in parts)
      dq = dq + p_q
      dk = dk + p_qc + p_kc
      r_acc = r_acc + p_k
      dgc = dgc + q * p_q - k * p_qc + bk * p_k - k * p_kc
  dk = dk + beta * r_acc
  dbeta = dbeta + jnp.sum(k * r_acc, axis=1, keepdims=True)
  return dq, dk, dbeta, dgc


def _intra_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, do_ref, hs_ref, dhs_ref,
                      vn_ref, dvn_ref, m_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref,
                      *, scale, ell, diagonal, cfg):
  cfg = cfg.intra(backward=True)  # operand dtype of this kernel's matmuls
  c = q_ref.shape[0]
  q = q_ref[...].astype(_F32) * scale
  k = k_ref[...].astype(_F32)
  v = v_ref[...].astype(_F32)
  g = g_ref[...]
  beta = beta_ref[...]
  do = do_ref[...].astype(_F32)
  s = hs_ref[...]          # [K, V] state entering the chunk
  ds = dhs_ref[...]        # [K, V] gradient of the state leaving it
  vn = vn_ref[...]
  dvn = dvn_ref[...]
  m = m_ref[...]
  row_c = iota((c, 1), 0)
  eg = exp(g)
  g_last = g_ref[pl.ds(c - 1, 1), :]
  kdec = exp(g_last - g)

  # O += (q e^G) S.
  dqt = dot(do, s, cfg, tb=True)
  dq = eg * dqt
  dgc = q * eg * dqt
  # S_next = e^{G_last} S + (k e^{G_last - G})^T V'.
  dkt = dot(vn, ds, cfg, tb=True)
  kk = k * kdec
  dk = kdec * dkt
  dgc = dgc - kk * dkt
  dglast = (jnp.sum(kk * dkt, axis=0, keepdims=True)
            + state_decay_grad(ds, s, g_last))
  # V' = U - W S with U = M (beta v), W = M (beta k e^G).
  dw = -dot(dvn, s, cfg, tb=True)
  bkg = beta * k * eg
  bv = beta * v
  dm = dot(dvn, bv, cfg, tb=True) + dot(dw, bkg, cfg, tb=True)
  dbkg = dot(m, dw, cfg, ta=True)
  dbv = dot(m, dvn, cfg, ta=True)
  dv = beta * dbv
  dbeta = jnp.sum(dbv * v, axis=1, keepdims=True) + jnp.sum(dbkg * k * eg, axis=1, keepdims=True)
  dk = dk + beta * eg * dbkg
  dgc = dgc + bkg * dbkg
  # M = (I + A_kk)^-1  =>  dA = -M^T dM M^T on the strictly lower part.
  row, col = iota((c, c), 0), iota((c, c), 1)
  da = jnp.where(row > col, -dot(dot(m, dm, cfg, ta=True), m, cfg, tb=True), 0.0)
  daq = jnp.where(row >= col, dot(do, vn, cfg, tb=True), 0.0)

  # Scores: A_qk = sum_r (q row_r)(k col_r)^T, A_kk = beta (k row_r)(k col_r)^T.
  sdt = cfg.score_mm_dtype
  rnd = lambda x: x.astype(sdt).astype(_F32)

  lhs = {"q": rnd(daq), "k": rnd(da)}        # whole gradients (`add_score_grads`)

  def tile_product(side, x):
    return dot(lhs[side[0]], x, cfg, ta=side.endswith("col"), dtype=sdt)

  def pair_blocks(r, e_cl):
    del r
    return (dot(dot(e_cl, daq, cfg, ta=True, dtype=_F32), e_cl, cfg, dtype=_F32),
            dot(dot(e_cl, da, cfg, ta=True, dtype=_F32), e_cl, cfg, dtype=_F32))

  dq, dk, dbeta, dgc = add_score_grads(
      (dq, dk, dbeta, dgc), q, k, g, beta, (q_ref, k_ref, g_ref, beta_ref), ell=ell,
      diagonal=diagonal, cfg=cfg, scale=scale, tile_product=tile_product,
      pair_blocks=pair_blocks)
  dgc = dgc + jnp.where(row_c == c - 1, dglast, 0.0)

  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
  dg_ref[...] = dgc
  dbeta_ref[...] = dbeta


def _intra_bwd_rows_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, do_ref, hs_ref, dhs_ref,
                           vn_ref, dvn_ref, m_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref,
                           *, scale, ell, diagonal, cfg):
  """Intra-chunk backward by row block: every product touches only the rows it needs.

  For each row block c (L rows) it forms all gradients of those rows and
  writes them once, so no [C, K] accumulator stays live and no product is
  masked to a quarter of its rows:

  * state terms of rows c: do_c S^T, V'_c dS^T ([L, V] x [V, K]);
  * W/U terms: dU~ = M^T dV' restricted to rows c is M[:, c]^T dV'
    ([C, L]^T x [C, V], M's column block read from the ref), and
    d(beta k e^G)_c = -(M[:, c]^T dV') S^T;
  * scores, row side: daq[c, :] and dA[c, :] ([L, C]) times the anchored
    column operand of tile c ([C, K]);
  * scores, column side: for every row tile r >= c the [L, L] block
    (r, c) of daq / dA, transposed, times the anchored row operand of tile r
    ([L, K]); tile r's anchor on both sides keeps the rounded bf16 operands
    of each (i, j) pair identical, so dG's reverse cumsum still cancels.

  dM = dV' (beta v - (beta k e^G) S)^T ([C, C]), and the strictly lower part of
  dA = -M^T dM M^T is formed row block by row block from
  P_c = M[:, c]^T dM ([L, C]). Every matmul dim is L, C, K or V (>= 16 for
  Triton). Shapes and outputs as `_intra_bwd_kernel`.
  """
  cfg = cfg.intra(backward=True)
  c = q_ref.shape[0]
  nb = c // ell
  sdt = cfg.score_mm_dtype
  rnd = lambda x: x.astype(sdt).astype(_F32)
  mdt = cfg.mm_dtype
  s = hs_ref[...].astype(mdt)      # [K, V] state entering the chunk
  ds = dhs_ref[...].astype(mdt)    # [K, V] gradient of the state leaving it
  m = m_ref[...]
  g_last = g_ref[pl.ds(c - 1, 1), :]
  # dM = dV' (beta v - (beta k e^G) S)^T, i.e. dV' U^T + dW (beta k e^G)^T with dW = -dV' S^T.
  bkg_all = beta_ref[...] * k_ref[...].astype(_F32) * exp(g_ref[...])
  z = beta_ref[...] * v_ref[...].astype(_F32) - dot(bkg_all, s, cfg)
  dm = dot(dvn_ref[...], z, cfg, tb=True)
  p_blocks = [dot(m_ref[:, pl.ds(r * ell, ell)], dm, cfg, ta=True) for r in range(nb)]
  # d(S_next) / d(G_last) from the state decay: sum_v dS * S.
  dglast = state_decay_grad(dhs_ref[...], hs_ref[...], g_last)

  row_c = iota((c, 1), 0)
  col_1c = iota((1, c), 1)
  row_l, col_l = iota((ell, 1), 0), iota((1, ell), 1)

  def tile(r):
    """Row tile r: its rows' refs and anchored row operands (<= 1)."""
    rows = pl.ds(r * ell, ell)
    anchor = g_ref[pl.ds(r * ell, 1), :]
    row_f = exp(g_ref[rows, :] - anchor)
    q_r = q_ref[rows, :].astype(_F32) * scale
    bk_r = beta_ref[rows, :] * k_ref[rows, :].astype(_F32)
    return rows, anchor, row_f, q_r, bk_r, rnd(q_r * row_f), rnd(bk_r * row_f)

  for cb in range(nb):
    rows, anchor, row_f, q_c, bk_c, xq_c, xk_c = tile(cb)
    k_c = k_ref[rows, :].astype(_F32)
    v_c = v_ref[rows, :].astype(_F32)
    g_c = g_ref[rows, :]
    beta_c = beta_ref[rows, :]
    do_c = do_ref[rows, :]
    vn_c = vn_ref[rows, :]
    eg_c = exp(g_c)
    # O += (q e^G) S.
    dqt = dot(do_c, s, cfg, tb=True)
    dq = eg_c * dqt
    dg = q_c * eg_c * dqt
    # S_next = e^{G_last} S + (k e^{G_last - G})^T V'.
    kdec = exp(g_last - g_c)
    dkt = dot(vn_c, ds, cfg, tb=True)
    kk = k_c * kdec
    dk = kdec * dkt
    dg = dg - kk * dkt
    dglast = dglast + jnp.sum(kk * dkt, axis=0, keepdims=True)
    # U = M (beta v), W = M (beta k e^G), V' = U - W S.
    dbv = dot(m_ref[:, rows], dvn_ref[...], cfg, ta=True)
    dbkg = -dot(dbv, s, cfg, tb=True)
    dv = beta_c * dbv
    dbeta = (jnp.sum(dbv * v_c, axis=1, keepdims=True)
             + jnp.sum(dbkg * k_c * eg_c, axis=1, keepdims=True))
    dk = dk + beta_c * eg_c * dbkg
    dg = dg + bk_c * eg_c * dbkg

    # Scores, row side: rows c against the columns their tile's matmul sees.
    row_g = row_l + cb * ell
    daq = jnp.where(col_1c <= row_g, dot(do_c, vn_ref[...], cfg, tb=True), 0.0)
    da = jnp.where(col_1c < row_g, -dot(p_blocks[cb], m, cfg, tb=True), 0.0)
    visible = row_c < ((cb + 1) * ell if diagonal == "dense" else cb * ell)
    yk = rnd(jnp.where(visible, k_ref[...].astype(_F32)
                       * exp(jnp.where(visible, anchor - g_ref[...], 0.0)), 0.0))
    t_q = dot(rnd(daq), yk, cfg, dtype=sdt)
    t_k = dot(rnd(da), yk, cfg, dtype=sdt)
    r_acc = row_f * t_k          # sum_j dA_ij k_j e^{G_i - G_j}
    dq = dq + row_f * t_q
    dg = dg + xq_c * t_q + xk_c * t_k

    # Scores, column side: block (r, c) of every row tile r >= c, anchored at r.
    for r in range(cb, nb):
      if r == cb and diagonal != "dense":
        continue
      rows_r, anchor_r, _, _, _, xq_r, xk_r = tile(r)
      daq_rc = dot(do_ref[rows_r, :], vn_c, cfg, tb=True)
      da_rc = -dot(p_blocks[r], m_ref[rows, :], cfg, tb=True)
      if r == cb:
        daq_rc = jnp.where(row_l >= col_l, daq_rc, 0.0)
        da_rc = jnp.where(row_l > col_l, da_rc, 0.0)
      col_f = exp(anchor_r - g_c)
      yk_rc = rnd(k_c * col_f)
      t_c = (dot(rnd(daq_rc), xq_r, cfg, ta=True, dtype=sdt)
             + dot(rnd(da_rc), xk_r, cfg, ta=True, dtype=sdt))
      dk = dk + col_f * t_c
      dg = dg - yk_rc * t_c

    if diagonal == "pairwise":
      daq_cc = jnp.where(row_l >= col_l, dot(do_c, vn_c, cfg, tb=True), 0.0)
      da_cc = jnp.where(row_l > col_l, -dot(p_blocks[cb], m_ref[rows, :], cfg, tb=True), 0.0)
      dq, r_acc, dk, dg = fold_pair_tile_grads(
          (dq, r_acc, dk, dg), q_c, k_c, beta_c, (q_ref, k_ref, g_ref, beta_ref), daq_cc, da_cc,
          cb * ell, scale)

    dk = dk + beta_c * r_acc
    dbeta = dbeta + jnp.sum(k_c * r_acc, axis=1, keepdims=True)
    if cb == nb - 1:
      dg = dg + jnp.where(row_l == ell - 1, dglast, 0.0)
    dq_ref[rows, :] = (dq * scale).astype(dq_ref.dtype)
    dk_ref[rows, :] = dk.astype(dk_ref.dtype)
    dv_ref[rows, :] = dv.astype(dv_ref.dtype)
    dg_ref[rows, :] = dg
    dbeta_ref[rows, :] = dbeta


# Intra-chunk backward bodies (KernelConfig.intra_bwd_impl, besides "auto").
INTRA_BWD_BODIES = ("rows", "tiles", "split", "split_rows")


def intra_bwd_body(cfg: KernelConfig, sub_chunk: int) -> str:
  """Which intra-chunk backward runs, one of INTRA_BWD_BODIES (validates the choice).

  cfg.intra_bwd_impl "auto" picks:
  * Triton (L >= 16): "split" (`kernel_bwd_split`). On the H200 it passed the
    GPU checks, gradients included (f32 KDA at the bound, pairwise GDN,
    varlen, bf16, the bf16 accuracy test at B1 T1024 H4 D128 and the four
    benchmark shapes, with K = 128 in four 32-wide slices), and at B16 T2048 H16 D128 bf16 it took intra_bwd from 16.7 ms
    ("tiles") to 5.9 ms (bwd_block_k 32, 8 warps); "rows" took 12.7 ms.
  * Triton with L < 16: "tiles" (the others need every dot dim >= 16).
  * interpret mode: "rows" (row blocks: the cheapest to emulate).
  * TPU: "tiles" (the Mosaic lowering wants lane-dim column slices of M,
    which "rows" takes; "split" is not lowered for TPU).
  "split_rows" (opt-in) is "split" with its second kernel by row tile
  (`kernel_bwd_split_rows`): it passed the same GPU checks but its second
  kernel was slower at B16 T2048 H16 D128 bf16 (13.1 ms at 8 warps, 7.0 ms
  at 4, against 5.0 ms for "split"). An explicit "split"/"split_rows" on TPU, or
  anything but "tiles" on Triton with L < 16, is a ValueError.
  """
  impl = cfg.intra_bwd_impl
  if impl not in ("auto",) + INTRA_BWD_BODIES:
    raise ValueError(f"intra_bwd_impl must be 'auto' or one of {INTRA_BWD_BODIES}, got {impl!r}")
  if impl.startswith("split") and cfg.is_tpu:
    raise ValueError(f"intra_bwd_impl={impl!r} is not lowered for TPU (backend "
                     f"{cfg.backend!r}); use 'tiles' or 'auto'")
  if impl not in ("auto", "tiles") and cfg.backend == "triton" and sub_chunk < 16:
    raise ValueError(f"intra_bwd_impl={impl!r} on Triton needs sub_chunk >= 16 (a dot dim), "
                     f"got {sub_chunk}; use 'tiles' or 'auto'")
  if impl != "auto":
    return impl
  if cfg.backend == "triton":
    return "split" if sub_chunk >= 16 else "tiles"
  return "tiles" if cfg.is_tpu else "rows"


def intra_bwd(q, k, v, g_cum, beta, do, hs, dhs, v_new, dv_new, m, *, heads, chunk_size,
              sub_chunk, diagonal, scale, cfg: KernelConfig, grad_dtype=_F32):
  """Runs the intra-chunk backward kernel (two kernels for intra_bwd_impl="split").

  Args:
    q, k, g_cum: [B, Tp, H*K]; v, do, v_new, dv_new: [B, Tp, H*V];
    beta: [B, H, Tp, 1] f32; hs, dhs: [B, H, NC*K, V] f32 or bf16 (entry state and
    gradient of the exit state per chunk; hs may be bf16); m: [B, H, Tp, C]
    f32 or bf16; v_new: f32 or bf16 (saved residuals, `residual_dtype`).

    grad_dtype: storage dtype of dq, dk, dv (the inputs' dtype saves a
      separate cast pass over f32 copies; the rounding is the same).

  Returns:
    dq, dk [B, Tp, H*K] (dq w.r.t. the unscaled q), dv [B, Tp, H*V], all
    grad_dtype; dG [B, Tp, H*K] f32 (w.r.t. the within-chunk cumsum),
    dbeta [B, H, Tp, 1] f32.
  """
  impl = intra_bwd_body(cfg, sub_chunk)
  if impl.startswith("split"):
    from pallas_kernels.kda import kernel_bwd_split  # imports this module
    return kernel_bwd_split.intra_bwd_split(
        q, k, v, g_cum, beta, do, hs, dhs, v_new, dv_new, m, heads=heads,
        chunk_size=chunk_size, sub_chunk=sub_chunk, diagonal=diagonal, scale=scale, cfg=cfg,
        grad_dtype=grad_dtype)
  b, tp, hk = q.shape
  h, c = heads, chunk_size
  dk_, dv_ = hk // h, v.shape[-1] // h
  nc = tp // c
  spec = chunk_specs(c, dk_, dv_)
  kspec, vspec, cspec, bspec, sspec = spec.k, spec.v, spec.cc, spec.beta, spec.state
  body = _intra_bwd_rows_kernel if impl == "rows" else _intra_bwd_kernel
  kernel = functools.partial(body, scale=scale, ell=sub_chunk, diagonal=diagonal, cfg=cfg)
  return pl.pallas_call(
      kernel, grid=(b, h, nc),
      in_specs=[kspec, kspec, vspec, kspec, bspec, vspec, sspec, sspec, vspec, vspec, cspec],
      out_specs=[kspec, kspec, vspec, kspec, bspec],
      out_shape=[jax.ShapeDtypeStruct((b, tp, hk), grad_dtype),
                 jax.ShapeDtypeStruct((b, tp, hk), grad_dtype),
                 jax.ShapeDtypeStruct((b, tp, h * dv_), grad_dtype),
                 jax.ShapeDtypeStruct((b, tp, hk), _F32),
                 jax.ShapeDtypeStruct((b, h, tp, 1), _F32)],
      compiler_params=cfg.compiler_params("intra_bwd"),
      interpret=cfg.interpret, name="kda_intra_bwd",
  )(q, k, v, g_cum, beta, do, hs, dhs, v_new, dv_new, m)
