"""KdaSpec: the static choices of one chunked KDA call, validated once.

The model config holds one (`ModelConfig.kda`), the KDA layer holds it
and `chunk_kda(..., spec=...)` and the context-parallel path take it whole.
Direct callers may pass the same choices as `chunk_kda` keyword arguments;
they are turned into a spec there (`resolve`), so the fields are declared
here only. The gate's lower bound lives here: it is checked (negative, and
safe for the dense diagonal's tiles: `check_lower_bound`), and its math is
the spec's methods (the bounded gate and its inverse, the clamp, the check of
concrete and traced gates), so the layers and the input checks use the bound
without naming it. The kernels that read it (`kernel_cumsum`,
`kernel_gate_cumsum`) take the spec whole.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from pallas_kernels.kda import kernel_cumsum
from pallas_kernels.kda import kernel_gate_cumsum

# Largest exponent a dense diagonal factor may reach. float32 and bfloat16
# overflow above exp(88.72); 85 leaves a factor of ~40 for the operands'
# own magnitude (unit-norm k times beta <= 1 in practice).
MAX_EXP_ARG = 85.0


def safe_tile_len(lower_bound: float) -> int:
  """Longest diagonal tile for which `lower_bound` keeps the dense path finite."""
  if lower_bound >= 0:
    raise ValueError(f"lower_bound must be negative, got {lower_bound}")
  return int(math.floor(MAX_EXP_ARG / abs(lower_bound))) + 1


def check_lower_bound(lower_bound: float | None, tile_len: int) -> None:
  """Raises ValueError unless `|lower_bound| * (tile_len - 1) <= MAX_EXP_ARG`.

  A dense diagonal tile of length L anchored at its first row multiplies a
  column operand by up to exp(|lower_bound| * (L - 1)); above ~88.7 that is inf in
  float32 and bfloat16.
  """
  if lower_bound is None:
    raise ValueError(
        "diagonal='dense' needs lower_bound (the bound of the gate "
        "g = lower_bound * sigmoid(.)); pass it, or use diagonal='pairwise' for an "
        "unbounded gate.")
  lower_bound = float(lower_bound)
  if not lower_bound < 0:
    raise ValueError(f"lower_bound must be negative, got {lower_bound}")
  if tile_len < 1:
    raise ValueError(f"tile length must be >= 1, got {tile_len}")
  exponent = abs(lower_bound) * (tile_len - 1)
  if exponent > MAX_EXP_ARG:
    raise ValueError(
        f"lower_bound={lower_bound} is unsafe for a dense diagonal tile of "
        f"length {tile_len}: |lower_bound| * (tile_len - 1) = {exponent:.1f} "
        f"exceeds the safe limit {MAX_EXP_ARG} (exp overflows float32/bf16 at "
        f"~88.7). Use a tile of at most {safe_tile_len(lower_bound)} rows, a "
        f"bound of at least {-MAX_EXP_ARG / max(tile_len - 1, 1):.3f}, or "
        "diagonal='pairwise'.")


# chunk_kda implementations: Pallas kernels (custom VJP), chunked jnp, token loop.
IMPLEMENTATIONS = ("pallas", "xla", "naive")
# Diagonal-tile strategies: anchored matmuls (bounded gates) or explicit pair decay.
DIAGONALS = ("dense", "pairwise")


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class KdaSpec:
  """How `chunk_kda` tiles and runs the scan.

  Attributes:
    chunk_size: C, chunk length of the inter-chunk recurrence (positive int).
      Default 64.
    sub_chunk: L, the diagonal tile length; divides chunk_size. Default 16.
    diagonal: one of DIAGONALS. "dense" needs lower_bound with
      |lower_bound| * (sub_chunk - 1) <= MAX_EXP_ARG. Default "dense".
    lower_bound: the gate's lower bound (negative), or None for an unbounded gate
      (then diagonal must be "pairwise"). Default None.
    implementation: one of IMPLEMENTATIONS ("naive" ignores the tiling, and
      needs no lower bound). Default "xla".
  """
  chunk_size: int = 64
  sub_chunk: int = 16
  diagonal: str = "dense"
  lower_bound: float | None = None
  implementation: str = "xla"

  def __post_init__(self):
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                       f"{self.implementation!r}")
    if self.diagonal not in DIAGONALS:
      raise ValueError(f"diagonal must be one of {DIAGONALS}, got {self.diagonal!r}")
    if not _is_int(self.chunk_size) or self.chunk_size < 1:
      raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r}")
    if not _is_int(self.sub_chunk) or self.sub_chunk < 1 or self.chunk_size % self.sub_chunk:
      raise ValueError(f"sub_chunk must divide chunk_size={self.chunk_size}, got "
                       f"{self.sub_chunk!r}")
    if self.lower_bound is not None:
      object.__setattr__(self, "lower_bound", float(self.lower_bound))
      if not self.lower_bound < 0:
        raise ValueError(f"lower_bound must be negative, got {self.lower_bound}")
    # The token loop needs no bound; a bound it is given is still checked, so
    # a model config stays valid for every implementation.
    unbounded_loop = self.implementation == "naive" and self.lower_bound is None
    if self.diagonal == "dense" and not unbounded_loop:
      check_lower_bound(self.lower_bound, self.sub_chunk)

  @property
  def bounded(self) -> bool:
    """Whether the gate is bounded below (`lower_bound * sigmoid(.)`); else unbounded (softplus)."""
    return self.lower_bound is not None

  # -- the bound's math (a bounded spec) ------------------------------------------

  def gate(self, z: jax.Array) -> jax.Array:
    """g = lower_bound * sigmoid(z) in float32, of z's shape (z any float dtype)."""
    return self.lower_bound * jax.nn.sigmoid(z.astype(jnp.float32))

  def gate_preactivation(self, g: np.ndarray) -> np.ndarray:
    """z with gate(z) = g (numpy), g clipped to 1e-6 of either end of the range."""
    p = np.clip(g / self.lower_bound, 1e-6, 1 - 1e-6)
    return np.log(p) - np.log1p(-p)

  def fused_gate(self, raw: jax.Array, bias: jax.Array) -> jax.Array:
    """lower_bound * sigmoid(raw + bias) in float32, the jnp form of the fused gate
    (`kernel_gate_cumsum.bounded_sigmoid`)."""
    return kernel_gate_cumsum.bounded_sigmoid(raw, bias, self.lower_bound)

  def clamp(self, g: jax.Array) -> jax.Array:
    """g clamped into [lower_bound, 0] (`kernel_cumsum.clamp_gates`: gradient 1 on the
    closed interval, 0 outside)."""
    return kernel_cumsum.clamp_gates(g, self.lower_bound)

  def out_of_range(self, g: jax.Array) -> jax.Array:
    """Where `clamp` changes g and passes no gradient: g < lower_bound or g > 0."""
    return kernel_cumsum.out_of_range(g, self.lower_bound)

  def check_gate_min(self, g_lowest: float) -> None:
    """Raises ValueError if a concrete gate's minimum lies below the bound (dense diagonal)."""
    if g_lowest < self.lower_bound:
      raise ValueError(f"g must be >= lower_bound = {self.lower_bound} on diagonal='dense' (exp "
                       f"overflows below it); got min(g) = {g_lowest:.4g}. Pass g = lower_bound * "
                       "sigmoid(.), a lower_bound <= min(g), or diagonal='pairwise'")

  def checkify_gate_min(self, g: jax.Array) -> None:
    """`check_gate_min` for a traced g, as a `checkify` check."""
    checkify.check(jnp.all(~(g < self.lower_bound)),
                   f"g must be >= lower_bound = {self.lower_bound} on diagonal='dense'; "
                   "got min(g) = {}", jnp.min(g))


FIELDS = tuple(f.name for f in dataclasses.fields(KdaSpec))


def resolve(spec: KdaSpec | None, *, implementation: str | None = None, **choices) -> KdaSpec:
  """`spec`, or a KdaSpec built from the keyword choices (None keeps a default).

  Args:
    spec: a validated KdaSpec, or None.
    implementation, choices: chunk_size, sub_chunk, diagonal, lower_bound
      (KdaSpec fields); with `spec` they must all be None.
  """
  unknown = sorted(set(choices) - set(FIELDS))
  if unknown:
    raise TypeError(f"unexpected keyword arguments {unknown}; the KdaSpec fields are {FIELDS}")
  given = {name: value for name, value in dict(choices, implementation=implementation).items()
           if value is not None}
  if spec is None:
    return KdaSpec(**given)
  if not isinstance(spec, KdaSpec):
    raise TypeError(f"spec must be a KdaSpec, got {type(spec).__name__}")
  if given:
    raise ValueError(f"pass either spec or its fields, not both; got spec={spec} and "
                     f"{sorted(given)}")
  return spec


def check_clamp(spec: KdaSpec | None, gate_activation) -> None:
  """Raises ValueError unless a call that clamps its gates has a bound and no gate activation."""
  lower_bound = None if spec is None else spec.lower_bound
  if gate_activation is not None or lower_bound is None:
    raise ValueError("clamp_gates needs a lower_bound and no gate_activation (an activated "
                     f"gate is in range by construction); got lower_bound={lower_bound!r}, "
                     f"gate_activation={gate_activation!r}")
