"""Whether a Pallas kernel family runs compiled or interpreted on a platform.

Each family compiles only for the platforms it has a lowering for; anywhere
else (the CPU above all, which has no Pallas backend) it runs interpreted:
the same kernel bodies, emulated, which is how the CPU tests run them.

    interprets("kda")             # False on a GPU or TPU, True on the CPU
    interprets("gmm", "tpu")      # True: the grouped matmul has no TPU lowering
"""
from __future__ import annotations

import jax

# The platforms (`jax.default_backend()` names) each kernel family is lowered for.
LOWERED = {
    "kda": ("gpu", "tpu"),       # the chunked scan: Triton and Mosaic (TPU) lowerings
    "kda_decode": ("gpu",),      # the decode step: Triton only
    "gmm": ("gpu",),             # the grouped matmuls: Triton only
}


def interprets(family: str, platform: str | None = None) -> bool:
  """Whether kernel `family` (a key of LOWERED) runs interpreted on `platform`
  (default `jax.default_backend()`)."""
  if family not in LOWERED:
    raise ValueError(f"kernel family {family!r}; known: {tuple(LOWERED)}")
  platform = jax.default_backend() if platform is None else platform
  return platform not in LOWERED[family]
