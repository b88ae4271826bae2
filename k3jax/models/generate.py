"""Autoregressive sampling: one prefill pass, then token-by-token decoding.

The prefill runs the full-sequence path (chunked KDA, causal attention) and
returns each layer's cache: KDA conv windows + the [B, H, K, V] float32 state,
attention KV caches sized for prompt + new tokens. Decoding then feeds one
token per step through `HybridLM.decode`. The whole loop is one jitted
`lax.scan`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.kda import KDA
from pallas_kernels.kda import decode as kda_decode


def sample_logits(logits_bv: jax.Array, key: jax.Array, *, temperature: float = 1.0,
                  top_k: int | None = None) -> jax.Array:
  """Draws one token per row. logits_bv: [B, V] -> [B] int32.

  temperature == 0 is greedy (argmax); top_k keeps only the k largest logits.
  """
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if temperature == 0:
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  logits = logits_bv.astype(jnp.float32) / temperature
  if top_k is not None:
    if not 1 <= top_k <= logits.shape[-1]:
      raise ValueError(f"top_k must be in [1, V={logits.shape[-1]}], got {top_k}")
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k"))
def _generate(graphdef, state, prompt_bt, key, *, max_new_tokens, temperature, top_k):
  model = nnx.merge(graphdef, state)
  max_len = prompt_bt.shape[1] + max_new_tokens
  logits, cache = model.prefill(prompt_bt, max_len)
  keys = jax.random.split(key, max_new_tokens)
  first = sample_logits(logits[:, -1], keys[0], temperature=temperature, top_k=top_k)

  def step(carry, key_t):
    token_b, cache = carry
    logits_b1v, cache = model.decode(token_b[:, None], cache)
    nxt = sample_logits(logits_b1v[:, 0], key_t, temperature=temperature, top_k=top_k)
    return (nxt, cache), token_b

  (last, _), emitted = jax.lax.scan(step, (first, cache), keys[1:])
  new = jnp.concatenate([emitted.T, last[:, None]], axis=1)
  return jnp.concatenate([prompt_bt.astype(jnp.int32), new], axis=1)


def generate(model: nnx.Module, prompt_bt: jax.Array, *, max_new_tokens: int,
             key: jax.Array | None = None, temperature: float = 1.0,
             top_k: int | None = None) -> jax.Array:
  """Continues each prompt by `max_new_tokens` sampled tokens.

  Args:
    model: a HybridLM (anything with `prefill(tokens, max_len)` and
      `decode(tokens_b1, cache)`).
    prompt_bt: [B, T] int prompts of one common length T >= 1.
    max_new_tokens: N >= 1 tokens to append.
    key: PRNG key (unused when temperature == 0).
    temperature: softmax temperature; 0 is greedy.
    top_k: optional top-k filter.

  Returns:
    [B, T + N] int32: the prompts followed by the samples.
  """
  prompt_bt = jnp.asarray(prompt_bt)
  if prompt_bt.ndim != 2 or prompt_bt.shape[1] < 1:
    raise ValueError(f"prompt must be [B, T] with T >= 1, got shape {prompt_bt.shape}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  key = jax.random.key(0) if key is None else key
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, prompt_bt, key, max_new_tokens=int(max_new_tokens),
                   temperature=float(temperature), top_k=top_k)


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
