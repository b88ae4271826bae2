"""Counting calls of module functions in tests (which code path a run took)."""
import functools


def count_calls(monkeypatch, targets) -> dict:
  """Wraps each `(module, name, key)` function so that its calls are counted.

  Returns {key: calls so far}, updated in place; the wrapped functions still run.
  """
  counts = {key: 0 for _, _, key in targets}

  def counted(real, key, *args, **kwargs):
    counts[key] += 1
    return real(*args, **kwargs)

  for module, name, key in targets:
    monkeypatch.setattr(module, name, functools.partial(counted, getattr(module, name), key))
  return counts
