"""k3jax/models package."""
