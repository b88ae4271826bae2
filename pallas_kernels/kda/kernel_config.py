"""Tile sizes, bodies and per-backend compiler parameters of the Pallas KDA kernels.

Everything that differs between the Triton (GPU), Mosaic (TPU) and interpret
(CPU) lowerings lives here; the kernel bodies ask the config for:

* `compiler_params(stage)`: the `pallas_call` compiler parameters,
* `dot_precision(dtype)`: the precision of matmuls whose operands are `dtype`,
* `meta_block_spec(n)`: where per-chunk integer metadata lives (SMEM on TPU).

`heuristic_config` holds every default and threshold. The "interpret" backend
takes the GPU's choices (bodies, tiles, dtypes), so interpret-mode tests run
the programs the GPU runs by default; "tpu_interpret" takes the TPU's.

Structural difference: on TPU the state kernels walk the chunks as the last,
sequential ("arbitrary") grid axis with the state in VMEM scratch, so only
one chunk of each input is resident; on the GPU (Triton has no sequential
grid axis) each program loops over the chunks of a whole-sequence block.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.sizes import is_pow2

BACKENDS = ("triton", "tpu", "interpret", "tpu_interpret")

# Ways of forming M = (I + A_kk)^-1 in the intra-chunk forward.
INVERSES = ("blocked", "substitution")

# Intra-chunk backward bodies: two kernels (per chunk, then per K slice), or
# one program per chunk over whole [C, C] tiles.
INTRA_BWDS = ("split", "tiles")

# How the pairwise diagonal's level anchors are picked (`kernel_common.anchor_picker`).
LEVEL_ANCHORS = ("gather", "reshape", "select")

# Bodies of the GPU forward's output kernel ("output_fwd"): the Triton one
# (`kernel_state_split.output_fwd`) or the Mosaic GPU prototype
# (`kernel_output_mosaic`, Hopper: 16-bit operands, chunk_size a multiple of 64).
OUTPUT_BODIES = ("triton", "mosaic_gpu")

# Kernel stages, each a separate pallas_call (the GPU forward state pass is
# "state_rec" then "output_fwd", the TPU one "state_fwd"; the split intra
# backward is "intra_bwd_cc" then "intra_bwd_k", the one-program one "intra_bwd").
STAGES = ("cumsum", "intra_fwd", "state_fwd", "state_rec", "output_fwd", "state_bwd",
          "intra_bwd", "intra_bwd_cc", "intra_bwd_k", "diag_fwd", "diag_bwd")

_DEFAULT_WARPS = (("cumsum", 4), ("intra_fwd", 4), ("state_fwd", 4), ("state_rec", 4),
                  ("output_fwd", 4), ("state_bwd", 4), ("intra_bwd", 8), ("intra_bwd_cc", 4),
                  ("intra_bwd_k", 4), ("diag_fwd", 2), ("diag_bwd", 4))


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static tiling and lowering choices for one call of the KDA kernels.

  Each field is a choice a caller or the tuner may force
  (`chunk_kda(config_overrides=...)`, `experiments/bench/tune_kda.py`);
  `heuristic_config` sets the defaults and says why, and `make_config`
  checks the tiles. Derived values are properties.

  Attributes:
    backend: the lowering; one of BACKENDS ("tpu_interpret": CPU emulation
      with TPU semantics).
    block_v: V tile of the state kernels, one program per tile; a power of
      two dividing V.
    block_k: widest K slice of the intra forward, the state kernels and the
      first split-backward kernel (`kernel_common.width_slices`).
    bwd_block_k: K slice of the split intra backward's second kernel, one
      program per slice; a power of two dividing K.
    rec_block_v, bwd_block_v: V tiles of the GPU forward recurrence and of
      the reverse state kernel; None takes block_v.
    num_warps: Triton warps per stage, ((stage, warps), ...); an override may
      name only some stages.
    num_stages: Triton software-pipelining stages of every kernel.
    inverse: how the intra forward forms M = (I + A_kk)^-1; one of INVERSES.
    intra_bwd: the intra backward body; one of INTRA_BWDS ("split" is not
      lowered for TPU).
    mm_dtype: operand dtype of the matmuls outside the intra backward and of
      stored intermediates (f32 accumulation).
    intra_bwd_mm_dtype: operand dtype of the intra backward's matmuls and
      storage dtype of the saved M, entry states, V' and dS.
    save_residuals: the forward keeps its intermediates for the backward
      rather than the backward recomputing them.
    segment_chunks: None, or the most chunks of one segment of a long
      fixed-length call (`pallas_op._segmented_core`), which bounds the
      residuals held; packed sequences are never segmented.
    level_anchors: how the pairwise diagonal picks each level's anchor rows
      of G; one of LEVEL_ANCHORS (TPU: "select" only).
    diag_kernels: the pairwise diagonal's tiles in kernels of their own
      (`kernel_diag`); needs the blocked inverse and the split backward.
      Read only with diagonal="pairwise".
    diag_block_k: K slice of both `kernel_diag` kernels.
    diag_level_loop: the `kernel_diag` levels run in a loop rather than
      unrolled (same arithmetic, fewer live registers).
    diag_rows, diag_bwd_rows: rows of one program of `kernel_diag`'s score
      and gradient kernels: None (the chunk) or a multiple of sub_chunk.
    output_body: the GPU forward's output kernel; one of OUTPUT_BODIES
      ("mosaic_gpu": the `kernel_output_mosaic` prototype, GPU only).
  """
  backend: str
  block_v: int
  block_k: int = 64
  bwd_block_k: int = 32
  rec_block_v: int | None = None
  bwd_block_v: int | None = None
  num_warps: tuple[tuple[str, int], ...] = _DEFAULT_WARPS
  num_stages: int = 2
  inverse: str = "substitution"
  intra_bwd: str = "tiles"
  mm_dtype: jnp.dtype = jnp.float32
  intra_bwd_mm_dtype: jnp.dtype = jnp.float32
  save_residuals: bool = True
  level_anchors: str = "select"
  segment_chunks: int | None = None
  diag_kernels: bool = False
  diag_block_k: int = 64
  diag_level_loop: bool = False
  diag_rows: int | None = None
  diag_bwd_rows: int | None = None
  output_body: str = "triton"

  def __post_init__(self):
    if self.output_body not in OUTPUT_BODIES:
      raise ValueError(f"output_body must be one of {OUTPUT_BODIES}, got {self.output_body!r}")
    if self.output_body == "mosaic_gpu" and self.is_tpu:
      raise ValueError(f"output_body='mosaic_gpu' is not lowered for TPU (backend "
                       f"{self.backend!r}); use 'triton'")
    if self.backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
    if self.inverse not in INVERSES:
      raise ValueError(f"inverse must be one of {INVERSES}, got {self.inverse!r}")
    if self.intra_bwd not in INTRA_BWDS:
      raise ValueError(f"intra_bwd must be one of {INTRA_BWDS}, got {self.intra_bwd!r}")
    if self.level_anchors not in LEVEL_ANCHORS:
      raise ValueError(f"level_anchors must be one of {LEVEL_ANCHORS}, got "
                       f"{self.level_anchors!r}")
    if self.is_tpu and self.level_anchors != "select":
      raise ValueError(f"level_anchors={self.level_anchors!r} is not lowered for TPU (backend "
                       f"{self.backend!r}); use 'select'")
    if self.segment_chunks is not None and (not isinstance(self.segment_chunks, int)
                                            or self.segment_chunks < 1):
      raise ValueError(f"segment_chunks must be None or a positive int, got "
                       f"{self.segment_chunks!r}")
    if self.diag_kernels and (self.inverse != "blocked" or self.intra_bwd != "split"):
      raise ValueError(f"diag_kernels=True needs inverse='blocked' and intra_bwd='split' (the "
                       f"bodies that take their tiles), got inverse={self.inverse!r}, "
                       f"intra_bwd={self.intra_bwd!r}; use diag_kernels=False")
    if self.intra_bwd == "split" and self.is_tpu:
      raise ValueError(f"intra_bwd='split' is not lowered for TPU (backend "
                       f"{self.backend!r}); use 'tiles'")

  def backward(self) -> "KernelConfig":
    """This config with the intra backward's operand dtype as `mm_dtype`."""
    return dataclasses.replace(self, mm_dtype=self.intra_bwd_mm_dtype)

  @property
  def interpret(self):
    """The `interpret=` argument of pallas_call."""
    if self.backend == "tpu_interpret":
      return pltpu.InterpretParams()
    return self.backend == "interpret"

  @property
  def is_tpu(self) -> bool:
    return self.backend in ("tpu", "tpu_interpret")

  @property
  def saved_state_dtype(self):
    """The dtype of the saved M, entry states, V' and dS: the intra backward's operands'."""
    return jnp.dtype(self.intra_bwd_mm_dtype)

  @property
  def diag_dtype(self):
    """Operand dtype of the blocked inverse's diagonal levels: f32 for f32
    operands, else bf16 (the levels above and M as a W/U operand are rounded
    to 16 bits anyway)."""
    return jnp.float32 if jnp.dtype(self.mm_dtype) == jnp.float32 else jnp.bfloat16

  def compiler_params(self, stage: str, grid_rank: int = 3, sequential_last: bool = False):
    """`pallas_call` compiler parameters of `stage` for this backend.

    sequential_last: the last grid axis carries state (TPU "arbitrary").
    """
    if stage not in STAGES:
      raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if self.backend == "triton":
      return pltriton.CompilerParams(num_warps=dict(self.num_warps)[stage],
                                     num_stages=self.num_stages)
    if self.is_tpu:
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
      return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec((n,), lambda *_: (0,))


def pow2_part(n: int) -> int:
  """The largest power of two dividing n > 0 (n itself at a power of two)."""
  return n & -n


# Narrowest head widths of the kernels: 8, and 16 for K on the GPU, where K
# slices are dot dims.
MIN_WIDTH = 8
MIN_TRITON_K = 16
# The GPU's sliced bodies run any head width that is a multiple of this:
# Triton needs power-of-two sizes for every tensor a kernel loads, stores or
# computes, not for block shapes, and these bodies touch [*, K] and [*, V]
# data only through power-of-two slices, here at least 16 wide (a dot dim).
SLICE_MULTIPLE = 16
# Mosaic (TPU) blocks must span a multiple of 128 lanes in their last dim, or
# the whole array dim: the kernels' [B, Tp, H*K] layouts take [C, K] blocks,
# so with H > 1 a head width must be a multiple of 128.
TPU_LANES = 128


def _default_bodies(backend: str, sub_chunk: int) -> dict:
  """The default `inverse` and `intra_bwd` of `backend` at sub_chunk L: the
  GPU's tensor-core bodies need L >= 16."""
  gpu_tiles = backend not in ("tpu", "tpu_interpret") and sub_chunk >= 16
  return dict(inverse="blocked" if gpu_tiles else "substitution",
              intra_bwd="split" if gpu_tiles else "tiles")


def sliced_bodies(backend: str, sub_chunk: int, overrides: dict | None = None) -> bool:
  """Whether the kernels `backend` runs (defaults, then `overrides`) read and
  write [*, K] and [*, V] data only through power-of-two slices: the GPU's
  blocked intra forward with the split intra backward. The substitution
  forward and the one-program backward (TPU; sub_chunk < 16) take whole
  [C, K] and [C, V] tiles."""
  bodies = _default_bodies(backend, sub_chunk)
  bodies.update({name: value for name, value in (overrides or {}).items() if name in bodies})
  return (backend not in ("tpu", "tpu_interpret") and bodies["inverse"] == "blocked"
          and bodies["intra_bwd"] == "split")


def width_rule(name: str, n: int, *, backend: str, heads: int | None = None,
               sliced: bool = True) -> str | None:
  """Why the kernels cannot run head width `n` as it is, or None when they can.

  The kernels run: on the GPU (and in interpret mode, which runs the GPU's
  programs) a power of two >= MIN_WIDTH (K >= MIN_TRITON_K on the GPU) or,
  with `sliced` bodies (`sliced_bodies`), any multiple of SLICE_MULTIPLE; on
  TPU a power of two >= MIN_WIDTH, and a multiple of TPU_LANES when H > 1.

  Args:
    name: "K" or "V". heads: H (None: not checked against TPU_LANES).
  """
  low = MIN_TRITON_K if name == "K" and backend == "triton" else MIN_WIDTH
  if n < low:
    return f"{name} = {n} is below {low}"
  if backend in ("tpu", "tpu_interpret"):
    if not is_pow2(n):
      return f"{name} = {n} is not a power of two (the TPU kernels take whole [C, {name}] tiles)"
    if heads is not None and heads > 1 and n % TPU_LANES:
      return (f"{name} = {n} is not a multiple of {TPU_LANES} at H = {heads} (TPU blocks of the "
              f"[B, T, H*{name}] layout must span {TPU_LANES} lanes or the whole array)")
    return None
  if is_pow2(n):
    return None
  if not sliced:
    return (f"{name} = {n} is not a power of two, which the substitution inverse and the "
            "one-program intra backward (sub_chunk < 16) need")
  if n % SLICE_MULTIPLE:
    return f"{name} = {n} is neither a power of two nor a multiple of {SLICE_MULTIPLE}"
  return None


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
# whole V at K = V = 128 on the GPU: each pair is one sequential program, so
# below about one per SM (the H200 has 132) the narrower tile's twice as many
# programs win.
WHOLE_V_BWD_MIN_PROGRAMS = 128

# Most (batch row, head) pairs for which the reverse state kernel takes a V
# tile of 32 at K = V = 128 on the GPU.
NARROW_BWD_MAX_PROGRAMS = 16


# Most bytes of residuals (`residual_bytes`) that one call, or one segment of
# a long sequence, keeps for its backward by default (`segment_chunks`). At
# K = V = 128, C = 64 and 16-bit inputs a token-head pair keeps 1792 bytes, so
# 8 GiB holds 4.8M token-heads: B T = 300k tokens at H = 16, and B1 T = 2^20
# H16 (28 GiB) runs in four segments, which fit a 141 GB GPU beside the
# inputs under JAX's default memory fraction; training shapes stay far below
# it (B16 T2048 H16: 0.94 GB per layer). Segments rather than
# `save_residuals=False`, whose recomputed residuals are live beside the
# backward's own temporaries. Measurements: docs/benchmarks.md, "Long
# sequences", and `git log pallas_kernels/kda/kernel_config.py`.
RESIDUAL_BUDGET_BYTES = 8 * 2 ** 30


class KernelShape(NamedTuple):
  """The sizes the defaults depend on: B * H (batch row, head) pairs, the
  head dims and the tiles, and B * Tp * H token-head pairs on the chunk grid.
  state_programs, token_heads None: unknown (many programs; residuals
  saved)."""
  head_k: int
  head_v: int
  chunk_size: int
  sub_chunk: int
  state_programs: int | None = None
  token_heads: int | None = None


def residual_bytes(shape: KernelShape, cfg: "KernelConfig") -> int | None:
  """Bytes the forward keeps for the backward with `save_residuals`, beyond its inputs.

  Per token-head pair: W (K) and A_qk (C) in cfg.mm_dtype; M (C), the
  per-chunk entry states (K V / C) and V' (V) in cfg.saved_state_dtype; the
  GPU state pass's gated queries and keys (2 K) in cfg.mm_dtype. G (f32)
  takes the place of the f32 gate, which is not kept, so it adds nothing.
  None when shape.token_heads is unknown.
  """
  if shape.token_heads is None:
    return None
  k, v, c = shape.head_k, shape.head_v, shape.chunk_size
  mm = jnp.dtype(cfg.mm_dtype).itemsize
  saved = cfg.saved_state_dtype.itemsize
  gated = 0 if cfg.is_tpu else 2 * k * mm
  per_pair = (k + c) * mm + (c + k * v // c + v) * saved + gated
  return shape.token_heads * per_pair


def _default_warps(ell: int) -> tuple[tuple[str, int], ...]:
  """Warps per stage before the state kernels' choices: 4, 8 for the
  one-program intra backward, 2 for the diagonal scores, whose [L, L]
  products are small; from L = 32, L / 8 and 8 for the diagonal kernels,
  which compile without spills there."""
  if ell < 32:
    return _DEFAULT_WARPS
  return tuple({**dict(_DEFAULT_WARPS), "diag_fwd": ell // 8, "diag_bwd": 8}.items())


def heuristic_config(shape: KernelShape, dtype, backend: str) -> KernelConfig:
  """The default KernelConfig of `backend` for `shape` and q/k/v `dtype`.

  "interpret" takes the GPU's ("triton") choices and "tpu_interpret" the TPU's.
  """
  dtype = jnp.dtype(dtype)
  on_tpu = backend in ("tpu", "tpu_interpret")
  dk, dv, ell = shape.head_k, shape.head_v, shape.sub_chunk
  # f16's range ends at e^11: the dense diagonal's column factors overflow
  # it within the bound and every path's small factors underflow it, so f16
  # inputs take bf16 operands (f32 accumulation, as every matmul here).
  mm_dtype = {jnp.dtype(jnp.float32): jnp.dtype(jnp.float32),
              jnp.dtype(jnp.float16): jnp.dtype(jnp.bfloat16)}.get(dtype, dtype)
  # f32 intra-backward operands overflow shared memory at K = V = 128; a
  # width between 64 x 128 and that (96 x 96) takes the input dtype too, as
  # 128 does, and as it did when it was padded to 128.
  wide = not on_tpu and dk * dv > 64 * 128
  fields = dict(
      backend=backend,
      # Mosaic: a lane dim of 128 or the whole array. GPU: the V tiles and
      # the split backward's K slices are grid axes of equal power-of-two
      # tiles; the in-kernel K slices need only fit (min(width, cap) at a
      # power of two).
      block_v=dv if on_tpu else min(pow2_part(dv), 64),
      block_k=dk if on_tpu else min(1 << (dk.bit_length() - 1), 64),
      bwd_block_k=dk if on_tpu else min(pow2_part(dk), 32),
      **_default_bodies(backend, ell),
      mm_dtype=mm_dtype,
      intra_bwd_mm_dtype=mm_dtype if wide else jnp.dtype(jnp.float32),
      level_anchors="select" if on_tpu else "gather",   # Mosaic lowers "select" only
      # Wherever the blocked inverse and the split backward run (L >= 16 on the GPU).
      diag_kernels=not on_tpu and ell >= 16,
      # An [L, diag_block_k] operand stays at 2048 elements.
      diag_block_k=min(1 << (dk.bit_length() - 1), 64, max(2048 // ell, 16)),
      # From L = 32 the unrolled levels spill; at 16 unrolled is faster.
      diag_level_loop=ell >= 32,
      # One tile per score program, the chunk per gradient program: the fastest of each.
      diag_rows=None if on_tpu else ell,
      num_warps=_default_warps(ell))
  # Each (batch row, head) pair is one sequential program of the state
  # kernels, so few pairs take narrower V tiles (more programs); many take
  # the whole V in the reverse pass. Measured with 16-bit operands only; f32
  # ones double the pipelined buffers.
  if not on_tpu and dk == dv == 128 and mm_dtype != jnp.float32:
    programs = shape.state_programs
    if programs is None or programs >= WHOLE_V_BWD_MIN_PROGRAMS:
      fields["bwd_block_v"] = 128
      fields["num_warps"] = tuple({**dict(fields["num_warps"]), "state_bwd": 8}.items())
    else:
      fields["rec_block_v"] = 32
      if programs <= NARROW_BWD_MAX_PROGRAMS:
        fields["bwd_block_v"] = 32
  cfg = KernelConfig(**fields)
  return dataclasses.replace(cfg, segment_chunks=segment_chunks_for(shape, cfg))


def segment_chunks_for(shape: KernelShape, cfg: KernelConfig,
                       budget: int = RESIDUAL_BUDGET_BYTES) -> int | None:
  """The default `segment_chunks`: None when the call's residuals fit in
  `budget` bytes (or its size is unknown), else the most chunks per
  sequence whose residuals, over all B * H rows, do (at least 1)."""
  kept = residual_bytes(shape, cfg)
  if kept is None or shape.state_programs is None or kept <= budget:
    return None
  chunks = shape.token_heads // (shape.state_programs * shape.chunk_size)
  per_chunk = kept // max(chunks, 1)
  return max(1, budget // per_chunk)


def make_config(*, backend: str, dtype, head_k: int, head_v: int, chunk_size: int,
                sub_chunk: int, block_v: int | None = None, state_programs: int | None = None,
                token_heads: int | None = None, overrides: dict | None = None,
                heads: int | None = None) -> KernelConfig:
  """Checks the tile shapes for `backend` and returns its KernelConfig.

  Args:
    backend: one of BACKENDS.
    dtype: dtype of q/k/v (bf16, f16 or f32).
    head_k, head_v: K and V head dims, widths the chosen bodies run
      (`width_rule`; `chunk_kda` pads other widths, `head_pad`).
    chunk_size: C; sub_chunk: L (divides C).
    block_v: V tile of the state kernels (same as overriding it).
    state_programs: B * H (None: unknown, taken as many).
    token_heads: B * Tp * H on the chunk grid, which sets the default of
      save_residuals (None: unknown, residuals saved).
    overrides: KernelConfig fields to set over `heuristic_config`'s.
      `num_warps` there may name only some stages; the others keep their
      defaults. A block_v given here or as the argument sets the reverse
      state and recurrence tiles too, unless they are overridden as well.
    heads: H, for the TPU's rule on head widths (None: not checked).
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
    raise ValueError(f"the pallas KDA kernels take bf16/f16/f32 q, k, v; got {dtype}")
  for name, n in (("chunk_size", chunk_size), ("sub_chunk", sub_chunk)):
    # Triton tensors must have power-of-two sizes; keep one rule everywhere.
    if not is_pow2(n):
      raise ValueError(f"{name} must be a power of two for the pallas kernels, got {n}")
  if chunk_size < 16:
    raise ValueError(f"chunk_size must be >= 16 (tensor-core tile), got {chunk_size}")
  cfg = heuristic_config(KernelShape(head_k, head_v, chunk_size, sub_chunk, state_programs,
                                     token_heads), dtype, backend)
  overrides = dict(overrides or {})
  if block_v is not None:
    overrides.setdefault("block_v", block_v)
  unknown = set(overrides) - {f.name for f in dataclasses.fields(KernelConfig)}
  if unknown:
    raise ValueError(f"unknown KernelConfig fields in overrides: {sorted(unknown)}")
  if "block_v" in overrides:
    overrides = {"rec_block_v": None, "bwd_block_v": None,
                 "num_warps": _default_warps(sub_chunk), **overrides}
  if "num_warps" in overrides:
    unknown = {stage for stage, _ in overrides["num_warps"]} - set(STAGES)
    if unknown:
      raise ValueError(f"num_warps names unknown stages {sorted(unknown)}; stages are {STAGES}")
    base = _default_warps(sub_chunk) if "block_v" in overrides else cfg.num_warps
    overrides["num_warps"] = tuple({**dict(base), **dict(overrides["num_warps"])}.items())
  if "diag_kernels" not in overrides and (overrides.get("inverse", cfg.inverse) != "blocked" or
                                          overrides.get("intra_bwd", cfg.intra_bwd) != "split"):
    overrides["diag_kernels"] = False     # the other bodies form the diagonal tiles themselves
  cfg = dataclasses.replace(cfg, **overrides)
  for name, n in (("K", head_k), ("V", head_v)):
    rule = width_rule(name, n, backend=backend, heads=heads,
                      sliced=sliced_bodies(backend, sub_chunk, overrides))
    if rule:
      raise ValueError(f"{rule}: not a head width of the pallas kernels (chunk_kda zero-pads "
                       "such widths inside the op, pallas_kernels.kda.head_pad)")
  if not is_pow2(cfg.block_v) or head_v % cfg.block_v:
    raise ValueError(f"block_v must be a power of two dividing V={head_v}, got {cfg.block_v}")
  for name in ("rec_block_v", "bwd_block_v"):
    width = getattr(cfg, name)
    if width is not None and (not is_pow2(width) or head_v % width
                              or (backend == "triton" and width < 16)):
      raise ValueError(f"{name} must be None or a power of two dividing V={head_v} (>= 16 on "
                       f"the GPU: a dot dim), got {width}")
  for name, grid_axis in (("block_k", False), ("bwd_block_k", True), ("diag_block_k", False)):
    # bwd_block_k is a grid axis of equal slices; block_k and diag_block_k cap
    # the in-kernel slices, which at a power-of-two K are equal too.
    width = getattr(cfg, name)
    dividing = grid_axis or is_pow2(head_k)
    if (not is_pow2(width) or (head_k % width if dividing else width > head_k)
        or (backend == "triton" and width < 16)):
      raise ValueError(f"{name} must be a power of two {'dividing' if dividing else 'at most'} "
                       f"K={head_k} (>= 16 on the GPU: a dot dim), got {width}")
  for name in ("diag_rows", "diag_bwd_rows"):
    rows = getattr(cfg, name)
    if rows is not None and (rows < sub_chunk or rows % sub_chunk or chunk_size % rows):
      raise ValueError(f"{name} must be None or a multiple of sub_chunk={sub_chunk} dividing "
                       f"chunk_size={chunk_size}, got {rows}")
  if backend == "triton" and sub_chunk < 16:
    for name, value in (("inverse", "blocked"), ("intra_bwd", "split")):
      if getattr(cfg, name) == value:
        raise ValueError(f"{name}={value!r} needs sub_chunk >= 16 on the GPU (tensor-core "
                         f"tiles), got {sub_chunk}")
  return cfg
