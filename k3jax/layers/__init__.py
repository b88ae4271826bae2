"""k3jax/layers package."""
