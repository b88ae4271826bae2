"""HybridLM: the K3 hybrid decoder (KDA + attention mixers, MoE FFNs).

    x = embed(tokens)
    for layer i:   (two sublayers each: mixer 2i, FFN 2i + 1)
      out = mixer_i(norm(residual.read(2i)));       residual.write(2i, out)
      out = ffn_i(norm(residual.read(2i + 1)));     residual.write(2i + 1, out)
    logits = head(norm(residual.finish()))

The residual strategy (prenorm / block / full AttnRes) is one object behind
the same read/write interface, so this file never branches on it. Mixers are
KDA ("K") or causal softmax attention ("A") following `layer_pattern`; FFNs
are MoE (routed + shared experts) except an optional dense first layer.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers import segments as segments_lib
from k3jax.layers.attention import CausalSelfAttention
from k3jax.layers.ffn import SwiGLU
from k3jax.layers.kda import KDA
from k3jax.layers.moe import MoE, MoEConfig
from k3jax.layers.moe_path import ExpertParallel
from k3jax.layers.norms import RMSNorm
from k3jax.layers.params import fan_in_init, logical_param
from k3jax.layers.residual import make_residual
from k3jax.models.config import ModelConfig
from k3jax.sharding.rules import constrain

# Logical names of the residual stream [B, T, d]; mapped to mesh axes by the
# run's rules under `jax.set_mesh`, no-ops without a mesh.
_BTD = ("batch", "length", "embed")


def _shard_btd(x_btd: jax.Array) -> jax.Array:
  """Pins a [B, T, d] activation to the rules' layout at a sublayer boundary."""
  return constrain(x_btd, _BTD, skip_indivisible=True)


class DenseFFN(nnx.Module):
  """SwiGLU with the MoE calling convention: (y_btd, aux={})."""

  def __init__(self, d_model: int, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.mlp = SwiGLU(d_model, hidden, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x_btd, *, deterministic: bool = False, segments=None):
    del deterministic, segments  # per token: documents need nothing
    return self.mlp(x_btd), {}


def _make_ffn(config: ModelConfig, layer: int, rngs: nnx.Rngs, moe_impl: str | None,
              expert_parallel: ExpertParallel | None):
  dtype, pdt = config.compute_dtype, config.params_dtype
  if not config.is_moe_layer(layer):
    return DenseFFN(config.d_model, config.dense_hidden, dtype=dtype, param_dtype=pdt, rngs=rngs)
  impl = moe_impl or config.moe_impl
  # The grouped backend choice belongs to the ragged mode, except "pallas",
  # which serves both; buffers otherwise take the einsum.
  backend = config.moe_grouped_backend
  if impl != "ragged" and backend != "pallas":
    backend = "auto"
  moe_config = MoEConfig(
      d_model=config.d_model, num_experts=config.num_experts, top_k=config.top_k,
      expert_hidden=config.expert_hidden, num_shared_experts=config.num_shared_experts,
      router=config.router, impl=impl, grouped_backend=backend, dtype=dtype, param_dtype=pdt,
      expert_parallel=expert_parallel)
  return MoE(moe_config, rngs=rngs)


def _make_mixer(config: ModelConfig, kind: str, rngs: nnx.Rngs, kda_class: type[KDA],
                attention_documents: str | None):
  dtype, pdt = config.compute_dtype, config.params_dtype
  if kind == "K":
    return kda_class(config.d_model, config.num_heads, config.head_dim, spec=config.kda,
               conv_size=config.conv_size, decode_implementation=config.kda_decode, fuse_gate=config.kda_fuse_gate,
               dtype=dtype, param_dtype=pdt, rngs=rngs)
  return CausalSelfAttention(config.d_model, config.num_heads, config.num_kv_heads,
                             config.head_dim, dtype=dtype, param_dtype=pdt,
                             documents=attention_documents, rngs=rngs)


def _full_pass(segments: segments_lib.Segments | None):
  """The mixer_fn of full-sequence passes: each mixer on its input, within the rows'
  documents when `segments` is given."""
  def mixer_fn(i, mixer, h):
    del i
    out, stats = mixer(h, segments)
    return out, stats, None
  return mixer_fn


def mixer_stats(i: int, kind: str, stats: dict) -> dict:
  """aux entries of layer i's mixer: `gate/<i>/mean`, `gate/<i>/min` of a KDA layer's g."""
  if kind != "K" or not stats:
    return {}
  return {f"gate/{i}/mean": stats["g_mean"], f"gate/{i}/min": stats["g_min"]}


def ffn_stats(i: int, ffn_aux: dict) -> dict:
  """aux entries of layer i's FFN: `router/<i>/<name>` for each scalar (per-expert load stays out)."""
  return {f"router/{i}/{name}": value for name, value in ffn_aux.items() if jnp.ndim(value) == 0}


class DecoderLayer(nnx.Module):
  """One layer: a token mixer and an FFN, each with its own pre-norm."""

  def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs,
               moe_impl: str | None = None, expert_parallel: ExpertParallel | None = None,
               kda_class: type[KDA] = KDA, attention_documents: str | None = None):
    pdt = config.params_dtype
    self.kind = config.layer_types[layer]
    self.mixer_norm = RMSNorm(config.d_model, param_dtype=pdt)
    self.mixer = _make_mixer(config, self.kind, rngs, kda_class, attention_documents)
    self.ffn_norm = RMSNorm(config.d_model, param_dtype=pdt)
    self.ffn = _make_ffn(config, layer, rngs, moe_impl, expert_parallel)


class HybridLM(nnx.Module):
  """Decoder-only LM. `__call__(tokens_bt) -> (logits_btv float32, aux)`.

  aux keys: `aux_loss` (sum over MoE layers, 0 without experts),
  `router/<layer>/<stat>` for every router statistic of every MoE layer, and
  `gate/<layer>/mean`, `gate/<layer>/min` of the KDA log-decay g; with
  segment ids, `segments/overflow_rows`.

  Documents in a row: `segment_ids` int [B, T] (equal nonzero ids form one
  contiguous document, 0 is padding) keep every document from seeing the
  others: each maximal run of equal ids (a padding run included) is its own
  segment for the convolutions, the KDA state and attention, and padding
  takes no expert (`k3jax.layers.segments`). `max_segments`, a static int,
  bounds the runs of any row (padding run included); None counts them from
  concrete ids (traced ids need it). A row with more runs merges its extra
  runs into the last one, and `aux["segments/overflow_rows"]` (float32)
  counts such rows. `segment_ids=None` is the plain path, unchanged.

  `moe_impl` overrides `config.moe_impl` (the MoE layers' expert path:
  "ragged", "buffered" or "dense"); None keeps the config's. `expert_parallel`
  (a `moe_path.ExpertParallel`) makes the MoE layers shard their routed
  experts over its mesh axis when run under a mesh where it is > 1; None
  runs them on each device's tokens. `kda_class` builds the KDA layers: a
  subclass of `KDA` that holds the same variables (the mesh-aware
  `k3jax.parallel.layers.ContextParallelKDA`) changes where their scan runs.
  `attention_documents` is the attention layers' `documents` path ("mask",
  "packed", or None for `CausalSelfAttention`'s default). None of the four
  changes a parameter.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, moe_impl: str | None = None,
               expert_parallel: ExpertParallel | None = None, kda_class: type[KDA] = KDA,
               attention_documents: str | None = None):
    if not isinstance(config, ModelConfig):
      raise ValueError(f"HybridLM needs a ModelConfig, got {type(config)}")
    self.config = config
    d, v, pdt = config.d_model, config.vocab_size, config.params_dtype
    self.embed = logical_param(rngs, jax.nn.initializers.normal(d ** -0.5), (v, d),
                               ("vocab", "embed"), pdt)
    self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs, moe_impl=moe_impl,
                                         expert_parallel=expert_parallel, kda_class=kda_class,
                                         attention_documents=attention_documents)
                            for i in range(config.num_layers)])
    self.residual = make_residual(config.residual, config.num_sublayers, d,
                                  block_size=config.attnres_block_size, param_dtype=pdt)
    self.final_norm = RMSNorm(d, param_dtype=pdt)
    if not config.tie_embeddings:
      self.head = logical_param(rngs, fan_in_init(d), (d, v), ("embed", "vocab"), pdt)

  # -- shared body -----------------------------------------------------------

  def _layer_modules(self):
    """The L decoder layers in order (a pipelined model builds them from its stacks)."""
    return self.layers

  def _logits(self, h_btd):
    h = self.final_norm(h_btd).astype(self.config.compute_dtype)
    w = (self.embed[...].T if self.config.tie_embeddings else self.head[...])
    return jnp.einsum("btd,dv->btv", h, w.astype(self.config.compute_dtype),
                      preferred_element_type=jnp.float32)

  def _run(self, tokens_bt, mixer_fn, *, deterministic, trace=None, project=True,
           segments=None):
    """Runs every layer; mixer_fn(layer, mixer, h) -> (out, stats, cache).

    `trace`, if a dict, collects the intermediates `HybridLM.trace` returns.
    `project=False` returns the final stream [B, T, D] instead of the logits.
    `segments` (the rows' documents) reach the FFNs here and the mixers
    through `mixer_fn` (`_full_pass`).
    """
    cfg = self.config
    if tokens_bt.ndim != 2 or not jnp.issubdtype(tokens_bt.dtype, jnp.integer):
      raise ValueError(f"tokens must be an int array [B, T], got {tokens_bt.dtype}{tokens_bt.shape}")
    x = _shard_btd(jnp.take(self.embed[...], tokens_bt, axis=0).astype(cfg.compute_dtype))
    state = self.residual.start(x)
    aux = {}
    aux_loss = jnp.zeros((), jnp.float32)
    caches = []

    def record(name, value):
      if trace is not None:
        trace.setdefault(name, []).append(value.astype(jnp.float32))
        trace["max_stored"] = max(trace.get("max_stored", 0), state.num_stored)
        trace["max_keys"] = max(trace.get("max_keys", 0), len(state.keys))

    for i, layer in enumerate(self._layer_modules()):
      stream = self.residual.read(state, 2 * i)
      record("stream", stream)
      h = layer.mixer_norm(stream)
      out, stats, cache = mixer_fn(i, layer.mixer, h)
      out = _shard_btd(out)
      record("sublayer_out", out)
      caches.append(cache)
      aux.update(mixer_stats(i, layer.kind, stats))
      state = self.residual.write(state, 2 * i, out)
      h = layer.ffn_norm(self.residual.read(state, 2 * i + 1))
      out, ffn_aux = layer.ffn(h, deterministic=deterministic, segments=segments)
      out = _shard_btd(out)
      record("sublayer_out", out)
      aux_loss = aux_loss + jnp.asarray(ffn_aux.get("aux_loss", 0.0), jnp.float32)
      aux.update(ffn_stats(i, ffn_aux))
      state = self.residual.write(state, 2 * i + 1, out)
    aux["aux_loss"] = aux_loss
    aux.update(segments_lib.overflow_aux(segments))
    final = self.residual.finish(state)
    record("stream", final)
    return (self._logits(final) if project else final), aux, caches

  # -- public entry points ---------------------------------------------------

  def __call__(self, tokens_bt: jax.Array, *, segment_ids: jax.Array | None = None,
               max_segments: int | None = None, deterministic: bool = False):
    """tokens_bt: [B, T] int -> (logits [B, T, V] float32, aux dict).

    segment_ids: [B, T] int documents of each row, or None; max_segments: the
    static bound on runs per row (see the class docstring).
    """
    segments = segments_lib.for_tokens(tokens_bt, segment_ids, max_segments)
    logits, aux, _ = self._run(tokens_bt, _full_pass(segments), deterministic=deterministic,
                               segments=segments)
    return logits, aux

  def features(self, tokens_bt: jax.Array, *, segment_ids: jax.Array | None = None,
               max_segments: int | None = None) -> jax.Array:
    """The deterministic forward up to the output head: tokens_bt [B, T] int -> final
    residual stream [B, T, D] (before the final norm); `head_logits` maps it to logits.
    `segment_ids`, `max_segments` as in `__call__`.

    With the head applied per slice of positions, long sequences never hold a
    [B, T, V] float32 array.
    """
    segments = segments_lib.for_tokens(tokens_bt, segment_ids, max_segments)
    final, _, _ = self._run(tokens_bt, _full_pass(segments), deterministic=True, project=False,
                            segments=segments)
    return final

  def head_logits(self, final_btd: jax.Array) -> jax.Array:
    """Final norm + output projection: [B, T, D] stream (from `features`) -> [B, T, V] float32."""
    return self._logits(final_btd)

  def trace(self, tokens_bt: jax.Array, *, segment_ids: jax.Array | None = None,
            max_segments: int | None = None) -> tuple[jax.Array, dict]:
    """The deterministic forward with its residual-stream intermediates.

    Args:
      tokens_bt: [B, T] int.
      segment_ids, max_segments: the rows' documents, as in `__call__`.

    Returns:
      (logits [B, T, V] float32, {"stream": L + 1 [B, T, D] float32 tensors,
      the stream each layer's mixer reads (stream[0] is the embedding) and the
      final read; "sublayer_out": 2L [B, T, D] float32 mixer / FFN outputs;
      "max_stored" / "max_keys": most [B, T, D] tensors / keys the residual
      state held at once}).
    """
    trace = {}
    segments = segments_lib.for_tokens(tokens_bt, segment_ids, max_segments)
    logits, _, _ = self._run(tokens_bt, _full_pass(segments), deterministic=True, trace=trace,
                             segments=segments)
    return logits, trace

  def prefill(self, tokens_bt: jax.Array, max_len: int, *, lengths_b: jax.Array | None = None):
    """Full pass over prompts that also builds the decoding cache.

    Args:
      tokens_bt: [B, T] int prompts, left-padded to T when `lengths_b` is given.
      max_len: total positions the cache must hold (T + new tokens).
      lengths_b: [B] int prompt lengths in [1, T] (row b's prompt is its last
        lengths_b[b] positions), or None when every row is a whole prompt. The
        padding reaches no cache entry, no expert and no prompt token, so each
        row's logits and cache are those of its prompt alone.

    Returns:
      (logits [B, T, V] float32, cache): cache is a list with one dict per
      layer (KDA: conv windows + state; attention: KV cache with `pos` and
      each row's first real slot `start`). Logits at padding are meaningless.
    """
    if tokens_bt.shape[1] > max_len:
      raise ValueError(f"prompt length {tokens_bt.shape[1]} exceeds max_len={max_len}")
    valid_bt, segments = None, None
    if lengths_b is not None:
      t = tokens_bt.shape[1]
      valid_bt = jnp.arange(t, dtype=jnp.int32)[None, :] >= t - jnp.asarray(lengths_b)[:, None]
      segments = segments_lib.Segments.of_left_padding(valid_bt)
    def mixer_fn(i, mixer, h):
      del i
      return mixer.prefill(h, max_len, valid_bt)
    logits, _, caches = self._run(tokens_bt, mixer_fn, deterministic=True, segments=segments)
    return logits, caches

  def decode(self, tokens_b1: jax.Array, cache: list, *, active_b: jax.Array | None = None):
    """One token per sequence: tokens_b1 [B, 1] -> (logits [B, 1, V] float32, cache).

    active_b: [B] bool, or None (all). Inactive rows (finished sequences whose
    outputs the caller drops) still advance their caches but take no expert, so
    they leave the active rows' routing as it would be without them.
    """
    if tokens_b1.ndim != 2 or tokens_b1.shape[1] != 1:
      raise ValueError(f"decode takes tokens [B, 1], got shape {tokens_b1.shape}")
    if len(cache) != self.config.num_layers:
      raise ValueError(f"cache has {len(cache)} layers, model has {self.config.num_layers}")
    segments = None
    if active_b is not None:
      segments = segments_lib.Segments.from_ids(jnp.asarray(active_b)[:, None].astype(jnp.int32), 1)
    def mixer_fn(i, mixer, h):
      out, new = mixer.decode(h, cache[i])
      return out, {}, new
    logits, _, caches = self._run(tokens_b1, mixer_fn, deterministic=True, segments=segments)
    return logits, caches


# -- sizes and FLOPs -----------------------------------------------------------


def _abstract_params(config: ModelConfig):
  model = nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(0)))
  return list(nnx.to_flat_state(nnx.state(model, nnx.Param)))


def _axes(var) -> tuple:
  return tuple(var.get_metadata().get("out_sharding") or ())


@functools.lru_cache(maxsize=64)
def _counts(config: ModelConfig) -> dict:
  total = embed = expert = 0
  for path, var in _abstract_params(config):
    size = math.prod(var.get_value().shape)
    total += size
    if path and path[0] in ("embed", "head"):
      embed += size
    if "expert" in _axes(var):
      expert += size
  return {"total": total, "embedding": embed, "expert": expert}


def param_count(config: ModelConfig, *, include_embeddings: bool = True) -> int:
  """Number of parameters of `HybridLM(config)` (exact, from abstract init).

  `include_embeddings=False` leaves out the token embedding and untied head.
  """
  c = _counts(config)
  return c["total"] - (0 if include_embeddings else c["embedding"])


def active_param_count(config: ModelConfig, *, include_embeddings: bool = True) -> int:
  """Parameters a token touches: routed-expert weights (logical axis "expert")
  count at top_k / num_experts; everything else in full."""
  c = _counts(config)
  active = c["total"] - c["expert"]
  if config.num_experts:
    active += c["expert"] * config.top_k // config.num_experts
  return active - (0 if include_embeddings else c["embedding"])


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward = 3x forward), for MFU.

  Forward per token:
  * 2 x active non-embedding parameters (every weight is used in one matmul),
    plus 2 D V for the output projection (also when tied);
  * attention layers: 4 H hd x seq_len / 2 (QK^T and PV over the causal
    half, as a causal flash kernel computes it);
  * KDA layers, per head, the dense chunked form with chunk C:
    2 C (3 K + 2 V) for the intra-chunk matrices and their products
    (A_kk, A_qk, M applied to k and v, A_qk V') plus 6 K V for the state
    products (W S, q S, k^T V').
  """
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}")
  d, v = config.d_model, config.vocab_size
  fwd = 2.0 * active_param_count(config, include_embeddings=False) + 2.0 * d * v
  h, hd = config.num_heads, config.head_dim
  c = min(config.kda.chunk_size, seq_len)
  for kind in config.layer_types:
    if kind == "A":
      fwd += 4.0 * h * hd * seq_len / 2
    else:
      fwd += h * (2.0 * c * (3 * hd + 2 * hd) + 6.0 * hd * hd)
  return 3.0 * fwd
