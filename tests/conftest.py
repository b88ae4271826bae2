"""Test-wide setup: 8 fake CPU devices for sharding tests, XLA's quick CPU compile, the `gpu` marker."""
import os

import jax
import pytest

# Must run before JAX initialises its backends.
jax.config.update("jax_num_cpu_devices", 8)

# The CPU suite compiles far more than it computes (interpreted Pallas kernels unroll into large
# programs): XLA's backend optimisations cost more compile time than they save, about a third of
# the suite's time on a 2-core machine. The environment variable carries the setting into the
# processes tests start (binaries, notebook kernels, multi-process workers). GPU runs keep them.
OPTIMISED_CPU_ENV = "K3JAX_TESTS_OPTIMISED_CPU"  # set to 1 to compile as a user's CPU run does


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


HAS_GPU = _has_gpu()

if not HAS_GPU and os.environ.get(OPTIMISED_CPU_ENV) != "1":
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
  jax.config.update("jax_disable_most_optimizations", True)


def pytest_collection_modifyitems(config, items):
  del config
  if HAS_GPU:
    return
  skip_gpu = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip_gpu)
