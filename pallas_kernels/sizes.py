"""Size rules shared by the Pallas kernels of `kda` and `gmm`."""
from __future__ import annotations

import numbers


def is_pow2(n) -> bool:
  """Whether n is an integer and a positive power of two: Triton tensors and
  tiles must have power-of-two sizes."""
  return isinstance(n, numbers.Integral) and n > 0 and n & (n - 1) == 0
