"""Causal softmax attention with grouped KV heads and no positional encoding.

Full-sequence calls use `jax.nn.dot_product_attention`: cuDNN's fused kernel
on GPU for 16-bit compute when it compiles for the layer's head shape, XLA
otherwise (CPU, float32). Decoding keeps a preallocated KV cache.

Documents packed in a row (`segments`): each token attends only within its
own run, one of two ways (`documents`):
- "packed": cuDNN's packed layout (`k3jax.layers.packed_attention`), the
  run starts and lengths of each row; no [T, T] mask, and the tiles between
  documents are skipped. Needs the cuDNN implementation, a Hopper or later
  GPU, and a jax version whose private call was checked; the default where
  it compiles (`packed_attention.DEFAULT_ON_GPU`), except on a mesh of more
  than one device (`k3jax.parallel.model_layout`).
- "mask": a [B, 1, T, T] boolean mask (same run and causal) beside
  `is_causal=True`; XLA applies it to the logits, cuDNN takes it as an
  additive bias without a bias gradient, which doubles attention's cost.
  The reference, and the path on the CPU.
A left-padded prompt (`prefill`) is two runs, padding then prompt, and takes
the same path. Not wired: splash attention with segment ids on TPU.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers import packed_attention
from k3jax.layers.params import fan_in_init, logical_param
from k3jax.layers.segments import Segments
from k3jax.sharding import rules as rules_lib

IMPLEMENTATIONS = (None, "xla", "cudnn")
DOCUMENT_PATHS = (None, "mask", "packed")


@functools.cache
def _cudnn_compiles(dtype_name: str, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
  """Whether cuDNN's causal attention compiles here for this head shape."""
  shape_q = jax.ShapeDtypeStruct((1, 128, num_heads, head_dim), jnp.dtype(dtype_name))
  shape_kv = jax.ShapeDtypeStruct((1, 128, num_kv_heads, head_dim), jnp.dtype(dtype_name))
  fn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
  try:
    jax.jit(fn).lower(shape_q, shape_kv, shape_kv).compile()
    return True
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("cuDNN attention unavailable for %s heads=%d/%d dim=%d (%s); using XLA",
                    dtype_name, num_heads, num_kv_heads, head_dim, str(e).splitlines()[0][:200])
    return False


def resolve_implementation(requested: str | None, dtype, num_heads: int, num_kv_heads: int,
                           head_dim: int) -> str:
  """Returns `requested`, or for None: "cudnn" where it compiles, else "xla"."""
  if requested not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {requested!r}; allowed: {IMPLEMENTATIONS}")
  if requested is not None:
    return requested
  if jax.default_backend() != "gpu" or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return "xla"
  ok = _cudnn_compiles(jnp.dtype(dtype).name, num_heads, num_kv_heads, head_dim)
  return "cudnn" if ok else "xla"


def resolve_documents(requested: str | None, implementation: str, dtype, num_heads: int,
                      num_kv_heads: int, head_dim: int) -> str:
  """Returns `requested`, or for None: "packed" where the resolved `implementation` is
  cuDNN, `packed_attention.DEFAULT_ON_GPU` is set and the packed layout compiles for this
  head shape, else "mask"."""
  if requested not in DOCUMENT_PATHS:
    raise ValueError(f"attention documents path {requested!r}; allowed: {DOCUMENT_PATHS}")
  if requested == "mask":
    return requested
  if requested == "packed":
    if implementation != "cudnn":
      raise ValueError(f"documents='packed' runs on cuDNN, but the attention implementation is "
                       f"{implementation!r}: pass implementation='cudnn' or documents='mask'")
    if not packed_attention.available():
      raise ValueError(f"documents='packed' goes through a private jax API checked on jax "
                       f"{packed_attention.TESTED_JAX} only, not {jax.__version__}: pass "
                       f"documents='mask'")
    return requested
  if (implementation != "cudnn" or not packed_attention.DEFAULT_ON_GPU
      or not packed_attention.available()):
    return "mask"
  ok = packed_attention.compiles(jnp.dtype(dtype).name, num_heads, num_kv_heads, head_dim)
  return "packed" if ok else "mask"


def init_kv_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                  dtype) -> dict:
  """Zero KV cache: k, v [B, max_len, KVH, hd], the filled length `pos` (int32) and
  `start` [B] int32, each row's first slot that holds a token (slots before it are
  left padding, never attended)."""
  shape = (batch, max_len, num_kv_heads, head_dim)
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
          "pos": jnp.zeros((), jnp.int32), "start": jnp.zeros((batch,), jnp.int32)}


class CausalSelfAttention(nnx.Module):
  """Multi-head causal attention with GQA (`num_heads % num_kv_heads == 0`).

  Args:
    d_model: model width D.
    num_heads: query heads H.
    num_kv_heads: key/value heads (H must be a multiple).
    head_dim: per-head width hd.
    dtype: compute dtype; softmax runs in float32 inside the attention op.
    param_dtype: parameter dtype.
    implementation: "xla", "cudnn", or None to pick cuDNN on GPU for 16-bit
      compute when it compiles for this head shape, else XLA.
    documents: how documents packed in a row are kept apart (module
      docstring): "packed", "mask", or None for "packed" where the
      implementation is cuDNN, `packed_attention.DEFAULT_ON_GPU` is set and
      the packed layout compiles, else "mask".
  """

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               dtype=jnp.float32, param_dtype=jnp.float32, implementation: str | None = None,
               documents: str | None = None, rngs: nnx.Rngs):
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = (
        d_model, num_heads, num_kv_heads, head_dim)
    self.dtype = dtype
    self.implementation = resolve_implementation(implementation, dtype, num_heads, num_kv_heads,
                                                 head_dim)
    self.documents = resolve_documents(documents, self.implementation, dtype, num_heads,
                                       num_kv_heads, head_dim)
    init = fan_in_init(d_model)
    self.wq = logical_param(rngs, init, (d_model, num_heads, head_dim), ("embed", "heads", "kv"), param_dtype)
    self.wk = logical_param(rngs, init, (d_model, num_kv_heads, head_dim), ("embed", "heads", "kv"), param_dtype)
    self.wv = logical_param(rngs, init, (d_model, num_kv_heads, head_dim), ("embed", "heads", "kv"), param_dtype)
    self.wo = logical_param(rngs, fan_in_init(num_heads * head_dim), (num_heads, head_dim, d_model),
                            ("heads", "kv", "embed"), param_dtype)

  def _qkv(self, x_btd):
    x = x_btd.astype(self.dtype)
    q = jnp.einsum("btd,dhk->bthk", x, self.wq[...].astype(self.dtype))
    k = jnp.einsum("btd,dhk->bthk", x, self.wk[...].astype(self.dtype))
    v = jnp.einsum("btd,dhk->bthk", x, self.wv[...].astype(self.dtype))
    return q, k, v

  def _out(self, o_bthk):
    return jnp.einsum("bthk,hkd->btd", o_bthk.astype(self.dtype), self.wo[...].astype(self.dtype))

  def _attend(self, q, k, v, segments: Segments | None = None):
    """Causal attention of [B, T, H|KVH, hd] q, k, v -> [B, T, H, hd], within each
    run of `segments` when given (documents in a row), on the `documents` path.

    On a mesh whose sequence is split (context axis), the operands are
    re-laid out with the whole sequence on each device and the heads split over
    the context axis instead ("attn_heads"): one all-to-all in and one out,
    and cuDNN's fused kernel, which refuses a split sequence, still runs.
    Head counts the axis does not divide fall back to gathering the sequence.
    The mask or the run offsets are split like the batch only, whole on every device.
    """
    split = all(rules_lib.divides("attn_heads", n) for n in (self.num_heads, self.num_kv_heads))
    axes = ("batch", None, "attn_heads" if split else None, "kv")
    q, k, v = (rules_lib.constrain(x, axes, skip_indivisible=True) for x in (q, k, v))
    if segments is None:
      return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                          implementation=self.implementation)
    if self.documents == "packed":
      offsets_bm1, lengths_bm = (
          rules_lib.constrain(x, ("batch", None), skip_indivisible=True)
          for x in packed_attention.cudnn_layout(segments))
      return packed_attention.attend(q, k, v, offsets_bm1, lengths_bm)
    mask_b1tt = rules_lib.constrain(segments.attention_mask_b1tt(), ("batch", None, None, None),
                                    skip_indivisible=True)
    return jax.nn.dot_product_attention(q, k, v, mask=mask_b1tt, is_causal=True,
                                        implementation=self.implementation)

  def _check(self, x_btd):
    if x_btd.ndim != 3 or x_btd.shape[-1] != self.d_model:
      raise ValueError(f"attention expects [B, T, {self.d_model}], got {x_btd.shape}")

  def __call__(self, x_btd: jax.Array, segments: Segments | None = None
               ) -> tuple[jax.Array, dict]:
    """x_btd: [B, T, D] -> ([B, T, D] compute dtype, stats {}).

    With `segments` (`k3jax.layers.segments`) each token attends only to
    earlier tokens of its own document.
    """
    self._check(x_btd)
    q, k, v = self._qkv(x_btd)
    return self._out(self._attend(q, k, v, segments)), {}

  def prefill(self, x_btd: jax.Array, max_len: int, valid_bt: jax.Array | None = None
              ) -> tuple[jax.Array, dict, dict]:
    """Full causal pass over a prompt that also fills a cache of `max_len` slots.

    valid_bt: [B, T] bool, False on each row's left padding (prompts of several
    lengths), or None when every position holds a token. Padding is neither
    attended in the pass (padding and prompt are two runs of the row, on the
    `documents` path) nor by later `decode` steps (the cache's `start`).

    Returns ([B, T, D], stats, cache) with cache from `init_kv_cache`.
    """
    self._check(x_btd)
    b, t, _ = x_btd.shape
    if t > max_len:
      raise ValueError(f"prompt length {t} exceeds cache length {max_len}")
    q, k, v = self._qkv(x_btd)
    # Padding and prompt are two runs: no prompt token sees the padding.
    o = self._attend(q, k, v, None if valid_bt is None else Segments.of_left_padding(valid_bt))
    cache = init_kv_cache(b, max_len, self.num_kv_heads, self.head_dim, self.dtype)
    cache["k"] = jax.lax.dynamic_update_slice(cache["k"], k, (0, 0, 0, 0))
    cache["v"] = jax.lax.dynamic_update_slice(cache["v"], v, (0, 0, 0, 0))
    cache["pos"] = jnp.asarray(t, jnp.int32)
    if valid_bt is not None:
      cache["start"] = t - jnp.sum(valid_bt, axis=1, dtype=jnp.int32)
    return self._out(o), {}, cache

  def decode(self, x_b1d: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """One new token per sequence: x_b1d [B, 1, D] -> ([B, 1, D], new cache).

    Writes the token's key/value at slot `pos` and attends over slots
    [start_b, pos] of row b. Overrunning the cache is the caller's responsibility
    (`k3jax.models.generate` checks lengths up front).
    """
    self._check(x_b1d)
    if x_b1d.shape[1] != 1:
      raise ValueError(f"decode takes one token per sequence, got shape {x_b1d.shape}")
    q, k, v = self._qkv(x_b1d)
    pos = cache["pos"]
    k_cache = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, pos, 0, 0))
    v_cache = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, pos, 0, 0))
    slots = jnp.arange(k_cache.shape[1], dtype=jnp.int32)
    mask = (slots[None, :] >= cache["start"][:, None]) & (slots[None, :] <= pos)  # [B, S]
    o = jax.nn.dot_product_attention(q, k_cache, v_cache, mask=mask[:, None, None, :],
                                     implementation="xla")
    return self._out(o), {"k": k_cache, "v": v_cache, "pos": pos + 1, "start": cache["start"]}
