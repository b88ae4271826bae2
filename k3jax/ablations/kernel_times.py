"""KDA kernel time per decay variant, copied from docs/benchmarks.md (H200, one device run).

Shape B16 T2048 H16 K=V=128, chunk 64, bf16 inputs, f32 gates, medians of 10
calls, jax 0.11.2 with the Pallas Triton lowering. Variants whose tile was not
benchmarked carry None and the command that measures them.
"""

KERNEL_TIMES = {
    "g5_t16": {"path": "pallas dense, tile 16", "fwd_ms": 2.571, "fwd_bwd_ms": 6.292,
               "note": "docs/benchmarks.md, call D of 2026-12-01 (session 2)"},
    "softplus": {"path": "pallas pairwise, tile 16", "fwd_ms": 9.373, "fwd_bwd_ms": 30.902,
                 "note": "the former pairwise diagonal, which walked each tile's positions one at a "
                         "time (at `e689ab0`); the nested-anchor diagonal that replaced it is not "
                         "timed yet: `python experiments/bench/bench_kernels.py --shapes=16x2048x16x128 "
                         "--impls=pallas:dense,pallas:pairwise --stages= --peer_modes=unsafe`, so "
                         "this ratio overstates the bound's gain"},
    "g2.5_t32": {"path": "pallas dense, tile 32", "fwd_ms": None, "fwd_bwd_ms": None,
                 "note": "not measured: `python experiments/bench/bench_kernels.py --shapes=16x2048x16x128 "
                         "--impls=pallas:dense --lower_bound=-2.5 --sub_chunk=32 --peer=false`"},
    "g1.3_t64": {"path": "pallas dense, tile 64", "fwd_ms": None, "fwd_bwd_ms": None,
                 "note": "not measured: `python experiments/bench/bench_kernels.py --shapes=16x2048x16x128 "
                         "--impls=pallas:dense --lower_bound=-1.3 --sub_chunk=64 --peer=false`"},
}
KERNEL_TIMES_SOURCE = ("Source: call D of 2026-12-01 (dense and pairwise in one process; its notes "
                       "are in docs/benchmarks.md at `e689ab0`), shape B16 T2048 H16 K=V=128, C=64; "
                       "medians of 10 calls.")
