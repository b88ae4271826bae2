"""k3jax/routing package."""
