"""k3jax/parallel package."""
