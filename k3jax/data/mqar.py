"""Multi-query associative recall (MQAR): a synthetic in-context recall task.

Each sequence first lists `num_kv_pairs` key-value pairs `k1 v1 k2 v2 ...`, then
asks for a random subset of the keys again, each followed by its value. The loss
and accuracy count only the positions whose input is a queried key and whose
target is that key's value. Keys are drawn without replacement from
`[1, vocab_size // 2)`, values with replacement from `[vocab_size // 2, vocab_size)`;
id 0 pads the tail. Training and held-out examples come from separate seed streams.
"""
from __future__ import annotations

import numpy as np

from k3jax.data.batch import make_batch

_TRAIN_STREAM, _HELDOUT_STREAM = 0, 1


def mqar_examples(rng: np.random.Generator, batch_size: int, seq_len: int, *,
                  vocab_size: int, num_kv_pairs: int, num_queries: int = 0) -> dict[str, np.ndarray]:
  """Draws a batch of MQAR sequences: inputs/targets/mask [batch_size, seq_len].

  `num_queries` <= 0 means as many as fit (at most `num_kv_pairs`).
  """
  check_mqar(seq_len, vocab_size, num_kv_pairs)
  room = (seq_len + 1 - 2 * num_kv_pairs) // 2
  nq = min(num_kv_pairs, room) if num_queries <= 0 else num_queries
  if nq > min(num_kv_pairs, room):
    raise ValueError(f"num_queries={num_queries} exceeds min(num_kv_pairs, room after the pairs)="
                     f"{min(num_kv_pairs, room)}")
  half = vocab_size // 2
  b = np.arange(batch_size)[:, None]
  keys = np.argsort(rng.random((batch_size, half - 1)), axis=1)[:, :num_kv_pairs] + 1
  values = rng.integers(half, vocab_size, size=(batch_size, num_kv_pairs))
  which = np.argsort(rng.random((batch_size, num_kv_pairs)), axis=1)[:, :nq]
  seq = np.zeros((batch_size, seq_len + 1), np.int32)
  seq[:, 0:2 * num_kv_pairs:2] = keys
  seq[:, 1:2 * num_kv_pairs:2] = values
  start = 2 * num_kv_pairs
  seq[:, start:start + 2 * nq:2] = keys[b, which]
  seq[:, start + 1:start + 2 * nq:2] = values[b, which]
  mask = np.zeros((batch_size, seq_len), np.float32)
  mask[:, start:start + 2 * nq:2] = 1.0  # input is the query key, target its value
  return make_batch(seq[:, :-1], seq[:, 1:], mask)


def check_mqar(seq_len: int, vocab_size: int, num_kv_pairs: int) -> None:
  """Raises ValueError if the pairs and at least one query cannot fit."""
  if num_kv_pairs < 1:
    raise ValueError(f"num_kv_pairs must be >= 1, got {num_kv_pairs}")
  if vocab_size // 2 - 1 < num_kv_pairs:
    raise ValueError(f"vocab_size={vocab_size} gives {vocab_size // 2 - 1} distinct keys, "
                     f"fewer than num_kv_pairs={num_kv_pairs}")
  if 2 * num_kv_pairs + 2 > seq_len + 1:
    raise ValueError(f"seq_len={seq_len} cannot hold {num_kv_pairs} pairs and one query "
                     f"(needs seq_len >= {2 * num_kv_pairs + 1})")


class MQARDataset:
  """MQAR with a fixed held-out set; metric is exact-match accuracy on query positions."""
  eval_metric = "accuracy"

  def __init__(self, *, vocab_size: int, num_kv_pairs: int, num_queries: int = 0, seed: int = 0):
    self.vocab_size = vocab_size
    self.num_kv_pairs = num_kv_pairs
    self.num_queries = num_queries
    self.seed = seed

  def check_seq_len(self, seq_len: int) -> None:
    """Raises if `seq_len` cannot hold the pairs and a query."""
    check_mqar(seq_len, self.vocab_size, self.num_kv_pairs)

  def sample(self, rng: np.random.Generator, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    """Training examples from the caller's generator (the training stream)."""
    return mqar_examples(rng, batch_size, seq_len, vocab_size=self.vocab_size,
                         num_kv_pairs=self.num_kv_pairs, num_queries=self.num_queries)

  def eval_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[dict[str, np.ndarray]]:
    """The fixed held-out set, drawn from a seed stream the training iterator never uses."""
    return [mqar_examples(np.random.default_rng([self.seed, _HELDOUT_STREAM, i]), batch_size, seq_len,
                          vocab_size=self.vocab_size, num_kv_pairs=self.num_kv_pairs,
                          num_queries=self.num_queries)
            for i in range(num_batches)]

  @staticmethod
  def metrics_from_loss(mean_nats: float) -> dict[str, float]:
    """No extra metric from the loss; accuracy comes from the eval step."""
    del mean_nats
    return {}
