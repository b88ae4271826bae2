"""Tooling around the KDA kernels, kept out of `pallas_kernels.kda` (which holds the op).

Modules: `bench` (cost model, inputs and timing of the kernel stages),
`triton_ir` (the Triton IR and SASS of the kernels, captured on a CPU host),
`decode_ir` (the same for the decode kernel). They import the kernels; the
kernels never import them.
"""
