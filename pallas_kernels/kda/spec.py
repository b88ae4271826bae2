"""KdaSpec: the static choices of one chunked KDA call, validated once.

The model config holds one (`ModelConfig.kda`), the KDA layer holds it
and `chunk_kda(..., spec=...)` and the context-parallel path take it whole.
Direct callers may pass the same choices as `chunk_kda` keyword arguments;
they are turned into a spec there.
"""
from __future__ import annotations

import dataclasses

from pallas_kernels.kda import tiling

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
      |lower_bound| * (sub_chunk - 1) <= tiling.MAX_EXP_ARG. Default "dense".
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
      tiling.check_lower_bound(self.lower_bound, self.sub_chunk)


def resolve(spec: KdaSpec | None, *, implementation: str | None = None, **choices) -> KdaSpec:
  """`spec`, or a KdaSpec built from the keyword choices (None keeps a default).

  Args:
    spec: a validated KdaSpec, or None.
    implementation, choices: chunk_size, sub_chunk, diagonal, lower_bound
      (KdaSpec fields); with `spec` they must all be None.
  """
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
