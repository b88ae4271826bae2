r"""Prints the error of chunked KDA against the naive recurrence.

    python experiments/bench/kda_reference_check.py
    python experiments/bench/kda_reference_check.py --seq_lens=1,65,1000 --implementation=pallas

Inputs are fresh random: unit-norm q/k, gates g = g_min * sigmoid(N(0, 1)),
beta = sigmoid(N(0, 1)), a random initial state.
"""
from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda import api
from pallas_kernels.kda import reference

_SEQ_LENS = flags.DEFINE_list("seq_lens", ["1", "63", "64", "65", "200", "1000"], "Lengths T.")
_BATCH = flags.DEFINE_integer("batch", 2, "B.")
_HEADS = flags.DEFINE_integer("heads", 2, "H.")
_DIM = flags.DEFINE_integer("dim", 32, "K = V.")
_G_MIN = flags.DEFINE_float("g_min", -5.0, "Gate lower bound.")
_CHUNK = flags.DEFINE_integer("chunk_size", 64, "Chunk length C.")
_SUB = flags.DEFINE_integer("sub_chunk", 16, "Diagonal tile length L.")
_IMPL = flags.DEFINE_enum("implementation", "xla", ["xla", "pallas"], "Chunked implementation.")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed.")


def _inputs(key, t_len):
  b, h, d = _BATCH.value, _HEADS.value, _DIM.value
  ks = jax.random.split(key, 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, t_len, h, d)))
  k = unit(jax.random.normal(ks[1], (b, t_len, h, d)))
  v = jax.random.normal(ks[2], (b, t_len, h, d))
  g = _G_MIN.value * jax.nn.sigmoid(jax.random.normal(ks[3], (b, t_len, h, d)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t_len, h)))
  h0 = jax.random.normal(ks[5], (b, h, d, d))
  return (q, k, v, g, beta), h0


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b), np.max(np.abs(a - b)) / np.max(np.abs(b))


def main(argv):
  del argv
  print(f"backend={jax.default_backend()} B={_BATCH.value} H={_HEADS.value} "
        f"K=V={_DIM.value} g_min={_G_MIN.value} C={_CHUNK.value} L={_SUB.value} "
        f"implementation={_IMPL.value}")
  print(f"{'T':>6} {'diagonal':>9} {'o relL2':>10} {'o max rel':>10} {'state relL2':>12}")
  naive = jax.jit(reference.naive_recurrent_kda, static_argnames=("output_final_state",))
  for i, t_str in enumerate(_SEQ_LENS.value):
    args, h0 = _inputs(jax.random.key(_SEED.value + i), int(t_str))
    o_ref, s_ref = naive(*args, initial_state=h0, output_final_state=True)
    for diagonal in ("dense", "pairwise"):
      o, s = api.chunk_kda(*args, initial_state=h0, output_final_state=True,
                           chunk_size=_CHUNK.value, sub_chunk=_SUB.value,
                           lower_bound=_G_MIN.value, diagonal=diagonal,
                           implementation=_IMPL.value,
                           interpret=_IMPL.value == "pallas" and jax.default_backend() == "cpu")
      o_l2, o_max = _rel(o, o_ref)
      s_l2, _ = _rel(s, s_ref)
      print(f"{t_str:>6} {diagonal:>9} {o_l2:10.2e} {o_max:10.2e} {s_l2:12.2e}")


if __name__ == "__main__":
  app.run(main)
