"""The pairwise diagonal's tiles in kernels of their own (`KernelConfig.diag_kernels`).

With `diagonal="pairwise"` (any gate) the scores inside each diagonal tile of
L rows take the exact pair decay e^{G_i - G_j}, formed by the nested anchors
of `kernel_common.level_factors`: log2(L) levels, one masked product per
level and score (here with the unmasked factors, `level_decay`, and each
product masked to its level's pairs, `level_pairs`). Inside the intra-chunk kernels those products are [C, C]
(every level of every tile at once) and run next to all the other terms of
the chunk, at the register cap. Here they run alone, one diagonal tile at a
time: every operand is [L, diag_block_k] and every product [L, L] (forward)
or [L, diag_block_k] (backward), so the tile's levels fit in registers. The
intra-chunk kernels then do only what the dense diagonal does off the
diagonal tiles, and take these kernels' results:

* `diag_scores`, grid (B, H, Tp / R): the diagonal tiles of A_qk (diagonal
  q_i . k_i included) and A_kk, compact: [B, H, Tp, L] f32 each, row i
  holding its tile's columns (`kernel_intra_fwd` adds them);
* `diag_grads`, grid (B, H, Tp / R): the gradients through those scores, dq
  (w.r.t. the scaled q), dk and dG [B, Tp, H*K] f32 and dbeta [B, H, Tp, 1]
  f32, which `kernel_intra_bwd_split`'s second kernel starts its
  accumulators from.

Each program takes R rows (R / L tiles, walked in a loop): `cfg.diag_rows`
for the scores (default one tile), `cfg.diag_bwd_rows` for the gradients
(default a chunk). The tiles are independent, so R trades programs for work
per program.

The products take the score dtype (`cfg.mm_dtype`) operands as the
intra-chunk kernels' do, and the gate gradient uses the rounded operands on
both sides of each product, so dG's terms of a tile still cancel in the
reverse cumsum. GPU (Triton) and interpret only: the TPU path keeps the
levels inside its one-program kernels.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernel_common import (anchor_picker, chunk_specs, dot, iota, k_slices,
                                              level_decay, level_pairs, pair_levels)
from pallas_kernels.kda.kernel_config import KernelConfig

_F32 = jnp.float32


def _levels(ell: int, cfg: KernelConfig, body, carry):
  """`carry = body(s, carry)` over the levels s = L/2, ..., 1: unrolled, or a
  loop with s traced when `cfg.diag_level_loop` (one level's values live at a
  time: the same arithmetic in fewer registers)."""
  levels = pair_levels(ell)
  if not cfg.diag_level_loop:
    for s in levels:
      carry = body(s, carry)
    return carry
  return lax.fori_loop(0, len(levels), lambda i, c: body(jnp.right_shift(ell // 2, i), c), carry)


def _tile_scores(q_ref, k_ref, g_ref, beta_ref, start, *, scale, ell, cfg):
  """(A_qk, A_kk) [L, L] f32 of the diagonal tile whose first row is `start`.

  A_qk holds j <= i (its diagonal q_i . k_i, no decay), A_kk j < i; both
  summed over K slices of cfg.diag_block_k, two products per level and
  slice. Each level's operands are q e and k e with its unmasked factors
  (`level_decay`): k e serves as the row operand of A_kk and the column
  operand of both, the [L, L] products are masked to the level's pairs
  (`level_pairs`), and the scale and beta multiply the [L, L] sums.
  """
  rows = pl.ds(start, ell)
  s_qk = s_kk = jnp.zeros((ell, ell), _F32)
  on_diag = jnp.zeros((ell, 1), _F32)
  for ks in k_slices(cfg, q_ref.shape[1], cfg.diag_block_k):
    g = g_ref[rows, ks]
    q = q_ref[rows, ks].astype(_F32)
    k = k_ref[rows, ks].astype(_F32)
    pick = anchor_picker(cfg, g_ref, start, ks)

    def level(s, acc, g=g, q=q, k=k, pick=pick):
      a_qk, a_kk = acc
      e = level_decay(g, s, pick)
      ke = k * e
      pairs = level_pairs(ell, s)
      return (a_qk + jnp.where(pairs, dot(q * e, ke, cfg, tb=True), 0.0),
              a_kk + jnp.where(pairs, dot(ke, ke, cfg, tb=True), 0.0))

    s_qk, s_kk = _levels(ell, cfg, level, (s_qk, s_kk))
    on_diag = on_diag + jnp.sum(q * k, axis=1, keepdims=True)
  eye = iota((ell, 1), 0) == iota((1, ell), 1)
  return scale * (s_qk + jnp.where(eye, on_diag, 0.0)), beta_ref[rows, :] * s_kk


def _diag_scores_kernel(q_ref, k_ref, g_ref, beta_ref, dqk_ref, dkk_ref, *, scale, ell, cfg):
  """R rows: q_ref, k_ref, g_ref [R, K]; beta_ref [R, 1]; outputs [R, L] f32."""
  def tile(r, carry):
    start = pl.multiple_of(r * ell, ell)
    s_qk, s_kk = _tile_scores(q_ref, k_ref, g_ref, beta_ref, start, scale=scale, ell=ell,
                              cfg=cfg)
    dqk_ref[pl.ds(start, ell), :] = s_qk
    dkk_ref[pl.ds(start, ell), :] = s_kk
    return carry

  lax.fori_loop(0, q_ref.shape[0] // ell, tile, 0)


def diag_scores(q, k, g_cum, beta, *, heads, chunk_size, sub_chunk, scale, cfg: KernelConfig):
  """The pairwise diagonal tiles of A_qk and A_kk, compact.

  Args:
    q, k, g_cum: [B, Tp, H*K] (g_cum the within-chunk cumsum G, f32);
    beta: [B, H, Tp, 1] f32.

  Returns:
    (d_qk, d_kk) [B, H, Tp, L] f32: row i holds A[i, t L + j] for its tile t
    and j < L (A_qk lower with its diagonal, A_kk strictly lower; zero above).
  """
  b, tp, hk = q.shape
  h, ell = heads, sub_chunk
  rows = rows_per_program(cfg.diag_rows, chunk_size)
  dk = hk // h
  spec = chunk_specs(rows, dk, dk)
  tile_spec = pl.BlockSpec((None, None, rows, ell), lambda ib, ih, ir: (ib, ih, ir, 0))
  out = jax.ShapeDtypeStruct((b, h, tp, ell), _F32)
  return pl.pallas_call(
      functools.partial(_diag_scores_kernel, scale=scale, ell=ell, cfg=cfg),
      grid=(b, h, tp // rows), in_specs=[spec.k, spec.k, spec.k, spec.beta],
      out_specs=[tile_spec, tile_spec], out_shape=[out, out],
      compiler_params=cfg.compiler_params("diag_fwd"),
      interpret=cfg.interpret, name="kda_diag_scores",
  )(q, k, g_cum, beta)


def rows_per_program(rows: int | None, chunk_size: int) -> int:
  """R, the rows of one program: `cfg.diag_rows` or `cfg.diag_bwd_rows`
  (checked by `kernel_config.make_config`), or C when None."""
  return chunk_size if rows is None else rows


def expand_tiles(d_ref, ell: int):
  """[C, C] f32 from a compact [C, L] ref: A[i, j] = d[i, j mod L] where i and
  j share an L-row tile, zero elsewhere (one gather load)."""
  c = d_ref.shape[0]
  row, col = iota((c, c), 0), iota((c, c), 1)
  same = jnp.bitwise_and(row, -ell) == jnp.bitwise_and(col, -ell)
  return jnp.where(same, d_ref[row, jnp.bitwise_and(col, ell - 1)], 0.0)


def _diag_grads_kernel(q_ref, k_ref, g_ref, beta_ref, da_ref, daq_ref, dat_ref, daqt_ref,
                       dq_ref, dk_ref, dg_ref, dbeta_ref, *, scale, ell, cfg):
  """R rows' diagonal-tile score gradients (`kernel_common.add_score_grads`
  restricted to the levels). q_ref, k_ref, g_ref [R, K]; beta_ref [R, 1];
  da_ref, daq_ref and their transposes dat_ref, daqt_ref [R, R], the blocks
  of the [C, C] chunk matrices on the diagonal (stored in the score dtype).
  Outputs dq_ref, dk_ref, dg_ref [R, K] f32, dbeta_ref [R, 1] f32."""
  sdt = cfg.mm_dtype
  cfg = cfg.backward()
  rnd = lambda x: x.astype(sdt).astype(_F32)
  eye = iota((ell, 1), 0) == iota((1, ell), 1)

  def tile(r, carry):
    start = pl.multiple_of(r * ell, ell)
    rows = pl.ds(start, ell)
    blocks = {name: ref[rows, rows] for name, ref in
              (("q_row", daq_ref), ("k_row", da_ref), ("q_col", daqt_ref), ("k_col", dat_ref))}
    d_qk = jnp.sum(jnp.where(eye, blocks["q_row"].astype(_F32), 0.0), axis=1, keepdims=True)
    beta = beta_ref[rows, :]
    dbeta = jnp.zeros((ell, 1), _F32)
    for ks in k_slices(cfg, q_ref.shape[1], cfg.diag_block_k):
      g = g_ref[rows, ks]
      q = q_ref[rows, ks].astype(_F32) * scale
      k = k_ref[rows, ks].astype(_F32)
      bk = beta * k
      dq = d_qk * k                      # A_qk[i, i] = q_i . k_i: no decay, no dG term
      dk = d_qk * q
      pick = anchor_picker(cfg, g_ref, start, ks)

      def level(s, acc, g=g, q=q, k=k, bk=bk, pick=pick):
        # The factors unmasked (`level_decay`): the [L, L] blocks masked to
        # the level's pairs select the rows of each operand that count, and
        # every row of t = block @ x outside them is zero.
        dq, dk, dgc, r_acc = acc
        e = level_decay(g, s, pick)
        pairs = {"row": level_pairs(ell, s), "col": level_pairs(ell, s, transpose=True)}
        product = lambda side, x: dot(jnp.where(pairs[side[2:]], blocks[side], 0), x, cfg,
                                      dtype=sdt)
        yk = rnd(k * e)
        xq = rnd(q * e)
        xk = rnd(bk * e)
        t = product("q_row", yk)
        dq = dq + e * t
        dgc = dgc + xq * t
        t = product("k_row", yk)
        r_acc = r_acc + e * t
        dgc = dgc + xk * t
        t = product("q_col", xq) + product("k_col", xk)
        return dq, dk + e * t, dgc - yk * t, r_acc

      zero = jnp.zeros_like(g)
      dq, dk, dgc, r_acc = _levels(ell, cfg, level, (dq, dk, zero, zero))
      dq_ref[rows, ks] = dq
      dk_ref[rows, ks] = dk + beta * r_acc
      dg_ref[rows, ks] = dgc
      dbeta = dbeta + jnp.sum(k * r_acc, axis=1, keepdims=True)
    dbeta_ref[rows, :] = dbeta
    return carry

  lax.fori_loop(0, q_ref.shape[0] // ell, tile, 0)


def diag_grads(q, k, g_cum, beta, da, daq, dat, daqt, *, heads, chunk_size, sub_chunk, scale,
               cfg: KernelConfig):
  """Gradients through the pairwise diagonal tiles' scores.

  Args:
    q, k, g_cum: [B, Tp, H*K]; beta: [B, H, Tp, 1] f32; da, daq, dat, daqt:
      [B, H, Tp, C], the gradients of A_kk and A_qk and their transposes
      (`kernel_intra_bwd_split.intra_bwd_cc`).

  Returns:
    dq (w.r.t. the scaled q), dk, dG [B, Tp, H*K] f32 and dbeta [B, H, Tp, 1]
    f32: the diagonal tiles' part, to which the off-diagonal and state
    terms add.
  """
  b, tp, hk = q.shape
  h, c, ell = heads, chunk_size, sub_chunk
  rows = rows_per_program(cfg.diag_bwd_rows, c)
  per_chunk = c // rows
  dk_ = hk // h
  spec = chunk_specs(rows, dk_, dk_)
  # Program ir's [R, R] block on the diagonal of its chunk's [C, C] matrix.
  diag_block = pl.BlockSpec((None, None, rows, rows),
                            lambda ib, ih, ir: (ib, ih, ir, ir % per_chunk))
  grads = jax.ShapeDtypeStruct((b, tp, hk), _F32)
  return pl.pallas_call(
      functools.partial(_diag_grads_kernel, scale=scale, ell=ell, cfg=cfg),
      grid=(b, h, tp // rows), in_specs=[spec.k, spec.k, spec.k, spec.beta] + [diag_block] * 4,
      out_specs=[spec.k] * 3 + [spec.beta],
      out_shape=[grads] * 3 + [jax.ShapeDtypeStruct((b, h, tp, 1), _F32)],
      compiler_params=cfg.compiler_params("diag_bwd"),
      interpret=cfg.interpret, name="kda_diag_grads",
  )(q, k, g_cum, beta, da, daq, dat, daqt)
