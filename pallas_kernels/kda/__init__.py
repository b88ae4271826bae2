"""pallas_kernels/kda package."""
