"""Tile sizes and launch options of the grouped matmuls, and their heuristic."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.sizes import is_pow2

BACKENDS = ("triton", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class GmmConfig:
  """One launch of `api.gmm` / `api.tgmm`.

  Attributes:
    block_m: rows per tile. Groups start on multiples of it (the layout's
      alignment), so one tile never spans two groups.
    block_n: output columns per program of `gmm`.
    block_k: contraction slice per step of the inner loop.
    group_m: row tiles per launch group of `gmm`: programs run every column
      tile of `group_m` consecutive row tiles before the next rows, so a
      gathered row tile is read from memory once and reused from L2 by its
      N / block_n column tiles (1: all columns of one row tile in turn).
    num_warps, num_stages: Triton launch options of `gmm` (GPU only).
    wgrad_rows: rows per step of `tgmm`'s contraction (values above block_m
      take block_m). Fewer rows per step leave shared memory for deeper
      pipelining, which a gathered operand needs: its row indices take a
      pipeline stage of their own.
    wgrad_stages, wgrad_warps: Triton launch options of `tgmm`.
    wgrad_block: K side of `tgmm`'s [K, N] result tile (shrunk to divide
      K). Its own field because the products' best block_n (256) would give
      each tgmm program a 256 x 256 float32 accumulator, which spills (0.10
      of the dense rate on the H200).
    wgrad_block_n: N side of that tile (shrunk to divide N); None: square,
      wgrad_block. A [128, 256] tile (`default_config`'s for 16-bit
      operands) streams each lhs row tile (the layer's gathered rows) half
      as often as [128, 128]; with wgrad_warps=8 its float32 accumulator is
      128 registers a thread, as the products' 128 x 256 tiles at 8 warps.
    backend: the GPU body of `gmm`'s plain product: "triton" (`kernel_gmm`)
      or "mosaic_gpu" (`kernel_gmm_mosaic`, a Hopper prototype: 16-bit
      operands, no SwiGLU fusion or transposed rhs, block_m a multiple of
      64). `tgmm` and the fused calls always run the Triton bodies.
  """

  block_m: int = 128
  block_n: int = 256
  block_k: int = 64
  group_m: int = 8
  num_warps: int = 8
  num_stages: int = 3
  wgrad_rows: int = 64
  wgrad_stages: int = 5
  wgrad_warps: int = 4
  wgrad_block: int = 128
  wgrad_block_n: int | None = None
  backend: str = "triton"

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"GmmConfig.backend={self.backend!r}; must be one of {BACKENDS}")
    for name in ("block_m", "block_n", "block_k", "wgrad_block", "wgrad_block_n"):
      value = getattr(self, name)
      if name == "wgrad_block_n" and value is None:
        continue
      if not is_pow2(value) or value < 16:
        raise ValueError(f"GmmConfig.{name}={value!r}; must be a power of two >= 16 "
                         "(Triton tiles are powers of two; tensor cores take 16)")
    if not is_pow2(self.wgrad_rows) or self.wgrad_rows < 16:
      raise ValueError(f"GmmConfig.wgrad_rows={self.wgrad_rows!r}; must be a power of two "
                       ">= 16 (tensor cores take 16-deep products)")
    if not (isinstance(self.wgrad_stages, int) and self.wgrad_stages >= 1):
      raise ValueError(f"GmmConfig.wgrad_stages={self.wgrad_stages!r}; must be an int >= 1")
    if not (isinstance(self.group_m, int) and self.group_m >= 1):
      raise ValueError(f"GmmConfig.group_m={self.group_m!r}; must be an int >= 1")
    for name in ("num_warps", "wgrad_warps"):
      if not is_pow2(getattr(self, name)) or getattr(self, name) > 16:
        raise ValueError(f"GmmConfig.{name}={getattr(self, name)!r}; must be 1, 2, 4, 8 or 16")
    if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
      raise ValueError(f"GmmConfig.num_stages={self.num_stages!r}; must be an int >= 1")

  def wgrad_tile(self, k: int, n: int) -> tuple[int, int]:
    """`tgmm`'s [K, N] result tile for an lhs of width K and an rhs of width N:
    (wgrad_block, wgrad_block_n or wgrad_block), each shrunk to the largest power
    of two dividing its side."""
    return (min(self.wgrad_block, k & -k),
            min(self.wgrad_block if self.wgrad_block_n is None else self.wgrad_block_n, n & -n))

  @property
  def wgrad_step(self) -> int:
    """Rows per step of `tgmm`: wgrad_rows, at most block_m."""
    return min(self.wgrad_rows, self.block_m)

  def fit(self, k: int, n: int) -> "GmmConfig":
    """This config with block_k and block_n shrunk to divide K and N.

    Raises:
      ValueError: K or N is not a multiple of 16.
    """
    for name, size in (("K", k), ("N", n)):
      if size % 16:
        raise ValueError(f"grouped matmul {name}={size} must be a multiple of 16 (pad the "
                         "expert width or the model width to a multiple of 16)")
    return dataclasses.replace(self, block_k=min(self.block_k, k & -k),
                               block_n=min(self.block_n, n & -n))


def default_config(dtype=jnp.bfloat16) -> GmmConfig:
  """The heuristic, from the tile sweeps in docs/benchmarks.md (bf16).

  Products (`gmm`): 128 x 256 result tiles, 64-deep slices, 8 warps, 3
  stages, launch groups of 8 row tiles (against 128 x 128 tiles: 0.79
  against 0.68 of the dense rate for the gathered forward at the gpu_1b
  shape, 0.75 against 0.62 at the fine shape; 4 stages were slower).
  Weight gradients (`tgmm`): [128, 256] result tiles at 8 warps, 64-row
  steps, 5 stages. The gathered operand's row indices take a pipeline stage
  of their own: with 3 stages its loads did not overlap the products (0.42
  of the dense rate at the gpu_1b shape against 0.74). The wide tile reads
  each gathered row tile half as often as [128, 128] at 4 warps, and takes
  12% and 15% less time at the gpu_1b and gpu_150m shapes on an H100 (6%
  and 8% on an H200, one process each). float32 operands take twice the
  shared memory: 64-wide square tiles, 32-deep slices, 2 stages.
  """
  if jnp.dtype(dtype).itemsize >= 4:
    return GmmConfig(block_n=64, block_k=32, num_stages=2, wgrad_stages=2, wgrad_warps=8,
                     wgrad_block=64)
  return GmmConfig(wgrad_warps=8, wgrad_block_n=256)


def with_fields(items, dtype=jnp.bfloat16) -> GmmConfig:
  """`default_config(dtype)` with `name=int` items replacing its fields (the
  benchmarks' and inspect_triton's --gmm_config, e.g. ["wgrad_block_n=256"];
  `backend` takes its name, e.g. "backend=mosaic_gpu").

  Raises:
    ValueError: an item is not name=int for a field of GmmConfig, or the
      result is not a valid config.
  """
  names = {f.name for f in dataclasses.fields(GmmConfig)}
  fields = {}
  for item in items:
    name, sep, value = item.partition("=")
    if not sep or name not in names:
      raise ValueError(f"GmmConfig field {item!r}: give name=int with a name in {sorted(names)}")
    if name == "backend":
      fields[name] = value
      continue
    try:
      fields[name] = int(value)
    except ValueError as err:
      raise ValueError(f"GmmConfig field {item!r}: the value must be an int") from err
  return dataclasses.replace(default_config(dtype), **fields)
