"""Grouped matmuls for routed experts, reading their rows through an index.

`api.gmm` (group g's rows times group g's weights) and `api.tgmm` (each
group's rows, transposed, times its other rows: the weight gradient) on a
row layout whose groups start on tile boundaries (`layout.TileMap`). Either
operand may be gathered from a token array as it is loaded, with a per-row
scale, so the MoE layer never writes a dispatched copy of its tokens.
"""
