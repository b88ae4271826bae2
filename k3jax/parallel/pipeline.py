"""The GPipe schedule over the mesh's stage axis: `shard_map` + `ppermute`, scanned over ticks.

    final_mbtd, stats_sm = gpipe(stage_fn, stacked, shared, x_mbtd, start=..., mesh=mesh)

Stage s holds block s of every leaf of `stacked` (leading dim S, sharded over
`stage`; the block keeps a leading dim of 1). At tick t = 0 .. M + S - 2 every
stage runs `stage_fn` once: stage 0 on microbatch t (while t < M), stage s > 0
on what stage s - 1 sent at tick t - 1. The boundary buffers then move one
stage on with one `ppermute`, so microbatch m leaves the last stage at tick
m + S - 1. A stage idles (runs on
zeros, its results masked) for S - 1 of the M + S - 1 ticks: the bubble
fraction (S - 1) / (M + S - 1).

The backward is JAX's transpose of the same program: every forward tick, then
every backward tick in reverse with the permutation reversed (GPipe; each
stage keeps its M microbatches' residuals). Only the `stage` axis is manual
inside the `shard_map`; the data, fsdp, expert and context axes stay with the
compiler (and the layers' own `shard_map`s), so the pipeline composes with them.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from k3jax.sharding import mesh as mesh_lib

# stage_fn(stage_block, shared, buf_in, x_btd, stage, side) -> (buf_out, final_btd, stats)
StageFn = Callable[[Any, Any, jax.Array, jax.Array, jax.Array, Any],
                   tuple[jax.Array, jax.Array, dict[str, jax.Array]]]


def gpipe(stage_fn: StageFn, stacked: Any, shared: Any, x_mbtd: jax.Array, *,
          start: Callable[[jax.Array], jax.Array], mesh: Mesh,
          axis: str = mesh_lib.STAGE, side_m: Any = None) -> tuple[jax.Array, jax.Array]:
  """Runs `stage_fn` over S stages and M microbatches on the GPipe schedule.

  Args:
    stage_fn: one stage's work on one microbatch: (its block of `stacked`,
      every leaf with a leading dim of 1,
      `shared`, the received boundary buffer, the microbatch's input (stage 0
      uses it), the stage index (traced), the microbatch's slice of `side_m`)
      -> (the buffer for the next stage,
      the stage's final output [mb, T, D], a dict of float32 scalars: the
      stage's statistics of that microbatch).
    stacked: pytree whose leaves have a leading dim S (one slice per stage).
    shared: pytree every stage reads whole (replicated over stages).
    x_mbtd: [M, mb, T, D] microbatched inputs of the first stage.
    start: [mb, T, D] -> the boundary buffer stage 0 starts from; gives the
      buffer's shape.
    mesh: the mesh (or abstract mesh) with the stage axis.
    axis: the stage axis name.
    side_m: None, or a pytree of [M, ...] leaves every stage reads per
      microbatch (such as the documents of its rows): the stage working on
      microbatch m gets slice m (on an idle tick, a clipped index).

  Returns:
    (final outputs of the last stage [M, mb, T, D], replicated over the
    stages; `stage_fn`'s statistics, each [S, M]: stage s's of microbatch m).
  """
  n_stages = mesh_lib.axis_size(mesh, axis)
  n_micro = x_mbtd.shape[0]
  for leaf in jax.tree.leaves(stacked):
    if leaf.shape[:1] != (n_stages,):
      raise ValueError(f"stacked leaves need a leading dim of {n_stages} stages, got "
                       f"{leaf.shape}")
  buf_shape = jax.eval_shape(start, jax.ShapeDtypeStruct(x_mbtd.shape[1:], x_mbtd.dtype))
  forward = [(s, s + 1) for s in range(n_stages - 1)]

  def per_stage(stacked_local, shared, x_mbtd, side_m):
    stage = lax.axis_index(axis)
    last = stage == n_stages - 1

    def tick(carry, t):
      recv, outs_mbtd = carry
      x_btd = lax.dynamic_index_in_dim(x_mbtd, jnp.minimum(t, n_micro - 1), 0, keepdims=False)
      buf_in = jnp.where(stage == 0, start(x_btd), recv)
      # This stage works on microbatch t - stage at tick t.
      m_here = jnp.clip(t - stage, 0, n_micro - 1)
      side = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, m_here, 0, keepdims=False),
                          side_m)
      buf_out, final_btd, stats_t = stage_fn(stacked_local, shared, buf_in, x_btd, stage, side)
      m_out = jnp.clip(t - (n_stages - 1), 0, n_micro - 1)
      kept = lax.dynamic_index_in_dim(outs_mbtd, m_out, 0, keepdims=False)
      done = last & (t >= n_stages - 1)
      outs_mbtd = lax.dynamic_update_index_in_dim(
          outs_mbtd, jnp.where(done, final_btd.astype(outs_mbtd.dtype), kept), m_out, 0)
      recv = lax.ppermute(buf_out, axis, forward)
      return (recv, outs_mbtd), jax.tree.map(lambda x: x.astype(jnp.float32), stats_t)

    init = (jnp.zeros(buf_shape.shape, buf_shape.dtype), jnp.zeros_like(x_mbtd))
    (_, outs_mbtd), stats_t = lax.scan(tick, init, jnp.arange(n_micro + n_stages - 1))
    # This stage worked on microbatch m at tick m + stage; the other ticks ran on zeros.
    stats_m = jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, stage, n_micro, 0), stats_t)
    # The outputs live on the last stage; the sum hands them to every stage. It adds
    # zeros to one stage's values, so float32 is exact (and XLA's CPU compiler fails on
    # a bfloat16 all-reduce here).
    kept = jnp.where(last, outs_mbtd, jnp.zeros_like(outs_mbtd)).astype(jnp.float32)
    outs_mbtd = lax.psum(kept, axis).astype(x_mbtd.dtype)
    return outs_mbtd, jax.tree.map(lambda rec: rec[None], stats_m)

  # check_vma=False: the layers' own scans (KDA's chunk loop) start from carries that do
  # not vary over the stage axis and return ones that do, which the varying-axes check
  # refuses; the replicated inputs' gradients are summed over the stages either way.
  return jax.shard_map(per_stage, mesh=mesh, in_specs=(P(axis), P(), P(), P()),
                       out_specs=(P(), P(axis)), axis_names={axis},
                       check_vma=False)(stacked, shared, x_mbtd, side_m)
