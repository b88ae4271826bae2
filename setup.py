"""Installs the k3jax model library and the standalone pallas_kernels package.

    pip install -e ".[test]"        # library + test tools
    pip install -e ".[notebooks]"   # ablation notebooks
    pip install -e ".[bench]"       # PyTorch/fla peer for kernel benchmarks (GPU)
    pip install -e ".[tokamax]"     # tokamax grouped matmul for the dropless MoE mode (GPU)
"""
from setuptools import find_packages, setup

setup(
    name="k3jax",
    version="0.1.0",
    description=(
        "JAX/Flax hybrid linear-attention MoE language models: lower-bounded "
        "decay KDA kernels, quantile routing, block attention residuals."
    ),
    python_requires=">=3.12",
    packages=find_packages(include=["k3jax", "k3jax.*", "pallas_kernels", "pallas_kernels.*"]),
    install_requires=[
        "jax>=0.11.2",
        "flax>=0.12.10",
        "optax>=0.2.8",
        "chex>=0.1.92",
        "orbax-checkpoint>=0.12.4",
        "ml_collections>=1.0",
        "absl-py>=2.0",
        "numpy>=1.26",
        "tqdm>=4.60",
        "tensorboardX>=2.6",
    ],
    extras_require={
        # nbclient/ipykernel/matplotlib: tests/test_notebooks.py executes the ablation notebooks.
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "nbclient>=0.10",
                 "nbformat>=5.10", "ipykernel>=6.29", "matplotlib>=3.8"],
        "notebooks": ["jupyter", "nbclient>=0.10", "nbformat>=5.10", "ipykernel", "matplotlib>=3.8"],
        "bench": ["torch>=2.5", "flash-linear-attention>=0.6.0"],
        # Optional grouped-matmul kernel for the dropless MoE mode (GPU; needs jax >= 0.11.1).
        "tokamax": ["tokamax==0.0.17"],
        "gpu": ["jax[cuda13]>=0.11.2"],
    },
)
