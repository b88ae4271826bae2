"""Helpers shared by the config readers (no JAX import)."""
from __future__ import annotations

import difflib
from typing import Any, Iterable, Mapping


def to_plain(x: Any) -> Any:
  """ConfigDict / FrozenConfigDict / nested mappings -> plain nested dicts; other values as is."""
  if hasattr(x, "to_dict"):
    x = x.to_dict()
  if isinstance(x, Mapping):
    return {k: to_plain(v) for k, v in x.items()}
  return x


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
  """`; did you mean 'PREFIX + closest'?` for the choice closest to `word`, or "" when none is close."""
  close = difflib.get_close_matches(word, list(choices), n=1)
  return f"; did you mean {prefix + close[0]!r}?" if close else ""
