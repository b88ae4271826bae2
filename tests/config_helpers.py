"""Dotted-key edits of trainer ConfigDicts for tests."""


def set_dotted(config, changes: dict):
  """Sets `{"a.b.c": value}` entries of `config` in place (new keys allowed: typo tests); returns it."""
  for key, value in changes.items():
    target = config
    *parents, leaf = key.split(".")
    for p in parents:
      target = target[p]
    with config.unlocked():
      target[leaf] = value
  return config
