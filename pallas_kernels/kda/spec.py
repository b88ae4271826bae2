"""KdaSpec: the static choices of one chunked KDA call, validated once.

The model config holds one (`ModelConfig.kda`), the KDA layer holds it
and `chunk_kda(..., spec=...)` and the context-parallel path take it whole.
Direct callers may pass the same choices as `chunk_kda` keyword arguments;
they are turned into a spec there (`resolve`), so the fields are declared
here only. The gate's lower bound is checked here: negative, and safe for
the dense diagonal's tiles (`check_lower_bound`).
"""
from __future__ import annotations

import dataclasses
import math

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
  column operand by up to exp(|g_min| * (L - 1)); above ~88.7 that is inf in
  float32 and bfloat16.
  """
  if lower_bound is None:
    raise ValueError(
        "diagonal='dense' needs lower_bound (g_min of the gate "
        "g = g_min * sigmoid(.)); pass it, or use diagonal='pairwise' for an "
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
    lower_bound: g_min of the gate (negative), or None for an unbounded gate
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
