"""k3jax/data package."""
