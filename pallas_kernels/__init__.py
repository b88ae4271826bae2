"""Pallas kernels and their references; usable without k3jax."""
