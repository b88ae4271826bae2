"""Log-likelihoods of token sequences, many at once, each scored as its own document.

A request is (context ids, continuation ids): the summed log-probability of
the continuation's tokens, each given the context and the continuation's
earlier tokens, and whether every one of them is the argmax (lm-eval's
`is_greedy`). Requests are packed into rows of `seq_len` positions
(first-fit, longest first) with segment ids, so no request sees another
(`HybridLM` resets the KDA state and masks attention at every document
start); rows go to the model in batches of a fixed shape, so one program
serves every batch. A request longer than a row goes in pieces (`windows`):
its context loses its first tokens, and a continuation longer than a row is
scored by several pieces, each with context before its targets.

    scores = continuation_logprobs(model, [(ctx_ids, cont_ids), ...], seq_len=128)
    totals = rolling_logprobs(model, [ids, ...], seq_len=128, prefix_id=eos)
    bpb = bits_per_byte(model, texts, tokenizer, seq_len=128, prefix_id=eos)

Requests share rows and batches only where the model routes each token on
its own (`routes_per_token`): a same-batch router (quantile thresholds,
expert choice) or an expert capacity makes a token's experts depend on the
other tokens of its batch, so there each request gets a batch of one row to
itself (its padding takes no part in routing), which scores it exactly as a
forward pass of that request alone.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.models.config import ModelConfig

# Routers whose choice for a token reads only that token's scores (and, at evaluation, a fixed
# state): with no capacity, a token routes the same whatever shares its batch.
_PER_TOKEN_ROUTERS = ("topk", "aux_loss", "bias_sign", "quantile_lagged")


def routes_per_token(config: ModelConfig) -> bool:
  """Whether a token's evaluation output is independent of the other tokens of its batch:
  no routed experts, or a per-token router without capacity."""
  router = config.router
  return (config.num_experts == 0
          or (router.name in _PER_TOKEN_ROUTERS and router.capacity_factor is None))


def windows(ids: Sequence[int], first: int, seq_len: int,
            overlap: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
  """The (context, continuation) pieces that score each of ids[first:] once, reading at most
  `seq_len` inputs each.

  A piece scores the targets after the previous piece's (the first, those from `first` on)
  and reads the tokens before them back to `seq_len` inputs in all. It scores as many
  targets as leave it `overlap` tokens of context (default seq_len // 2), or all that
  remain when fewer do: a continuation that fits in one row with some context is one piece
  whose context lost only its first tokens; a longer one goes by several. With `overlap=0`
  a long text goes by disjoint windows of `seq_len` targets.
  """
  overlap = seq_len // 2 if overlap is None else overlap
  if not 0 <= overlap < seq_len:
    raise ValueError(f"overlap={overlap} must be in [0, seq_len={seq_len})")
  if first < 1:
    raise ValueError(f"first={first}: the first scored token needs one token before it")
  x = np.asarray(ids, np.int32)
  last, done, out = len(x) - 1, first - 1, []  # x[last] is the last target
  while done < last:
    end = done + min(last - done, seq_len - min(done, overlap))
    start = max(0, end - seq_len)
    out.append((x[start:done + 1], x[done + 1:end + 1]))
    done = end
  return out


def first_fit(lengths: Sequence[int], seq_len: int, max_per_row: int) -> list[list[int]]:
  """Rows of request indices: longest first, each into the first row with room for it and
  fewer than `max_per_row` requests (one vectorised scan of the rows per request)."""
  if len(lengths) and max(lengths) > seq_len:
    raise ValueError(f"a request of {max(lengths)} positions does not fit rows of {seq_len}")
  # One slot per request bounds the rows; slot len(rows) is always a fresh, empty row.
  free = np.full(len(lengths) + 1, seq_len, np.int64)
  count = np.zeros(len(lengths) + 1, np.int64)
  rows: list[list[int]] = []
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    open_r = (free[:len(rows) + 1] >= lengths[i]) & (count[:len(rows) + 1] < max_per_row)
    row = int(np.argmax(open_r))
    if row == len(rows):
      rows.append([])
    rows[row].append(i)
    free[row] -= lengths[i]
    count[row] += 1
  return rows


def pack_rows(pieces, owners: Sequence[int], rows: list[list[int]],
              seq_len: int) -> dict[str, np.ndarray]:
  """Rows [R, seq_len] of (context, continuation) `pieces` laid out as `rows` says.

  Keys: inputs, targets, segment_ids (1, 2, ... per piece in a row, 0 for padding) and
  owner (`owners[p]` at the continuation targets of piece p, -1 elsewhere), all int32.
  """
  out = {k: np.zeros((len(rows), seq_len), np.int32) for k in ("inputs", "targets", "segment_ids")}
  out["owner"] = np.full((len(rows), seq_len), -1, np.int32)
  for r, members in enumerate(rows):
    start = 0
    for segment, p in enumerate(members, 1):
      context, continuation = pieces[p]
      ids = np.concatenate([context, continuation])
      end = start + len(ids) - 1
      out["inputs"][r, start:end] = ids[:-1]
      out["targets"][r, start:end] = ids[1:]
      out["segment_ids"][r, start:end] = segment
      out["owner"][r, end - len(continuation):end] = owners[p]
      start = end
  return out


@functools.partial(jax.jit, static_argnums=(0, 5))
def _target_scores(graphdef, state, inputs_bt, targets_bt, segment_ids_bt, max_segments):
  """(log p(target) [B, T] float32, target is the argmax [B, T] bool) of packed rows."""
  model = nnx.merge(graphdef, state)
  logits_btv, _ = model(inputs_bt, segment_ids=segment_ids_bt, max_segments=max_segments,
                        deterministic=True)
  logp_btv = jax.nn.log_softmax(logits_btv, axis=-1)
  logp_bt = jnp.take_along_axis(logp_btv, targets_bt[..., None], axis=-1)[..., 0]
  return logp_bt, jnp.argmax(logits_btv, axis=-1) == targets_bt


def _batches(rows: dict[str, np.ndarray], batch_rows: int):
  """Slices of `batch_rows` rows; the last one filled up with padding rows (owner -1)."""
  total = len(rows["inputs"])
  for start in range(0, total, batch_rows):
    batch = {k: v[start:start + batch_rows] for k, v in rows.items()}
    missing = batch_rows - len(batch["inputs"])
    if missing:
      batch = {k: np.pad(v, ((0, missing), (0, 0)), constant_values=-1 if k == "owner" else 0)
               for k, v in batch.items()}
    yield batch


def score_pieces(model, pieces, owners: Sequence[int], count: int, *, seq_len: int,
                 batch_rows: int = 8, max_documents_per_row: int = 8,
                 share_rows: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Summed log-probability [count] float64 and all-greedy [count] bool of the continuations
  of (context, continuation) `pieces` (`windows`' output), summed by `owners` [pieces].

  `batch_rows`: rows per model call; `max_documents_per_row`: the most pieces first-fit puts
  in one row (the model's static segment bound is this plus one, the padding run);
  `share_rows`: whether pieces may share rows and batches, None where the model routes each
  token on its own (`routes_per_token`); False gives each piece a batch of one row.
  """
  if share_rows is None:
    share_rows = routes_per_token(model.config)
  if share_rows:
    rows = first_fit([len(c) + len(x) - 1 for c, x in pieces], seq_len, max_documents_per_row)
  else:
    rows, batch_rows, max_documents_per_row = [[p] for p in range(len(pieces))], 1, 1
  logp = np.zeros(count, np.float64)
  greedy = np.ones(count, bool)
  graphdef, state = nnx.split(model)
  for batch in _batches(pack_rows(pieces, owners, rows, seq_len), batch_rows):
    logp_bt, greedy_bt = jax.device_get(_target_scores(
        graphdef, state, batch["inputs"], batch["targets"], batch["segment_ids"],
        max_documents_per_row + 1))
    scored = batch["owner"] >= 0
    np.add.at(logp, batch["owner"][scored], logp_bt[scored].astype(np.float64))
    np.logical_and.at(greedy, batch["owner"][scored], greedy_bt[scored])
  return logp, greedy


def _pieces_of(texts, firsts, seq_len: int, overlap: int | None):
  """(pieces, owners) of `windows` over every text."""
  pieces, owners = [], []
  for i, (ids, first) in enumerate(zip(texts, firsts)):
    for piece in windows(ids, first, seq_len, overlap):
      pieces.append(piece)
      owners.append(i)
  return pieces, owners


def continuation_logprobs(model, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                          seq_len: int, overlap: int | None = None,
                          **layout) -> list[tuple[float, bool]]:
  """(summed log-probability, is greedy) of each request's continuation given its context.

  Args:
    model: a HybridLM.
    requests: (context ids, continuation ids) pairs, each of 1 or more tokens.
    seq_len: T, positions per row. A request longer than T + 1 tokens loses the start of
      its context; a continuation too long for that is scored in pieces (`windows`, which
      `overlap` is passed to).
    layout: batch_rows, max_documents_per_row, share_rows (`score_pieces`).

  Returns:
    One (log-probability in nats, every continuation token is the argmax) per request, in order.
  """
  for context, continuation in requests:
    if not len(context) or not len(continuation):
      raise ValueError(f"a request needs a context and a continuation of 1 or more tokens, "
                       f"got {len(context)} and {len(continuation)}")
  texts = [np.concatenate([np.asarray(c, np.int32), np.asarray(x, np.int32)]) for c, x in requests]
  pieces, owners = _pieces_of(texts, [len(c) for c, _ in requests], seq_len, overlap)
  logp, greedy = score_pieces(model, pieces, owners, len(requests), seq_len=seq_len, **layout)
  return [(float(v), bool(g)) for v, g in zip(logp, greedy)]


def rolling_logprobs(model, texts_ids: Sequence[Sequence[int]], *, seq_len: int,
                     prefix_id: int | None = None, overlap: int | None = None,
                     **layout) -> list[float]:
  """Total log-likelihood (nats) of each token list, each its own document.

  The text read is `prefix_id` followed by the tokens (without a prefix the first token is
  only context); every token after it is scored once, in windows of at most `seq_len`
  inputs (`windows`): the first reads the text from its start, each later one scores the
  next `seq_len - overlap` tokens (the last, those left) with the `overlap` or more tokens
  before them as context. `layout` as in `score_pieces`. A list with nothing to score (no
  prefix and fewer than 2 tokens) scores 0.
  """
  prefix = [] if prefix_id is None else [prefix_id]
  texts = [np.asarray(prefix + list(ids), np.int32) for ids in texts_ids]
  pieces, owners = _pieces_of(texts, [1] * len(texts), seq_len, overlap)
  logp, _ = score_pieces(model, pieces, owners, len(texts), seq_len=seq_len, **layout)
  return [float(v) for v in logp]


def scored_bytes(text: str, ids: Sequence[int], tokenizer, prefix_id: int | None) -> int:
  """UTF-8 bytes of `text` that its scored tokens cover: all of them after a prefix token,
  else those after the first token (which is only context)."""
  total = len(text.encode("utf-8"))
  if prefix_id is not None or not len(ids):
    return total
  return total - len(tokenizer.decode(ids[:1]).encode("utf-8"))


def bits_per_byte(model, texts: Sequence[str], tokenizer, *, seq_len: int,
                  prefix_id: int | None = None, overlap: int | None = None,
                  **layout) -> dict[str, float]:
  """Held-out bits per UTF-8 byte of `texts`, comparable between tokenizers.

  The total negative log2-likelihood of the texts' tokens (`rolling_logprobs`, each text its
  own document) over the UTF-8 bytes those tokens cover (`scored_bytes`), not over tokens.

  Args:
    model: a HybridLM.
    texts: the held-out texts.
    tokenizer: a `k3jax.data.tokenizer.Tokenizer` (anything with `encode`, `decode`).
    seq_len, prefix_id, overlap, layout: as in `rolling_logprobs`.

  Returns:
    {"bits_per_byte", "bits" (total), "bytes", "tokens" (scored)}.
  """
  ids = tokenizer.encode_batch(list(texts))
  nats = rolling_logprobs(model, ids, seq_len=seq_len, prefix_id=prefix_id, overlap=overlap,
                          **layout)
  bits = -sum(nats) / math.log(2.0)
  num_bytes = sum(scored_bytes(t, i, tokenizer, prefix_id) for t, i in zip(texts, ids))
  tokens = sum(max(len(i) - (prefix_id is None), 0) for i in ids)
  return {"bits_per_byte": bits / max(num_bytes, 1), "bits": bits, "bytes": float(num_bytes),
          "tokens": float(tokens)}
