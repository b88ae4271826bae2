"""Helpers shared by the config readers (no JAX import)."""
from __future__ import annotations

from typing import Any, Mapping


def to_plain(x: Any) -> Any:
  """ConfigDict / FrozenConfigDict / nested mappings -> plain nested dicts; other values as is."""
  if hasattr(x, "to_dict"):
    x = x.to_dict()
  if isinstance(x, Mapping):
    return {k: to_plain(v) for k, v in x.items()}
  return x
