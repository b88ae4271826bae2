"""Installs the k3jax model library and the standalone pallas_kernels package.

    pip install -e ".[test]"        # library + test tools
    pip install -e ".[notebooks]"   # ablation notebooks
    pip install -e ".[bench]"       # PyTorch/fla peer for kernel benchmarks (GPU)
    pip install -e ".[tokamax]"     # tokamax grouped matmul for the dropless MoE mode (GPU)
    pip install -e ".[data]"        # sentencepiece tokenizers and parquet input for prepare_data.py
    pip install -e ".[eval]"        # lm-eval for experiments/evaluate.py
"""
from setuptools import find_packages, setup

# The adapter subclasses lm-eval's TemplateLM, whose interface may change at 0.5.
_LM_EVAL = "lm_eval>=0.4.13,<0.5"

setup(
    name="k3jax",
    version="0.1.0",
    description=(
        "JAX/Flax hybrid linear-attention MoE language models: lower-bounded "
        "decay KDA kernels, quantile routing, block attention residuals."
    ),
    python_requires=">=3.12",
    packages=find_packages(include=["k3jax", "k3jax.*", "pallas_kernels", "pallas_kernels.*"]),
    # The bundled lm-eval tasks: their YAMLs, data and loader (not a package of their own).
    package_data={"k3jax.eval": ["tasks/*.yaml", "tasks/*.jsonl", "tasks/*.py"]},
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
        # Prepared data: array_record shards read through Grain, HF tokenizers (experiments/prepare_data.py).
        "grain>=0.2.18",
        "array-record>=0.8.6",
        "tokenizers>=0.23.3",
    ],
    extras_require={
        # nbclient/ipykernel/matplotlib: tests/test_notebooks.py executes the ablation notebooks;
        # nbconvert: tests/test_render_docs.py checks their HTML copies;
        # sentencepiece/pyarrow: the tokenizer and prepared-data tests cover the optional inputs;
        # lm_eval: tests/test_evaluate.py runs the bundled tasks;
        # ruff: tests/test_lint.py lints the tree (settings in ruff.toml).
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "nbclient>=0.10",
                 "nbformat>=5.10", "ipykernel>=6.29", "matplotlib>=3.8", "nbconvert>=7.16",
                 "sentencepiece", "pyarrow", _LM_EVAL, "ruff>=0.17"],
        "notebooks": ["jupyter", "nbclient>=0.10", "nbformat>=5.10", "nbconvert>=7.16", "ipykernel",
                      "matplotlib>=3.8"],
        # Optional inputs of experiments/prepare_data.py: sentencepiece .model tokenizers, parquet files.
        "data": ["sentencepiece", "pyarrow"],
        # experiments/evaluate.py. lm-eval's model backends (torch, transformers) are its own
        # extras, not installed: the adapter is the model.
        "eval": [_LM_EVAL],
        "bench": ["torch>=2.5", "flash-linear-attention>=0.6.0"],
        # Optional grouped-matmul kernel for the dropless MoE mode (GPU; needs jax >= 0.11.1).
        "tokamax": ["tokamax==0.0.17"],
        "gpu": ["jax[cuda13]>=0.11.2"],
    },
)
