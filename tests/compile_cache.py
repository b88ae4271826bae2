"""A persistent JAX compilation cache for the processes tests start (trainer runs, notebook kernels).

Every shrunk `experiments/train.py` run in the tests compiles the same programs (the same model,
steps and shapes; only the number of steps, the run directory or a fault differ), and on the
2-core CPU compiling is most of such a run: its CPU time falls from ~18 s to ~7 s when the
programs come from the cache. The cache lives in a directory of this test process, removed when
it exits, so no run of the suite reads another's entries. The test process itself does not use
it: within one process JAX already compiles each program once.

A test whose subject is the compilation itself (a signal that arrives while it runs) starts its
process without `env()`'s entries.
"""
import atexit
import functools
import shutil
import tempfile


@functools.cache
def _directory() -> str:
  path = tempfile.mkdtemp(prefix="k3jax-tests-jax-cache-")
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  return path


def env() -> dict[str, str]:
  """Environment entries that make a child process read and write the shared cache."""
  # Every program is stored (by default only those that took a second or more to compile): the
  # many quick ones add up too.
  return {"JAX_COMPILATION_CACHE_DIR": _directory(),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
