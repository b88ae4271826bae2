"""Mesh axes and logical-axis rules: the lowest level of k3jax.

Layers and models name their arrays' dimensions through `rules`; `mesh`
builds the device mesh those names map onto. Neither imports anything else
from k3jax, so every level above may use them (docs/design.md, "Import levels").
"""
