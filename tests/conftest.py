"""Test-wide setup: 8 fake CPU devices for sharding tests, the `gpu` marker."""
import os

import jax
import pytest

# XLA's CPU collectives abort the whole process when the fake devices' threads
# do not all reach a rendezvous within 40 s. On a 2-core machine running two
# test workers, each with 8 device threads, a collective can wait that long
# under load, and the worker dies mid-test. Generous limits keep a slow
# rendezvous slow rather than fatal (XLA_FLAGS is read when the backend starts).
_COLLECTIVE_LIMITS = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=120",
                      "--xla_cpu_collective_call_terminate_timeout_seconds=900",
                      "--xla_cpu_collective_timeout_seconds=900")
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", "")] + [f for f in _COLLECTIVE_LIMITS
                                         if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
).strip()

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
