"""k3jax: hybrid linear-attention MoE language models in JAX/Flax NNX."""
