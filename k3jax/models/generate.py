"""Autoregressive sampling from prompts of any lengths: one prefill pass, then
token-by-token decoding with a per-row stop.

    out = generate(model, [[5, 7, 1], [3]], max_new_tokens=20, temperature=0, eos_id=2)
    out[0].tokens, out[0].finish_reason      # new ids only; "eos" | "stop" | "length"

The prompts are left-padded to the longest and prefilled together
(`HybridLM.prefill(..., lengths_b=...)`): the padding reaches no cache entry,
no expert and no prompt token, so each row continues exactly as its prompt
would alone (up to float rounding, the KDA chunks falling elsewhere; with a
capacity-limited router the tokens of one batch still compete for expert
slots, as in any batch). All rows share one cache position, which left
padding makes possible: every row's last prompt token sits at slot T - 1.

Decoding runs in jitted `lax.while_loop`s of up to N steps each
(`Generation.advance`), which end early once every row has finished; a caller
that streams text asks for a few steps at a time, `generate` for all at once.
A row finishes at `eos_id`, at one of `stop_sequences` (token-id sequences,
matched on the device against the row's newest tokens), at a host-side
`Generation.stop` (e.g. a stop string found in decoded text, which may span
tokens), or after `max_new_tokens`. Finished rows emit nothing more and take
no expert in later steps.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.layers.kda import KDA
from pallas_kernels.kda import decode as kda_decode

FINISH_REASONS = ("eos", "stop", "length")
_RUNNING = 0  # reason code of a live row; finished rows hold 1 + FINISH_REASONS.index(reason)
_CODE = {name: i + 1 for i, name in enumerate(FINISH_REASONS)}
_PAD_ID = 0   # left padding; any valid id would do, as the prefill masks it out


@dataclasses.dataclass(frozen=True)
class Completion:
  """One prompt's continuation.

  Attributes:
    tokens: the new ids, without the eos token or the stop sequence that ended them.
    finish_reason: "eos", "stop" (a stop sequence or `Generation.stop`) or
      "length" (max_new_tokens reached).
  """
  tokens: list[int]
  finish_reason: str


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How each token is drawn (static: a new value compiles a new loop).

  temperature 0 is greedy (argmax). Otherwise the logits are divided by the
  temperature, then `top_k` keeps the k largest and `top_p` the smallest set
  of most likely tokens whose probability reaches p (nucleus sampling).
  """
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None

  def check(self, vocab_size: int) -> None:
    """ValueError naming the bad field: a temperature NaN, infinite or < 0, top_k
    outside [1, vocab_size], top_p outside (0, 1]."""
    t = self.temperature
    if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
      raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {t!r}")
    if self.top_k is not None and not (isinstance(self.top_k, (int, np.integer))
                                       and 1 <= self.top_k <= vocab_size):
      raise ValueError(f"top_k must be an int in [1, {vocab_size}] (the vocabulary) or None, "
                       f"got {self.top_k!r}")
    p = self.top_p
    if p is not None and not (isinstance(p, (int, float)) and 0 < p <= 1):
      raise ValueError(f"top_p must be in (0, 1] or None, got {p!r}")


def sample_logits(logits_bv: jax.Array, key: jax.Array, *, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None) -> jax.Array:
  """Draws one token per row. logits_bv: [B, V] -> [B] int32 (see `Sampling`)."""
  Sampling(temperature, top_k, top_p).check(logits_bv.shape[-1])
  if temperature == 0:
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  logits = logits_bv.astype(jnp.float32) / temperature
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p is not None and top_p < 1:
    logits = _nucleus(logits, top_p)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _nucleus(logits_bv: jax.Array, top_p: float) -> jax.Array:
  """Masks to -inf every logit below the smallest top set of probability >= top_p.
  The most likely token always stays, so a tiny top_p is greedy."""
  desc = -jnp.sort(-logits_bv, axis=-1)
  probs = jax.nn.softmax(desc, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
  kept = jnp.where(before < top_p, desc, jnp.inf)
  cutoff = jnp.min(kept, axis=-1, keepdims=True)
  return jnp.where(logits_bv < cutoff, -jnp.inf, logits_bv)


def prompt_batch(prompts, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """The prompts left-padded into one batch.

  Args:
    prompts: a list of token-id sequences of any lengths >= 1, or an int array
      [B, T] (B prompts of length T).
    vocab_size: V; every id must lie in [0, V).

  Returns:
    (tokens [B, T_max] int32, lengths [B] int32); row b's prompt is its last
    lengths[b] positions. ValueError for no prompts, an empty prompt or an id
    outside the vocabulary (naming the prompt).
  """
  if isinstance(prompts, (np.ndarray, jax.Array)):
    if np.ndim(prompts) != 2:
      raise ValueError(f"prompts given as an array must be [B, T], got shape {np.shape(prompts)}")
    prompts = list(np.asarray(prompts))
  rows = [np.asarray(p) for p in prompts]
  if not rows:
    raise ValueError("no prompts: give at least one token-id sequence")
  for i, ids in enumerate(rows):
    if ids.ndim != 1 or ids.size == 0:
      raise ValueError(f"prompt {i} must be a non-empty sequence of token ids, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"prompt {i} holds {ids.dtype} values; token ids are integers")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
      raise ValueError(f"prompt {i} has id {int(bad[0])} outside the vocabulary [0, {vocab_size})")
  lengths = np.asarray([ids.size for ids in rows], np.int32)
  tokens = np.full((len(rows), int(lengths.max())), _PAD_ID, np.int32)
  for i, ids in enumerate(rows):
    tokens[i, tokens.shape[1] - ids.size:] = ids
  return tokens, lengths


@dataclasses.dataclass(frozen=True)
class _Loop:
  """The static settings of the decoding loop (hashable: a jit static argument)."""
  sampling: Sampling
  max_new_tokens: int
  eos_id: int | None
  stops: tuple[tuple[int, ...], ...]

  @property
  def history(self) -> int:
    """Newest tokens each row keeps for matching stop sequences (at least 1)."""
    return max([len(s) for s in self.stops] + [1])


def _check_loop(loop: _Loop, vocab_size: int) -> None:
  loop.sampling.check(vocab_size)
  if isinstance(loop.max_new_tokens, bool) or not isinstance(loop.max_new_tokens, int) \
      or loop.max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {loop.max_new_tokens!r}")
  if loop.eos_id is not None and not 0 <= loop.eos_id < vocab_size:
    raise ValueError(f"eos_id {loop.eos_id} is outside the vocabulary [0, {vocab_size})")
  for seq in loop.stops:
    if not seq or any(not 0 <= t < vocab_size for t in seq):
      raise ValueError(f"stop sequence {list(seq)} must be non-empty token ids in [0, {vocab_size})")


def _sample(logits_bv, key, loop: _Loop):
  s = loop.sampling
  return sample_logits(logits_bv, key, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)


def _emit(carry: dict, token_b: jax.Array, loop: _Loop) -> tuple[dict, jax.Array]:
  """Appends token_b [B] to the live rows and finishes the rows it ends.

  Returns (carry, out_b [B] int32: the token, -1 for rows finished before).
  A row's eos outranks a stop sequence, which outranks the length cap; `cut_b`
  is how many of the row's last tokens (the eos or the stop sequence) to drop.
  """
  live = carry["reason_b"] == _RUNNING
  shifted = jnp.concatenate([carry["recent_bl"][:, 1:], token_b[:, None]], axis=1)
  recent = jnp.where(live[:, None], shifted, carry["recent_bl"])
  count = carry["count"] + 1
  reason = jnp.where(live & (count >= loop.max_new_tokens), _CODE["length"], carry["reason_b"])
  cut = carry["cut_b"]
  endings = [(seq, _CODE["stop"]) for seq in loop.stops]
  if loop.eos_id is not None:
    endings.append(((loop.eos_id,), _CODE["eos"]))
  for seq, code in endings:  # later entries win
    tail = recent[:, recent.shape[1] - len(seq):]
    hit = live & jnp.all(tail == jnp.asarray(seq, jnp.int32), axis=1)
    reason = jnp.where(hit, code, reason)
    cut = jnp.where(hit, len(seq), cut)
  carry = {**carry, "recent_bl": recent, "count": count, "reason_b": reason, "cut_b": cut}
  return carry, jnp.where(live, token_b, -1)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len", "loop"))
def _start(graphdef, state, tokens_bt, lengths_b, key, *, max_len, loop):
  """Prefill and the first new token: (carry, out_b [B])."""
  model = nnx.merge(graphdef, state)
  logits, cache = model.prefill(tokens_bt, max_len, lengths_b=lengths_b)
  key, sub = jax.random.split(key)
  token = _sample(logits[:, -1], sub, loop)  # left padding: every prompt ends at T - 1
  b = tokens_bt.shape[0]
  carry = {"cache": cache, "key": key, "token_b": token, "count": jnp.zeros((), jnp.int32),
           "reason_b": jnp.zeros((b,), jnp.int32), "cut_b": jnp.zeros((b,), jnp.int32),
           "recent_bl": jnp.full((b, loop.history), -1, jnp.int32)}
  return _emit(carry, token, loop)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_steps", "loop"))
def _advance(graphdef, state, carry, *, num_steps, loop):
  """Up to num_steps decoding steps, fewer once every row has finished:
  (carry, out_bn [B, num_steps] int32, -1 where a row emitted nothing)."""
  model = nnx.merge(graphdef, state)
  out = jnp.full((carry["token_b"].shape[0], num_steps), -1, jnp.int32)

  def running(c):
    i, carry, _ = c
    return (i < num_steps) & jnp.any(carry["reason_b"] == _RUNNING)

  def step(c):
    i, carry, out = c
    live = carry["reason_b"] == _RUNNING
    logits, cache = model.decode(carry["token_b"][:, None], carry["cache"], active_b=live)
    key, sub = jax.random.split(carry["key"])
    token = _sample(logits[:, 0], sub, loop)
    carry, out_b = _emit({**carry, "cache": cache, "key": key, "token_b": token}, token, loop)
    return i + 1, carry, out.at[:, i].set(out_b)

  _, carry, out = jax.lax.while_loop(running, step, (jnp.zeros((), jnp.int32), carry, out))
  return carry, out


class Generation:
  """Continues a batch of prompts a few steps at a time (for streaming).

      g = Generation(model, prompts, max_new_tokens=100, temperature=0, eos_id=2)
      while not g.done:
        for row, new in enumerate(g.advance(8)):   # newly visible ids of each row
          ...                                      # g.stop(row) ends a row early
      completions = g.results()

  Args:
    model: a HybridLM (anything with `config.vocab_size`, `prefill(tokens,
      max_len, lengths_b=...)` and `decode(tokens_b1, cache, active_b=...)`).
    prompts: token-id sequences of any lengths >= 1, or an int array [B, T]
      (`prompt_batch`).
    max_new_tokens: N >= 1, the most new tokens of a row.
    key: PRNG key (default key 0; unused when temperature == 0).
    temperature, top_k, top_p: see `Sampling`.
    eos_id: the token that ends a row, or None.
    stop_sequences: token-id sequences that end a row when its newest tokens
      match one; the match is dropped from the row's tokens.

  ValueError (before anything is compiled) for a bad prompt or argument.
  """

  def __init__(self, model: nnx.Module, prompts, *, max_new_tokens: int,
               key: jax.Array | None = None, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
               stop_sequences: Sequence[Sequence[int]] = ()):
    vocab = model.config.vocab_size
    self._loop = _Loop(Sampling(temperature, top_k, top_p), max_new_tokens,
                       None if eos_id is None else int(eos_id),
                       tuple(tuple(int(t) for t in seq) for seq in stop_sequences))
    _check_loop(self._loop, vocab)
    self._tokens_bt, self._lengths_b = prompt_batch(prompts, vocab)
    self._graphdef, self._state = nnx.split(model)
    self._key = jax.random.key(0) if key is None else key
    self._carry = None
    b = len(self._lengths_b)
    self._emitted = [[] for _ in range(b)]
    self._shown = [0] * b
    self._reason = np.zeros((b,), np.int32)
    self._cut = np.zeros((b,), np.int32)

  @property
  def done(self) -> bool:
    """Whether every row has finished."""
    return bool(np.all(self._reason != _RUNNING))

  def advance(self, num_steps: int) -> list[list[int]]:
    """Runs up to `num_steps` more tokens per row (fewer once all rows finish).

    Returns each row's newly visible ids. A live row holds back its last
    (longest stop sequence - 1) ids, which may yet turn out to be a stop
    sequence; the eos token and a matched stop sequence are never shown.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
      raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    outs = []
    if self._carry is None:
      self._carry, first = _start(self._graphdef, self._state, self._tokens_bt, self._lengths_b,
                                  self._key, max_len=self.max_len, loop=self._loop)
      outs.append(first[:, None])
      num_steps -= 1
      if np.any(self._reason != _RUNNING):  # rows stopped before the start keep only their first token
        self._carry["reason_b"] = jnp.maximum(self._carry["reason_b"], jnp.asarray(self._reason))
    if num_steps and not self._finished_on_device():
      self._carry, out = _advance(self._graphdef, self._state, self._carry, num_steps=num_steps,
                                  loop=self._loop)
      outs.append(out)
    self._sync([np.asarray(o) for o in outs])
    return [self._take_visible(row) for row in range(len(self._emitted))]

  def finished(self, row: int) -> bool:
    """Whether `row` has finished."""
    return bool(self._reason[row] != _RUNNING)

  @property
  def max_len(self) -> int:
    """Cache positions per row: the longest prompt + max_new_tokens."""
    return self._tokens_bt.shape[1] + self._loop.max_new_tokens

  def stop(self, row: int) -> None:
    """Finishes `row` now with reason "stop", keeping every token it has emitted (before
    the first `advance`: after its first token)."""
    if self._reason[row] != _RUNNING:
      return
    self._reason[row] = _CODE["stop"]
    if self._carry is not None:
      self._carry = {**self._carry, "reason_b": jnp.asarray(self._reason)}

  def results(self) -> list[Completion]:
    """Each row's `Completion` so far (the tokens a live row holds back included)."""
    out = []
    for row, tokens in enumerate(self._emitted):
      reason = FINISH_REASONS[self._reason[row] - 1] if self._reason[row] else "length"
      out.append(Completion(tokens[:len(tokens) - int(self._cut[row])], reason))
    return out

  def _finished_on_device(self) -> bool:
    return bool(np.all(np.asarray(self._carry["reason_b"]) != _RUNNING))

  def _sync(self, outs_bn: list[np.ndarray]) -> None:
    """Appends the emitted ids and reads each row's state from the device."""
    for out in outs_bn:
      for row, ids in enumerate(out):
        self._emitted[row].extend(int(t) for t in ids if t >= 0)
    self._reason = np.array(self._carry["reason_b"])
    self._cut = np.array(self._carry["cut_b"])

  def _take_visible(self, row: int) -> list[int]:
    tokens = self._emitted[row]
    if self._reason[row] == _RUNNING:
      end = len(tokens) - (self._loop.history - 1)
    else:
      end = len(tokens) - int(self._cut[row])
    new = tokens[self._shown[row]:max(end, self._shown[row])]
    self._shown[row] += len(new)
    return new


def generate(model: nnx.Module, prompts, *, max_new_tokens: int, key: jax.Array | None = None,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_id: int | None = None, stop_sequences: Sequence[Sequence[int]] = ()
             ) -> list[Completion]:
  """Continues each prompt until its eos, a stop sequence or `max_new_tokens`.

  Arguments as `Generation`'s. One prefill and one jitted decoding loop.

  Returns:
    one `Completion` per prompt, in order: the new ids (without the eos or
    stop sequence that ended them) and the finish reason.
  """
  g = Generation(model, prompts, max_new_tokens=max_new_tokens, key=key, temperature=temperature,
                 top_k=top_k, top_p=top_p, eos_id=eos_id, stop_sequences=stop_sequences)
  g.advance(max_new_tokens)
  return g.results()


def cache_bytes(config, batch: int, max_len: int) -> dict[str, int]:
  """Bytes of the decoding caches of `batch` rows of `max_len` positions.

  config: a ModelConfig. Returns {"attention": KV caches (they grow with
  max_len), "kda": conv windows + float32 states (fixed), "total"}.
  """
  item = jnp.dtype(config.compute_dtype).itemsize
  attn = kda = 0
  for kind in config.layer_types:
    if kind == "A":
      attn += 2 * batch * max_len * config.num_kv_heads * config.head_dim * item
    else:
      h, k = config.num_heads, config.head_dim
      kda += batch * h * k * k * 4 + 3 * batch * (config.conv_size - 1) * h * k * item
  return {"attention": attn, "kda": kda, "total": attn + kda}


def set_kda_decode(model: nnx.Module, implementation: str) -> int:
  """Makes every KDA layer of `model` decode with `implementation`.

  implementation: "auto" or one of `pallas_kernels.kda.decode.DECODE_IMPLEMENTATIONS`
  (the choice `ModelConfig.kda_decode` makes at construction). Returns the
  number of KDA layers changed. The parameters are untouched.
  """
  kda_decode.resolve_decode(implementation)
  layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, KDA)]
  for layer in layers:
    layer.decode_implementation = implementation
  return len(layers)


def prefill(model: nnx.Module, tokens_bt: jax.Array, max_len: int):
  """Jitted `model.prefill`: (logits [B, T, V] float32, cache)."""
  return _prefill(model, tokens_bt, max_len)


def decode_step(model: nnx.Module, tokens_b1: jax.Array, cache):
  """Jitted `model.decode`: (logits [B, 1, V] float32, new cache)."""
  return _decode(model, tokens_b1, cache)


@nnx.jit(static_argnums=(2,))
def _prefill(model, tokens_bt, max_len):
  return model.prefill(tokens_bt, max_len)


@nnx.jit
def _decode(model, tokens_b1, cache):
  return model.decode(tokens_b1, cache)
