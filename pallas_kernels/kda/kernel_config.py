"""Tile sizes and per-backend compiler parameters of the Pallas KDA kernels.

Everything that differs between the Triton (GPU), Mosaic (TPU) and interpret
(CPU) lowerings lives here; the kernel bodies in `kernel_fwd.py` and
`kernel_bwd.py` are backend-neutral and ask this module for:

* `compiler_params(stage)`: the `pallas_call` compiler parameters,
* `dot_precision(dtype)`: the precision of matmuls whose operands are `dtype`,
* `meta_block_spec(n)`: where per-chunk integer metadata lives (SMEM on TPU).

Structural difference: on TPU the state kernels walk the chunks as the last,
sequential ("arbitrary") grid axis with the state in VMEM scratch, so only
one chunk of each input is resident; on the GPU (Triton has no sequential
grid axis) each program loops over the chunks of a whole-sequence block.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BACKENDS = ("triton", "tpu", "interpret", "tpu_interpret")

# Ways of forming M = (I + A_kk)^-1 in the intra-chunk forward.
INVERSES = ("blocked", "substitution")

# Kernel stages, each a separate pallas_call ("intra_bwd_cc" and "intra_bwd_k"
# are the two kernels of the split intra backward, "intra_bwd" the one-program
# bodies, "state_rec" and "output_fwd" the two
# kernels of the split forward state pass, "cumsum" the within-chunk gate
# cumsum, "intra_wu" the W/U kernel of the split intra forward).
STAGES = ("cumsum", "intra_fwd", "intra_wu", "state_fwd", "state_rec", "output_fwd",
          "state_bwd", "intra_bwd", "intra_bwd_cc", "intra_bwd_k")

# Intra-chunk forward bodies (KernelConfig.intra_fwd_impl).
INTRA_FWD_IMPLS = ("fused", "split")

# Operands of the blocked inverse's products on the diagonal tiles
# (KernelConfig.inverse_diag).
INVERSE_DIAGS = ("f32", "bf16x3", "bf16")

# Schedules of the blocked inverse (KernelConfig.blocked_inverse).
BLOCKED_INVERSES = ("stacked", "recursive")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static tiling and lowering choices for one call of the KDA kernels.

  Attributes:
    backend: "triton" (GPU), "tpu" (Mosaic), "interpret" (generic CPU
      emulation) or "tpu_interpret" (CPU emulation with TPU semantics:
      SMEM metadata, TPU compiler parameters, `pltpu.InterpretParams`).
    block_v: V-tile of the state kernels (their grid is B x H x V/block_v).
    block_k: K-slice width of the element-wise work of the intra-chunk
      forward (the "blocked" body's scores; W, U and the gated keys and
      queries of both bodies) and of the state kernels. Per-channel gate
      factors are separable across K, so those kernels walk K in slices of
      block_k and accumulate the K-contracted products: live [C, block_k] f32
      tiles instead of [C, K] ones (a [64, 128] f32 tile alone is 64
      registers per thread at 4 warps). Default min(K, 64) on the GPU and in
      interpret mode, K on TPU (lane-dim slices). On the H200 (bf16, B16
      T2048 H16 D128, blocked inverse, block_v 64) intra_fwd took 4.75 ms
      unsliced, 3.77 ms at block_k 32 and 3.30 ms at 64. The one-program intra
      backward ("rows", "tiles") does not slice: a sliced "tiles" body matched
      in interpret mode but gave wrong f32 gradients on the H200 with more
      than one slice (dk 3.2e-2 at block_k 32), and was no faster in bf16.
      The "split" backward slices K by `bwd_block_k` instead.
    bwd_block_k: K-slice width of the split intra backward's second kernel
      (one program per slice). Default min(K, 32) on the GPU and in interpret
      mode (K on TPU, where "split" does not run). On the H200 (bf16, B16
      T2048 H16 D128, 8 warps) intra_bwd took 5.93 ms at 32 and 7.20 ms at
      64; at 4 warps 9.55 and 14.08 ms. Since the kernels use exp2 and read
      the [C, C] gradients unmasked (2026-12-01, `tune_kda.py
      --stages=intra_bwd_k`), the second kernel alone took 2.97 ms at 32
      with 4 warps, against 4.21 at 8 warps, 3.97 / 4.23 at 16 and 8.53 /
      4.01 at 64 (4 / 8 warps); 2 warps took 9.6-52.6 ms.
    num_warps: Triton warps per stage, as ((stage, warps), ...). The split
      backward's first kernel ("intra_bwd_cc") took 0.96 ms at 4 warps
      against 1.18-1.25 at 8 in the same sweep; "intra_bwd" (8) is the
      one-program bodies', which hold [C, K] tiles.
    num_stages: Triton software-pipelining stages (what the state kernels'
      chunk loops prefetch), for every stage not in `pipeline_stages`.
    pipeline_stages: per-stage overrides of num_stages, as ((stage, n), ...).
    rec_block_v: V-tile of the split forward recurrence
      (`kernel_state_split.state_recurrence`; None: block_v). Its grid is
      B x H x V/rec_block_v sequential chunk loops, so a narrower tile gives
      more loops to run side by side. Triton default at K = V = 128 with
      bf16 or f16 inputs, fewer than WHOLE_V_BWD_MIN_PROGRAMS (batch row,
      head) pairs and no explicit block_v: 32. Nsight Compute on the H200
      (bf16, H16 D128, locked 1.34 GHz clocks, 2026-12-01): kda_state_rec
      took 328 us at 32 against 411 at 64 (B1 T8192), 1.30 ms against
      1.63 (B1 T32768) and 455 us against 474 (B4 T8192); with 256 pairs
      (B16 T2048) the 64-wide tile's 512 programs already fill the GPU.
    out_block_v: V-tile of the split pass's output kernel (grid
      B x H x NC x V/out_block_v; None: the whole V).
    bwd_block_v: V-tile of the reverse state kernel (`kernel_bwd.state_bwd`;
      None: block_v). Triton default at K = V = 128 with bf16 or f16 inputs
      and at least WHOLE_V_BWD_MIN_PROGRAMS (batch row, head) pairs, unless
      block_v is given explicitly: the whole V, with 8 warps for that stage
      (each program carries dS [128, 128] f32 in registers and reads its
      bf16 per-chunk operands once instead of twice). On the H200 (bf16,
      B16 T2048 H16, bf16 dS, 2026-12-01, `tune_kda.py --stages=state_bwd`)
      it took 0.563 / 0.635 / 0.656 ms in three calls against 0.704 /
      0.815 / 0.886 ms at V tile 64 (4, 4 and 8 warps); 128 with 4 or 16
      warps took 0.81-1.09 ms, and 3 pipeline stages did not fit in shared
      memory. With few pairs it halves the programs of a sequential loop:
      forward+backward at B1 T32768 H16 took 11.45 ms with it against 10.62
      and 10.82 ms without (two other calls), so there block_v stays. At
      NARROW_BWD_MAX_PROGRAMS pairs or fewer the default is 32 (Nsight
      Compute, as for rec_block_v: kda_state_bwd 452 us against 485 at
      B1 T8192, 1.78 ms against 1.95 at B1 T32768; with 64 pairs, B4 T8192,
      32 was slower, 812 us against 505).
    cumsum_block_f: F-width of a gate-cumsum program (None:
      `kernel_cumsum.default_block_f`).
    mm_dtype: operand dtype of the state kernels' matmuls and of stored
      intermediates (bf16 for bf16 inputs; f32 inputs keep f32).
    intra_mm_dtype: operand dtype of the intra-chunk forward's other matmuls
      (W = M (beta k e^G), U = M (beta v)); default the input dtype (f32
      inputs: f32, 3xTF32 on the GPU). M is rounded to it only as a matmul
      operand (the saved M stays f32).
    score_mm_dtype: operand dtype of the anchored score matmuls (A_kk, A_qk
      and their gradients), the largest intra-chunk matmuls; the input dtype.
      Relative L2 errors vs the f32 recurrence, bf16 inputs, B1 T512 H2 D64,
      CPU interpret (o / dq / dk / dv / dg / dbeta, x1e-3): all intra f32
      2.9 / 2.4 / 2.4 / 2.4 / 1.8 / 2.2; bf16 scores 3.7 / 3.3 / 3.3 / 3.3 /
      3.1 / 3.2; everything bf16 4.0 / 3.6 / 3.7 / 3.7 / 3.6 / 3.6.
    intra_bwd_mm_dtype: the same for the intra-chunk backward kernel. On the
      H200 with K = V = 128 its f32 operands asked Triton for 288 KiB of
      shared memory (227 KiB available), so the GPU default for K*V >= 128*128
      is the input dtype (bf16): half the operand buffers, at the accuracy
      cost above. On the H200 the bf16 forward+VJP at B1 T1024 H4 D128 with
      it passed the GPU test's bounds (o within 5e-3, gradients within 1e-2
      relative L2 of the f32 recurrence; `TestKdaPallasGpu`, 2026-11-30).
    inverse: how the intra-chunk forward builds M = (I + A_kk)^-1.
      "substitution" (the CPU/TPU default): scores as [L, C] row blocks, forward
      substitution over the whole [C, C] tile, one row (and two cross-row
      reductions) per step. "blocked": whole-tile score products, the
      diagonal L x L blocks of M by an L-step substitution done as tensor-core
      products on their stack, the blocks below by block products (needs
      L >= 16 on the GPU; the Triton default when L >= 16). On the H200
      (bf16, B16 T2048 H16 D128, 2026-11-30) intra_fwd took 5.26-5.59 ms
      with "substitution" and 3.30-3.94 ms with "blocked" (block_k 32-64);
      the GPU twin tests check both.
    intra_fwd_impl: "fused" (one intra-chunk forward kernel: scores,
      inverse, W and U; the default) or "split" (`kernel_intra_split`: a
      scores-and-inverse kernel writing A_qk and M, then a W/U kernel reading
      M; needs inverse="blocked"; GPU and interpret mode, not lowered for
      TPU). Opt-in: it trades one [C] per row write and read of M for
      fewer live tiles per program, and was slower on the H200 (1.51-1.82
      ms against 1.38-1.56 fused, B16 T2048 H16 D128, 2026-12-01;
      `kernel_intra_split`).
    inverse_mm_dtype: operand dtype of the blocked inverse's block products
      below the diagonal tiles (f32 accumulation either way; the diagonal
      tiles' substitution takes `inverse_diag`). Default the input dtype.
      Why bf16 for bf16 inputs (with intra_mm_dtype): on the H200 (B16 T2048
      H16 D128, 2026-11-30) intra_fwd took 3.22 ms with both f32 (3xTF32)
      and 1.36 ms with both bf16; the forward 4.90 -> 3.21 ms, forward+
      backward 12.63 -> 10.60 ms (with the fused state kernel of then). The
      cost is accuracy, from rounding M to bf16 in W and U (the inverse's
      dtype alone changed no error): relative L2 errors vs the f32
      recurrence at B1 T1024 H4 D128 (dense; o / dq / dk / dv / dg / dbeta,
      x1e-3) went from 3.70 / 3.28 / 3.31 / 3.71 /
      3.33 / 3.68 to 3.71 / 3.27 / 3.31 / 3.71 / 3.35 / 3.68 with gates near
      the bound, and from 3.70 / 3.30-3.70 (gradients) to 4.04 / 3.64-3.72
      with the GPU test's spread gates (`TestKdaPallasGpu`; bound 5e-3).
      Pass intra_mm_dtype=float32 to keep the f32 W/U products.
    inverse_diag: operands of the blocked inverse's L-step substitution on
      the diagonal tiles (a dependent chain of [C, C] x [C, L] products with
      f32 accumulation). "f32": f32 operands (3xTF32 on the GPU, 24 chained
      HGMMA per step at C = 64). "bf16x3": each f32 operand split into a
      bf16 head and a bf16 remainder, and the three products
      head x head + head x rest + rest x head summed (relative error about
      2^-16 per product instead of 2^-22; four bf16 k-steps per product;
      the left operand's split is loop-invariant). "bf16": the operands
      rounded to bf16, one product (relative error about 2^-8 per product).
      The same arithmetic on every backend, so interpret mode checks its
      accuracy. Default: bf16 for bf16 / f16 inputs, f32 for f32 inputs.
      Why bf16 suffices there: the levels above L already take bf16
      operands (`inverse_mm_dtype`) and M is rounded to bf16 as the W/U
      operand, so the inverse's error is set by those roundings. The
      inverse alone vs float64 (C = 64, L = 16, bf16 below the diagonal;
      `test_blocked_inverse_diag_products_match_float64`): 1.0e-4 with bf16
      diagonal products against 1.1e-5 with bf16x3 (gates at the bound,
      both below the 2^-9 rounding of M as an operand), 5.1e-3 against
      9.0e-3 (nearly parallel keys, beta 1). End to end on the H200 (bf16,
      `TestKdaPallasGpu`) the errors at the four benchmark shapes are those
      of bf16x3 to three digits (o 4.03e-3, gradients 3.67-3.70e-3). Speed (H200, bf16, B16 T2048 H16 D128, 2026-12-01,
      same call): the intra forward took 0.81-0.82 ms against 0.97-1.06
      with bf16x3 (`ablate_intra.py --variants=full,full@inverse_diag=bf16`,
      twice), the forward 1.44 against 1.60 ms (GPU time per call,
      `ab_forward.py`); 120 against 168 HGMMA and 5,912 against 7,376
      SASS instructions (`inspect_triton.py`). Earlier (`tune_kda.py
      --stages=intra_fwd,intra_fwd+M --grid="inverse_diag=f32,bf16x3"`)
      intra_fwd took 1.29-1.39 ms with bf16x3 against 1.55-1.61 with f32.
    blocked_inverse: schedule of the blocked inverse (`inverse="blocked"`).
      "recursive" (the default): recursive 2 x 2 blocking,
      M_2s = M_s - (M_s E_s) M_s over the levels s = 2, 4, ..., C/2, every
      level two [C, C] products (`kernel_fwd.recursive_unit_lower_inverse`;
      10 dependent products at C = 64, unrolled). "stacked": an (L - 1)-step
      substitution on the stacked diagonal tiles, then one block row at a
      time (`kernel_fwd.blocked_unit_lower_inverse`; 15 dependent products,
      a one-hot product and 6 block products at C = 64, L = 16). Levels up to
      L wide take `inverse_diag` operands, wider ones `inverse_mm_dtype`, in
      both. On the H200 (bf16, B16 T2048 H16 D128, 2026-12-01, Nsight Compute
      at locked clocks, `experiments/ablate_intra.py`) intra_fwd took 1.09 ms
      recursive against 1.26 ms stacked (back-to-back wall time 0.978-1.018
      against 1.128-1.182 ms), with 9% fewer instructions issued.
    intra_bwd_impl: "rows" (row-block intra backward: [L, C] / [L, L]
      products, every output row block written once), "tiles" (masked
      [C, C] products over the whole chunk), "split" (two kernels: the
      [C, C] / [C, V] terms per chunk, then the per-channel gradients per
      (chunk, bwd_block_k slice); `kernel_bwd_split`; not lowered for TPU),
      "split_rows" (split, its second kernel one program per row tile too;
      `kernel_bwd_split_rows`; opt-in), or "auto": split on Triton (L >= 16),
      rows in interpret mode, tiles on TPU; see `kernel_bwd.intra_bwd_body`
      for the GPU checks and times.
    state_fwd_impl: "fused" (`kernel_fwd.state_fwd`: the chunk loop also forms
      the outputs), "split" (`kernel_state_split`: the loop keeps only the
      recurrence, a parallel kernel forms the outputs; not lowered for TPU)
      or "auto": split on Triton and in interpret mode, fused on TPU. See
      `kernel_state_split` for the H200 times.
    save_residuals: the forward keeps M, W, A_qk, per-chunk entry states and
      V' (and, with the split state pass, the gated queries and keys) for
      the backward instead of recomputing them there; see
      `pallas_op._core_fwd` for the memory it costs.
    residual_dtype: storage dtype of the saved M, entry states and V' (None:
      M and the states f32, V' f32 from the fused state kernel and in the
      intra-backward matmul dtype, its only use, from the split pass). The
      intra and split-recurrence kernels write M and the states in it
      directly. Default: `intra_bwd_mm_dtype` when that is not f32 (the GPU
      with bf16 inputs and K*V >= 128*128), else None. With bf16
      intra-backward operands bf16 storage loses nothing but the f32
      sum(dS * S) of the last gate row, since every other use casts to bf16;
      it halves the saved bytes of M and the states (the state recurrence
      writes NC*K*V of them per head). The reverse state kernel stores the
      per-chunk exit-state gradients dS in it as well (NC*K*V per head; the
      intra backward reads them as bf16 matmul operands and in the same f32
      sum(dS * S)).
  """
  backend: str
  block_v: int
  block_k: int = 64
  bwd_block_k: int = 32
  num_warps: tuple[tuple[str, int], ...] = (
      ("cumsum", 4), ("intra_fwd", 4), ("intra_wu", 4), ("state_fwd", 4), ("state_rec", 4),
      ("output_fwd", 4), ("state_bwd", 4), ("intra_bwd", 8), ("intra_bwd_cc", 4),
      ("intra_bwd_k", 4))
  num_stages: int = 2
  pipeline_stages: tuple[tuple[str, int], ...] = ()
  rec_block_v: int | None = None
  out_block_v: int | None = None
  bwd_block_v: int | None = None
  cumsum_block_f: int | None = None
  mm_dtype: jnp.dtype = jnp.float32
  intra_mm_dtype: jnp.dtype = jnp.float32
  intra_bwd_mm_dtype: jnp.dtype = jnp.float32
  score_mm_dtype: jnp.dtype = jnp.float32
  inverse: str = "substitution"
  intra_fwd_impl: str = "fused"
  inverse_mm_dtype: jnp.dtype = jnp.float32
  inverse_diag: str = "f32"
  blocked_inverse: str = "recursive"
  intra_bwd_impl: str = "auto"
  state_fwd_impl: str = "auto"
  save_residuals: bool = True
  residual_dtype: jnp.dtype | None = None

  def intra(self, backward: bool = False) -> "KernelConfig":
    """This config with an intra-chunk kernel's operand dtype as `mm_dtype`."""
    dtype = self.intra_bwd_mm_dtype if backward else self.intra_mm_dtype
    return dataclasses.replace(self, mm_dtype=dtype)

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
    if self.inverse not in INVERSES:
      raise ValueError(f"inverse must be one of {INVERSES}, got {self.inverse!r}")
    if self.inverse_diag not in INVERSE_DIAGS:
      raise ValueError(f"inverse_diag must be one of {INVERSE_DIAGS}, got {self.inverse_diag!r}")
    if self.blocked_inverse not in BLOCKED_INVERSES:
      raise ValueError(f"blocked_inverse must be one of {BLOCKED_INVERSES}, got "
                       f"{self.blocked_inverse!r}")
    if self.intra_fwd_impl not in INTRA_FWD_IMPLS:
      raise ValueError(f"intra_fwd_impl must be one of {INTRA_FWD_IMPLS}, got "
                       f"{self.intra_fwd_impl!r}")
    if self.intra_fwd_impl == "split" and self.is_tpu:
      raise ValueError(f"intra_fwd_impl='split' is not lowered for TPU (backend "
                       f"{self.backend!r}); use 'fused'")
    if self.intra_fwd_impl == "split" and self.inverse != "blocked":
      raise ValueError("intra_fwd_impl='split' runs the blocked inverse; set inverse='blocked' "
                       f"(got {self.inverse!r})")

  @property
  def interpret(self):
    """The `interpret=` argument of pallas_call."""
    if self.backend == "tpu_interpret":
      from jax.experimental.pallas import tpu as pltpu
      return pltpu.InterpretParams()
    return self.backend == "interpret"

  @property
  def is_tpu(self) -> bool:
    return self.backend in ("tpu", "tpu_interpret")

  @property
  def saved_state_dtype(self):
    """The dtype the forward kernels write the saved M and entry states in:
    residual_dtype, else f32."""
    return self.residual_dtype or jnp.float32

  def compiler_params(self, stage: str, grid_rank: int = 3, sequential_last: bool = False):
    """`pallas_call` compiler parameters of `stage` for this backend.

    sequential_last: the last grid axis carries state (TPU "arbitrary").
    """
    if stage not in STAGES:
      raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if self.backend == "triton":
      from jax.experimental.pallas import triton as pltriton
      return pltriton.CompilerParams(
          num_warps=dict(self.num_warps)[stage],
          num_stages=dict(self.pipeline_stages).get(stage, self.num_stages))
    if self.is_tpu:
      from jax.experimental.pallas import tpu as pltpu
      sem = ("parallel",) * (grid_rank - 1) + ("arbitrary" if sequential_last else "parallel",)
      return pltpu.CompilerParams(dimension_semantics=sem)
    return None

  def dot_precision(self, dtype):
    """Matmul precision for operands of `dtype`.

    f32 operands must stay f32-accurate: the Triton lowering would otherwise
    use single-pass TF32 (~1e-3 relative error). On the GPU 3xTF32 gives
    ~1e-6 on tensor cores; elsewhere HIGHEST is exact f32.
    """
    if jnp.dtype(dtype) != jnp.float32:
      return None
    if self.backend == "triton":
      return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return jax.lax.Precision.HIGHEST

  def meta_block_spec(self, n: int) -> pl.BlockSpec:
    """BlockSpec of an int32 [n] per-chunk metadata vector read by scalar index."""
    if self.is_tpu:
      from jax.experimental.pallas import tpu as pltpu
      return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec((n,), lambda *_: (0,))


def is_pow2(n: int) -> bool:
  """Whether n is a positive power of two (the Pallas tile-size rule here)."""
  return n > 0 and (n & (n - 1)) == 0


def default_backend(interpret: bool) -> str:
  """The backend a call runs on: interpret mode, or the default JAX platform."""
  if interpret:
    return "interpret"
  platform = jax.default_backend()
  if platform == "gpu":
    return "triton"
  if platform == "tpu":
    return "tpu"
  raise ValueError(
      f"implementation='pallas' needs a GPU or TPU (default backend is {platform!r}); "
      "pass interpret=True to emulate the kernels on the CPU")


# Fewest (batch row, head) pairs for which the reverse state kernel takes the
# whole V at K = V = 128 on Triton (`KernelConfig.bwd_block_v`): each pair is
# then one sequential program, so below about one per SM (the H200 has 132)
# the narrower default tile's twice as many programs win.
WHOLE_V_BWD_MIN_PROGRAMS = 128

# Most (batch row, head) pairs for which the reverse state kernel takes a V
# tile of 32 at K = V = 128 on Triton (`KernelConfig.bwd_block_v`; measured
# faster at 16 pairs, slower at 64).
NARROW_BWD_MAX_PROGRAMS = 16


def make_config(*, backend: str, dtype, head_k: int, head_v: int, chunk_size: int,
                sub_chunk: int, block_v: int | None = None, state_programs: int | None = None,
                overrides: dict | None = None) -> KernelConfig:
  """Checks the tile shapes for `backend` and returns its KernelConfig.

  Args:
    backend: one of BACKENDS.
    dtype: dtype of q/k/v (bf16, f16 or f32).
    head_k, head_v: K and V head dims.
    chunk_size: C; sub_chunk: L (divides C).
    block_v: V-tile of the state kernels; default min(V, 64) (V on TPU).
      Given here or in `overrides`, it is also the reverse state kernel's
      (no whole-V default; see KernelConfig.bwd_block_v).
    state_programs: B * H, the (batch row, head) pairs the state kernels
      loop over (None: unknown, taken as many); picks bwd_block_v and
      rec_block_v.
      block_k (the K slice; default min(K, 64), K on TPU), bwd_block_k
      (the split backward's K slice; default min(K, 32)) and inverse
      ("blocked" on Triton when sub_chunk >= 16, else "substitution") are set
      through `overrides`.
    overrides: KernelConfig fields to set explicitly (benchmarks, ablations).
      `num_warps` there may name only some stages; the others keep their
      defaults.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
    raise ValueError(f"the pallas KDA kernels take bf16/f16/f32 q, k, v; got {dtype}")
  for name, n in (("K", head_k), ("V", head_v), ("chunk_size", chunk_size),
                  ("sub_chunk", sub_chunk)):
    # Triton tensors must have power-of-two sizes; keep one rule everywhere.
    if not is_pow2(n) or n < 8 and name != "sub_chunk":
      raise ValueError(f"{name} must be a power of two >= 8 for the pallas kernels, got {n}")
  if chunk_size < 16:
    raise ValueError(f"chunk_size must be >= 16 (tensor-core tile), got {chunk_size}")
  # An explicit block_v (argument or override) sets the reverse state tile too.
  block_v_given = block_v is not None or "block_v" in (overrides or {})
  if block_v is None:
    # Mosaic needs the lane dim to be a multiple of 128 or the whole array.
    block_v = head_v if backend in ("tpu", "tpu_interpret") else min(head_v, 64)
  mm_dtype = jnp.float32 if dtype == jnp.float32 else dtype
  intra_bwd = jnp.float32
  if backend == "triton" and head_k * head_v >= 128 * 128:
    intra_bwd = mm_dtype
  on_tpu = backend in ("tpu", "tpu_interpret")
  block_k = head_k if on_tpu else min(head_k, 64)
  bwd_block_k = head_k if on_tpu else min(head_k, 32)
  inverse = "blocked" if backend == "triton" and sub_chunk >= 16 else "substitution"
  num_warps = dict(next(f.default for f in dataclasses.fields(KernelConfig)
                        if f.name == "num_warps"))
  bwd_block_v = rec_block_v = None
  many = state_programs is None or state_programs >= WHOLE_V_BWD_MIN_PROGRAMS
  # Measured with bf16 operands only; f32 ones double the pipelined buffers.
  if (backend == "triton" and head_k == head_v == 128 and mm_dtype != jnp.float32
      and not block_v_given):
    if many:
      bwd_block_v, num_warps["state_bwd"] = 128, 8   # see KernelConfig.bwd_block_v
    else:
      rec_block_v = 32                               # see KernelConfig.rec_block_v
      if state_programs <= NARROW_BWD_MAX_PROGRAMS:
        bwd_block_v = 32
  cfg = KernelConfig(backend=backend, block_v=block_v, block_k=block_k,
                     bwd_block_k=bwd_block_k, bwd_block_v=bwd_block_v, rec_block_v=rec_block_v,
                     num_warps=tuple(num_warps.items()), inverse=inverse,
                     mm_dtype=mm_dtype, intra_mm_dtype=mm_dtype, inverse_mm_dtype=mm_dtype,
                     inverse_diag="f32" if mm_dtype == jnp.float32 else "bf16",
                     intra_bwd_mm_dtype=intra_bwd, score_mm_dtype=mm_dtype,
                     residual_dtype=None if intra_bwd == jnp.float32 else intra_bwd)
  if overrides:
    unknown = set(overrides) - {f.name for f in dataclasses.fields(KernelConfig)}
    if unknown:
      raise ValueError(f"unknown KernelConfig fields in overrides: {sorted(unknown)}")
    overrides = dict(overrides)
    if "num_warps" in overrides:
      overrides["num_warps"] = tuple({**num_warps, **dict(overrides["num_warps"])}.items())
    cfg = dataclasses.replace(cfg, **overrides)
  # After the overrides: a benchmark's block_v must meet the same rule.
  if not is_pow2(cfg.block_v) or head_v % cfg.block_v:
    raise ValueError(f"block_v must be a power of two dividing V={head_v}, got {cfg.block_v}")
  for name in ("rec_block_v", "out_block_v", "bwd_block_v"):
    width = getattr(cfg, name)
    if width is not None and (not is_pow2(width) or head_v % width
                              or (backend == "triton" and width < 16)):
      raise ValueError(f"{name} must be None or a power of two dividing V={head_v} (>= 16 on "
                       f"the GPU: a dot dim), got {width}")
  for field in ("num_warps", "pipeline_stages"):
    unknown = {stage for stage, _ in getattr(cfg, field)} - set(STAGES)
    if unknown:
      raise ValueError(f"{field} names unknown stages {sorted(unknown)}; stages are {STAGES}")
  for name in ("block_k", "bwd_block_k"):
    width = getattr(cfg, name)
    if not is_pow2(width) or head_k % width or (backend == "triton" and width < 16):
      raise ValueError(f"{name} must be a power of two dividing K={head_k} (>= 16 on the "
                       f"GPU: a dot dim), got {width}")
  if cfg.inverse == "blocked" and sub_chunk < 16 and backend == "triton":
    raise ValueError(f"inverse='blocked' needs sub_chunk >= 16 on the GPU (tensor-core "
                     f"tiles), got {sub_chunk}")
  return cfg
