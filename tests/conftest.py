"""Test-wide setup: 8 fake CPU devices for sharding tests, the `gpu` marker."""
import jax
import pytest

# Must run before JAX initialises its backends.
jax.config.update("jax_num_cpu_devices", 8)


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  del config
  if _has_gpu():
    return
  skip_gpu = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip_gpu)
