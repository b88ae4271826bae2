"""Residual strategies: prenorm, block AttnRes, full AttnRes (k3jax.layers.residual)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.layers import residual as res

B, T, D = 2, 3, 8


def _outputs(num, seed=0):
  """Embedding and `num` sublayer outputs, float32 numpy (no eager JAX ops)."""
  rng = np.random.default_rng(seed)
  emb = rng.standard_normal((B, T, D)).astype(np.float32)
  return emb, [(rng.standard_normal((B, T, D)) * (1 + i)).astype(np.float32) for i in range(num)]


def _drive(strategy, emb, outs):
  """Runs the read/write protocol with fixed outputs (jitted); returns
  (reads, final, number of stored tensors at the end)."""
  stored = []

  @jax.jit
  def run(emb, outs):
    state = strategy.start(emb)
    reads = []
    for l, out in enumerate(outs):
      reads.append(strategy.read(state, l))
      state = strategy.write(state, l, out)
    stored.append(state.num_stored)
    return reads, strategy.finish(state)

  reads, final = run(emb, outs)
  return reads, final, stored[-1]


def _set_queries(strategy, seed):
  q = np.random.default_rng(seed).standard_normal(strategy.queries.shape).astype(np.float32)
  strategy.queries[...] = q
  return q.astype(np.float64)


def _mix_ref(query, sources):
  """float64 numpy softmax_i(query . rms(v_i)) v_i."""
  v = np.stack([np.asarray(s, np.float64) for s in sources])
  keys = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + 1e-6)
  logits = np.einsum("d,nbtd->nbt", query, keys)
  w = np.exp(logits - logits.max(0))
  w /= w.sum(0)
  return np.einsum("nbt,nbtd->btd", w, v)


def test_mix_sources_matches_float64_reference():
  emb, outs = _outputs(4, seed=1)
  q = np.random.default_rng(2).standard_normal(D)
  got = jax.jit(res.mix_sources)(q.astype(np.float32), [emb] + outs)
  chex.assert_shape(got, (B, T, D))
  np.testing.assert_allclose(got, _mix_ref(q, [emb] + outs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["full_attnres", "block_attnres"])
def test_zero_init_queries_give_uniform_average(kind):
  num = 6
  emb, outs = _outputs(num)
  strategy = res.make_residual(kind, num, D, block_size=2)
  np.testing.assert_array_equal(np.asarray(strategy.queries[...]), 0.0)
  reads, final, _ = _drive(strategy, emb, outs)
  np.testing.assert_allclose(reads[0], emb, rtol=0, atol=0)  # one source: read as is
  for l in range(1, num + 1):
    if kind == "full_attnres":
      sources = [emb] + outs[:l]
    else:  # completed blocks of 2, then the partial block
      done = l // 2
      sources = [emb] + [outs[2 * j] + outs[2 * j + 1] for j in range(done)]
      if l % 2:
        sources.append(outs[l - 1])
    want = np.mean(np.stack([np.asarray(s) for s in sources]), axis=0)
    got = reads[l] if l < num else final
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"reader {l}")


def test_block_size_one_equals_full_attnres():
  num = 5
  emb, outs = _outputs(num, seed=3)
  full = res.make_residual("full_attnres", num, D)
  block = res.make_residual("block_attnres", num, D, block_size=1)
  q = _set_queries(full, seed=4)
  block.queries[...] = q.astype(np.float32)
  reads_f, final_f, _ = _drive(full, emb, outs)
  reads_b, final_b, _ = _drive(block, emb, outs)
  for a, b in zip(reads_f + [final_f], reads_b + [final_b]):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  # And both match the float64 reference with non-zero queries.
  np.testing.assert_allclose(final_f, _mix_ref(q[num - 1], [emb] + outs), rtol=1e-5, atol=1e-5)


def test_block_reads_match_reference_with_random_queries():
  num, size = 7, 3
  emb, outs = _outputs(num, seed=5)
  block = res.make_residual("block_attnres", num, D, block_size=size)
  q = _set_queries(block, seed=6)
  reads, final, _ = _drive(block, emb, outs)
  for l in range(1, num + 1):
    done = l // size
    sources = [emb] + [sum(outs[size * j:size * (j + 1)]) for j in range(done)]
    if l % size:
      sources.append(sum(outs[size * done:l]))
    got = reads[l] if l < num else final
    np.testing.assert_allclose(got, _mix_ref(q[l - 1], sources), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num,size", [(8, 4), (8, 3)])
def test_block_stores_n_plus_one_summaries(num, size):
  emb, outs = _outputs(num)
  block = res.make_residual("block_attnres", num, D, block_size=size)
  most = []

  def run(emb, outs):
    state = block.start(emb)
    for l, out in enumerate(outs):
      block.read(state, l)
      state = block.write(state, l, out)
      most.append(state.num_stored)
    return block.finish(state)

  jax.eval_shape(run, emb, outs)  # bookkeeping only; nothing to compute
  n_blocks = -(-num // size)
  assert max(most) == n_blocks + 1 < num + 1
  full = res.make_residual("full_attnres", num, D)
  assert _drive(full, emb, outs)[2] == num + 1


def test_prenorm_is_running_sum():
  num = 4
  emb, outs = _outputs(num)
  pre = res.make_residual("prenorm", num, D)
  reads, final, stored = _drive(pre, emb, outs)
  for l in range(num):
    np.testing.assert_allclose(reads[l], emb + sum(outs[:l]) if l else emb, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(final, emb + sum(outs), rtol=1e-6, atol=1e-6)
  assert stored == 1


@pytest.mark.parametrize("kind,size", [("full_attnres", 1), ("block_attnres", 2)])
def test_gradients_reach_every_pseudo_query(kind, size):
  """Through a stack of nonlinear sublayers, every query (zero-init) gets a gradient."""
  num = 5
  strategy = res.make_residual(kind, num, D, block_size=size)
  emb, _ = _outputs(0)
  mats = (np.random.default_rng(7).standard_normal((num, D, D)) / np.sqrt(D)).astype(np.float32)

  def loss(module):
    state = module.start(emb)
    for l in range(num):
      out = jnp.tanh(module.read(state, l) @ mats[l])
      state = module.write(state, l, out)
    return jnp.sum(module.finish(state) ** 2)

  grads = nnx.jit(nnx.grad(loss))(strategy)
  norms = np.linalg.norm(np.asarray(grads["queries"][...]), axis=-1)
  assert np.all(norms > 1e-6), norms


def test_unknown_strategy_and_bad_block_size():
  with pytest.raises(ValueError, match="unknown residual strategy"):
    res.make_residual("postnorm", 4, D)
  with pytest.raises(ValueError, match="block_size"):
    res.make_residual("block_attnres", 4, D, block_size=0)
