"""Residual strategies behind one interface: prenorm, block and full AttnRes.

The model drives every strategy the same way, so it never branches on which
one is configured:

    state = residual.start(embedding_btd)
    for l, sublayer in enumerate(sublayers):
      out = sublayer(norm_l(residual.read(state, l)))
      state = residual.write(state, l, out)
    h = residual.finish(state)

Strategies (docs/design.md, "Block attention residuals"):
* `prenorm`: h_{l+1} = h_l + out_l; the stored state is the running sum.
* `full_attnres`: sublayer l reads softmax_i(w_l . rms(v_i)) v_i over the
  embedding and all earlier sublayer outputs v_i; O(L d) stored per token.
* `block_attnres`: sublayers are grouped into blocks of `block_size`; outputs
  are summed inside a block, and a sublayer reads a softmax mixture over the
  completed block summaries (the embedding is block 0) plus the current
  partial summary; O(N d) stored per token for N blocks.

Pseudo-queries are zero-initialised, so every read starts as the uniform
average of its sources. Sublayer 0 always has exactly one source (the
embedding) and therefore has no query; the final read (`finish`) has one.
Source keys use a parameter-free RMS norm: a learned key scale would only
rescale the query elementwise.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.norms import rms_norm
from k3jax.layers.params import logical_param

STRATEGIES = ("prenorm", "block_attnres", "full_attnres")


@dataclasses.dataclass
class ResidualState:
  """What a strategy keeps between sublayers of one forward pass.

  Attributes:
    sources: stored [B, T, D] tensors (prenorm: the running sum only;
      full AttnRes: embedding + every output; block AttnRes: embedding +
      completed block summaries).
    keys: AttnRes only, rms(source) float32 for each stored source, so that
      every source is normalised once, not once per reader.
    partial: block AttnRes only, the running sum of the current block, or
      None at a block boundary.
  """
  sources: list
  keys: list = dataclasses.field(default_factory=list)
  partial: jax.Array | None = None

  @property
  def num_stored(self) -> int:
    """Number of [B, T, D] tensors currently held (keys not counted)."""
    return len(self.sources) + (self.partial is not None)


def _key(v_btd: jax.Array) -> jax.Array:
  return rms_norm(v_btd.astype(jnp.float32))


def mix_sources(query_d: jax.Array, sources: list, keys: list | None = None) -> jax.Array:
  """softmax_i(query . rms(v_i)) weighted sum of the sources.

  Args:
    query_d: [D] pseudo-query.
    sources: list of n tensors v_i [B, T, D] (n >= 1).
    keys: optional precomputed rms(v_i) float32, one per source.

  Returns:
    [B, T, D] mixture in the sources' dtype (weights and sum in float32).
  """
  if keys is None:
    keys = [_key(v) for v in sources]
  q = query_d.astype(jnp.float32)
  # Elementwise products + reductions rather than tiny dot_generals: same
  # math, and far fewer kernels for XLA to compile on CPU.
  logits_nbt = jnp.stack([jnp.sum(q * k, axis=-1) for k in keys])
  w_nbt = jax.nn.softmax(logits_nbt, axis=0)
  out = sum(w_nbt[i][..., None] * v.astype(jnp.float32) for i, v in enumerate(sources))
  return out.astype(sources[0].dtype)


class PreNormResidual(nnx.Module):
  """Standard pre-norm residual: the running sum of all outputs."""

  def __init__(self, num_sublayers: int, d_model: int, **unused):
    del unused
    self.num_sublayers = num_sublayers
    self.d_model = d_model

  def start(self, x_btd: jax.Array) -> ResidualState:
    return ResidualState(sources=[x_btd])

  def read(self, state: ResidualState, layer: int) -> jax.Array:
    del layer
    return state.sources[0]

  def write(self, state: ResidualState, layer: int, out_btd: jax.Array) -> ResidualState:
    del layer
    return ResidualState(sources=[state.sources[0] + out_btd.astype(state.sources[0].dtype)])

  def finish(self, state: ResidualState) -> jax.Array:
    return state.sources[0]


class _AttnResBase(nnx.Module):
  """Holds the zero-initialised pseudo-queries, one per reader.

  Reader r = l - 1 serves sublayer l >= 1; reader L - 1 serves `finish`.
  """

  def __init__(self, num_sublayers: int, d_model: int, *, param_dtype=jnp.float32, **unused):
    del unused
    if num_sublayers < 1:
      raise ValueError(f"num_sublayers must be >= 1, got {num_sublayers}")
    self.num_sublayers = num_sublayers
    self.d_model = d_model
    self.queries = logical_param(None, jax.nn.initializers.zeros, (num_sublayers, d_model),
                                 (None, "embed"), param_dtype)

  def _mix(self, reader: int, sources: list, keys: list) -> jax.Array:
    if len(sources) == 1:
      return sources[0]
    return mix_sources(self.queries[reader], sources, keys)

  def start(self, x_btd: jax.Array) -> ResidualState:
    return ResidualState(sources=[x_btd], keys=[_key(x_btd)])


class FullAttnResResidual(_AttnResBase):
  """Every sublayer attends over the embedding and all earlier outputs."""

  def read(self, state: ResidualState, layer: int) -> jax.Array:
    return self._mix(layer - 1, state.sources, state.keys)

  def write(self, state: ResidualState, layer: int, out_btd: jax.Array) -> ResidualState:
    del layer
    out = out_btd.astype(state.sources[0].dtype)
    return ResidualState(sources=state.sources + [out], keys=state.keys + [_key(out)])

  def finish(self, state: ResidualState) -> jax.Array:
    return self._mix(self.num_sublayers - 1, state.sources, state.keys)


class BlockAttnResResidual(_AttnResBase):
  """Sublayers attend over block summaries plus the current partial block.

  Args:
    block_size: sublayers per block (S); with S = 1 this is full AttnRes.
  """

  def __init__(self, num_sublayers: int, d_model: int, *, block_size: int,
               param_dtype=jnp.float32, **unused):
    super().__init__(num_sublayers, d_model, param_dtype=param_dtype, **unused)
    if block_size < 1:
      raise ValueError(f"block_size must be >= 1, got {block_size}")
    self.block_size = block_size

  def _current(self, state: ResidualState) -> tuple[list, list]:
    if state.partial is None:
      return state.sources, state.keys
    return state.sources + [state.partial], state.keys + [_key(state.partial)]

  def read(self, state: ResidualState, layer: int) -> jax.Array:
    return self._mix(layer - 1, *self._current(state))

  def write(self, state: ResidualState, layer: int, out_btd: jax.Array) -> ResidualState:
    out = out_btd.astype(state.sources[0].dtype)
    partial = out if state.partial is None else state.partial + out
    if (layer + 1) % self.block_size == 0:  # block complete: store its summary
      return ResidualState(sources=state.sources + [partial], keys=state.keys + [_key(partial)])
    return ResidualState(sources=state.sources, keys=state.keys, partial=partial)

  def finish(self, state: ResidualState) -> jax.Array:
    return self._mix(self.num_sublayers - 1, *self._current(state))


def make_residual(kind: str, num_sublayers: int, d_model: int, *, block_size: int = 1,
                  param_dtype=jnp.float32):
  """Builds the residual strategy `kind` (one of STRATEGIES)."""
  if kind == "prenorm":
    return PreNormResidual(num_sublayers, d_model)
  if kind == "full_attnres":
    return FullAttnResResidual(num_sublayers, d_model, param_dtype=param_dtype)
  if kind == "block_attnres":
    return BlockAttnResResidual(num_sublayers, d_model, block_size=block_size,
                                param_dtype=param_dtype)
  raise ValueError(f"unknown residual strategy {kind!r}; allowed: {STRATEGIES}")
