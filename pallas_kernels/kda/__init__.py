"""Chunked Kimi Delta Attention (KDA) and Gated DeltaNet.

`chunk_kda` is the public entry and `KdaSpec` its tiling and implementation
choices; `reference` holds the naive recurrence and
the chunked jnp form; `tiling` the lower-bound rule for dense diagonal tiles.
"""
from pallas_kernels.kda.api import IMPLEMENTATIONS, chunk_kda
from pallas_kernels.kda.spec import DIAGONALS, KdaSpec
from pallas_kernels.kda.reference import chunk_kda_xla, naive_recurrent_kda
from pallas_kernels.kda.tiling import MAX_EXP_ARG, check_lower_bound, safe_tile_len

__all__ = [
    "DIAGONALS", "IMPLEMENTATIONS", "KdaSpec", "MAX_EXP_ARG", "check_lower_bound", "chunk_kda",
    "chunk_kda_xla", "naive_recurrent_kda", "safe_tile_len",
]
