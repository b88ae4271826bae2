"""Chunked Kimi Delta Attention (KDA) and Gated DeltaNet.

`chunk_kda` is the public entry and `KdaSpec` its tiling and implementation
choices (with the gate bound's rule for dense diagonal tiles); `reference`
holds the naive recurrence and the chunked jnp form.
"""
from pallas_kernels.kda.api import IMPLEMENTATIONS, chunk_kda
from pallas_kernels.kda.spec import DIAGONALS, MAX_EXP_ARG, KdaSpec, safe_tile_len
from pallas_kernels.kda.reference import chunk_kda_xla, naive_recurrent_kda

__all__ = [
    "DIAGONALS", "IMPLEMENTATIONS", "KdaSpec", "MAX_EXP_ARG", "chunk_kda",
    "chunk_kda_xla", "naive_recurrent_kda", "safe_tile_len",
]
