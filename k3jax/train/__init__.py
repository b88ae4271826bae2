"""k3jax/train package."""
