"""Kernel time per decay variant (H200, B16 T2048 H16 K=V=128 bf16), copied from docs/benchmarks.md.

The decay notebook shows these next to the trained arms. The bounded arms'
speed gain is stated against fla's unbounded kernel (safe_gate=False)
measured in the same device call, with our pairwise diagonal (the softplus
arm's path) as a second row.
"""
from __future__ import annotations

KERNEL_TIMES = {
    "g5_t16": {"path": "pallas dense, tile 16", "fwd_ms": 1.442, "fwd_bwd_ms": 5.278,
               "note": "the bound's path; forward 0.83x fla's unbounded kernel below"},
    "softplus": {"path": "pallas pairwise, tile 16", "fwd_ms": 1.868, "fwd_bwd_ms": 7.059,
                 "note": "diagonal tiles in kernels of their own: 1.30x / 1.34x the dense path"},
    "fla unbounded": {"path": "fla 0.6.0 chunk_kda, safe_gate=False", "fwd_ms": 1.741,
                      "fwd_bwd_ms": None,
                      "note": "the peer, same call (triton do_bench); its forward+backward did "
                              "not finish autotuning within the call's limit (10.11-10.26 ms in "
                              "the calls of 2026-12-01 and 12-02, another call: not compared)"},
    "g2.5_t32": {"path": "pallas dense, tile 32", "fwd_ms": 1.331, "fwd_bwd_ms": 4.441,
                 "note": "same call; its pairwise pair took 2.05 / 36.03 ms there, with the "
                         "diagonal kernels' levels unrolled (they spilled at tile 32; now a loop, "
                         "not yet re-timed)"},
    "g1.3_t64": {"path": "pallas dense, tile 64", "fwd_ms": 1.410, "fwd_bwd_ms": 4.200,
                 "note": "same call; its pairwise pair did not finish within the step's 50 s "
                         "(levels unrolled then)"},
}
KERNEL_TIMES_SOURCE = ("Source: call H of 2026-12-05 in docs/benchmarks.md (\"Pairwise against "
                       "dense diagonal\"): dense, pairwise and fla's unbounded kernel in one device "
                       "call, fla in its own process after ours, the tile-32 and tile-64 rows after "
                       "it; shape B16 T2048 H16 K=V=128 bf16, C=64; pipelined timer, 10 calls.")
