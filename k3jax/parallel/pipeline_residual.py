"""The residual stream inside one pipeline stage, and the tensors that cross to the next.

A stage boundary carries a fixed-shape buffer `buf_nbtd` [N, mb, T, D]
(N = `PipelineLayout.boundary_slots`), because every stage runs one program:

* pre-norm: N = 1, the running sum;
* block / full AttnRes: slot 0 is the embedding and slot i the i-th completed
  block summary (a sublayer output for full AttnRes, whose blocks are one
  sublayer). Stage s receives 1 + s * blocks_per_stage filled slots; the rest
  are zeros, masked out of every read. Boundaries fall on block boundaries
  (checked by the layout), so no partial block sum ever crosses.

The source keys (rms of each source) are recomputed on arrival instead of sent.
Reads equal `k3jax.layers.residual`'s: masked logits get weight exactly 0, and
a read with one valid source returns that source exactly, as the one-device
model does for sublayer 0, which has no query.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from k3jax.layers.norms import rms_norm

# Logit of an empty slot: exp underflows to exactly 0 in float32.
_MASKED = -1e30


def _key(v_btd: jax.Array) -> jax.Array:
  return rms_norm(v_btd.astype(jnp.float32))


@dataclasses.dataclass
class StageStream:
  """What one stage holds between its sublayers.

  Attributes:
    sources_nbtd: [N + blocks_per_stage, mb, T, D] (AttnRes; zeros from `count` on),
      or [1, mb, T, D], the running sum (pre-norm).
    keys_nbtd: float32 rms of each source (AttnRes only).
    count: int32 [] filled source slots (AttnRes only; traced: it depends on the stage).
    partial: the current block's running sum [mb, T, D], or None at a block boundary.
  """
  sources_nbtd: jax.Array
  keys_nbtd: jax.Array | None = None
  count: jax.Array | None = None
  partial: jax.Array | None = None


class StageResidual:
  """The residual strategy of `config.residual`, run on one stage's sublayers.

  Args:
    kind: "prenorm", "block_attnres" or "full_attnres".
    block_size: sublayers per block (ignored for full AttnRes, whose blocks are one sublayer).
    slots: N, the buffer's slots at a boundary.
    blocks_per_stage: blocks each stage completes.
  """

  def __init__(self, kind: str, *, block_size: int, slots: int, blocks_per_stage: int):
    self.kind = kind
    self.block_size = 1 if kind == "full_attnres" else block_size
    self.slots = slots
    self.blocks_per_stage = blocks_per_stage

  @property
  def mixes(self) -> bool:
    return self.kind != "prenorm"

  def start(self, x_btd: jax.Array) -> jax.Array:
    """The buffer stage 0 receives: [N, mb, T, D] with the embedding in slot 0."""
    buf = jnp.zeros((self.slots, *x_btd.shape), x_btd.dtype)
    return buf.at[0].set(x_btd)

  def enter(self, buf_nbtd: jax.Array, stage: jax.Array) -> StageStream:
    """The stream at the start of `stage` (traced index) from its received buffer."""
    if not self.mixes:
      return StageStream(sources_nbtd=buf_nbtd)
    pad = jnp.zeros((self.blocks_per_stage, *buf_nbtd.shape[1:]), buf_nbtd.dtype)
    sources = jnp.concatenate([buf_nbtd, pad])
    return StageStream(sources_nbtd=sources, keys_nbtd=_key(sources),
                       count=1 + stage * self.blocks_per_stage)

  def read(self, stream: StageStream, query_d: jax.Array | None) -> jax.Array:
    """A sublayer's input [mb, T, D]; `query_d` [D] is that sublayer's query."""
    if not self.mixes:
      return stream.sources_nbtd[0]
    sources, keys = stream.sources_nbtd, stream.keys_nbtd
    valid_n = jnp.arange(sources.shape[0]) < stream.count
    if stream.partial is not None:
      sources = jnp.concatenate([sources, stream.partial[None]])
      keys = jnp.concatenate([keys, _key(stream.partial)[None]])
      valid_n = jnp.concatenate([valid_n, jnp.ones((1,), bool)])
    logits_nbt = jnp.sum(query_d.astype(jnp.float32) * keys, axis=-1)
    logits_nbt = jnp.where(valid_n[:, None, None], logits_nbt, _MASKED)
    w_nbt = jax.nn.softmax(logits_nbt, axis=0)
    out = jnp.sum(w_nbt[..., None] * sources.astype(jnp.float32), axis=0)
    return out.astype(sources.dtype)

  def write(self, stream: StageStream, local: int, out_btd: jax.Array) -> StageStream:
    """`stream` after the stage's sublayer `local` returned `out_btd` [mb, T, D]."""
    out = out_btd.astype(stream.sources_nbtd.dtype)
    if not self.mixes:
      return StageStream(sources_nbtd=(stream.sources_nbtd[0] + out)[None])
    partial = out if stream.partial is None else stream.partial + out
    if (local + 1) % self.block_size:
      return dataclasses.replace(stream, partial=partial)
    # Block complete: its summary fills the next empty slot.
    return StageStream(
        sources_nbtd=lax.dynamic_update_index_in_dim(stream.sources_nbtd, partial, stream.count, 0),
        keys_nbtd=lax.dynamic_update_index_in_dim(stream.keys_nbtd, _key(partial), stream.count, 0),
        count=stream.count + 1)

  def leave(self, stream: StageStream) -> jax.Array:
    """The buffer sent to the next stage: [N, mb, T, D]."""
    return stream.sources_nbtd[:self.slots]

  def finish(self, stream: StageStream, query_d: jax.Array | None) -> jax.Array:
    """The final read (the last stage's output before the head), [mb, T, D]."""
    return self.read(stream, query_d)
