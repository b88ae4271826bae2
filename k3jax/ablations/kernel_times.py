"""Kernel time per decay variant (H200, B16 T2048 H16 K=V=128 bf16), copied from docs/benchmarks.md.

The results page and the decay notebook show these next to the trained
arms. The bounded arms' speed gain is stated against fla's unbounded kernel
(safe_gate=False) measured in the same device call, with our pairwise
diagonal (the softplus arm's path) as a second row.
"""
from __future__ import annotations

KERNEL_TIMES = {
    "g5_t16": {"path": "pallas dense, tile 16", "fwd_ms": 1.478, "fwd_bwd_ms": 5.330,
               "note": "the bound's path; forward 0.85x fla's unbounded kernel below"},
    "softplus": {"path": "pallas pairwise, tile 16", "fwd_ms": 1.927, "fwd_bwd_ms": 7.160,
                 "note": "diagonal tiles in kernels of their own: 1.30x / 1.34x the dense path"},
    "fla unbounded": {"path": "fla 0.6.0 chunk_kda, safe_gate=False", "fwd_ms": 1.740,
                      "fwd_bwd_ms": None,
                      "note": "the peer, same call (triton do_bench); its forward+backward did "
                              "not finish autotuning within the call's limit (10.11-10.26 ms in "
                              "the calls of 2026-12-01 and 12-02, another call: not compared)"},
    "g2.5_t32": {"path": "pallas dense, tile 32", "fwd_ms": None, "fwd_bwd_ms": None,
                 "note": "not measured: `python experiments/bench/bench_kernels.py --shapes=16x2048x16x128 "
                         "--impls=pallas:dense,pallas:pairwise --lower_bound=-2.5 --sub_chunk=32 "
                         "--stages= --peer=false`"},
    "g1.3_t64": {"path": "pallas dense, tile 64", "fwd_ms": None, "fwd_bwd_ms": None,
                 "note": "not measured: `python experiments/bench/bench_kernels.py --shapes=16x2048x16x128 "
                         "--impls=pallas:dense,pallas:pairwise --lower_bound=-1.3 --sub_chunk=64 "
                         "--stages= --peer=false`"},
}
KERNEL_TIMES_SOURCE = ("Source: call D of 2026-12-03 in docs/benchmarks.md (\"Pairwise against "
                       "dense diagonal\"): dense, pairwise and fla's unbounded kernel in one device "
                       "call, fla in its own process after ours; shape B16 T2048 H16 K=V=128 bf16, "
                       "C=64; pipelined timer, 10 calls.")
