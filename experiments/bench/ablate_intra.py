"""Times the intra-chunk forward kernel with parts of its body replaced.

Each variant swaps one or more pieces of `kernel_intra_fwd`'s blocked body
for a cheap stand-in of the same shapes, so the time it saves against
`full` is what that piece costs. The outputs of the stand-ins are wrong on
purpose: this is a profiling target, never a result. Variants:

  full          the kernel as configured;
  inv_cheap     M = I - A_kk (no inverse products);
  scores_cheap  one plain q k^T / k k^T product per K slice (no decay factors);
  wu_none       W, U and the gated outputs written from a cheap fill;
  only_scores   inv_cheap + wu_none;
  nothing       all three: roughly the kernel's loads and stores.

A variant may carry KernelConfig overrides after "@", joined by "+", e.g.
`full@block_k=32`. On the GPU machine, from the repository root:

  python experiments/bench/ablate_intra.py --variants=full,inv_cheap,scores_cheap,wu_none
  ncu -k regex:kda_intra --metrics gpu__time_duration.sum,launch__registers_per_thread \\
      python experiments/bench/ablate_intra.py --variants=full,full@block_k=32

Each variant runs --calls + 1 times (the first compiles); the printed time
is per call, calls dispatched back to back (`bench.pipelined_ms`).
"""
from __future__ import annotations

import dataclasses
import os
import sys

from absl import app
from absl import flags

# Run from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_SHAPE = flags.DEFINE_string("shape", "16x2048x16x128", "BxTxHxD (K = V = D).")
_VARIANTS = flags.DEFINE_list("variants", ["full", "inv_cheap", "scores_cheap", "wu_none"],
                              "Variants to time, in order (see the module docstring).")
_CALLS = flags.DEFINE_integer("calls", 5, "Timed calls per variant.")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Emulate the kernels (CPU smoke run of "
                               "the blocked body at a tiny shape).")


def _stand_ins(kf):
  """The cheap replacements, keyed by the `kernel_intra_fwd` name they replace."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def inverse(a_cc, ell, cfg, dtype=None):
    del ell, cfg, dtype
    c = a_cc.shape[0]
    return (kf.iota((c, c), 0) == kf.iota((c, c), 1)).astype(jnp.float32) - a_cc

  def slice_scores(p_qk, p_kk, q_ref, k_ref, g_ref, beta_ref, ks, *, scale, ell, diagonal,
                   cfg):
    del g_ref, beta_ref, scale, ell, diagonal
    k = k_ref[:, ks]
    return (p_qk + kf.dot(q_ref[:, ks], k, cfg, tb=True),
            p_kk + kf.dot(k, k, cfg, tb=True))

  def write_w_u(m, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, cfg, gated=None):
    del k_ref, v_ref, g_ref, beta_ref, cfg
    fill = jnp.sum(m, axis=1, keepdims=True) * jnp.ones(w_ref.shape, jnp.float32)
    w_ref[...] = fill.astype(w_ref.dtype)
    u_ref[...] = jnp.zeros(u_ref.shape, u_ref.dtype)
    if gated is not None:
      for ref in gated[2:]:
        ref[...] = jnp.zeros(ref.shape, ref.dtype)

  inv = {"recursive_unit_lower_inverse": inverse}
  scores = {"_blocked_slice_scores": slice_scores}
  wu = {"write_w_u": write_w_u}
  return {"full": {}, "inv_cheap": inv, "scores_cheap": scores, "wu_none": wu,
          "only_scores": {**inv, **wu}, "nothing": {**inv, **wu, **scores}}


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tools import bench  # pylint: disable=g-import-not-at-top
  from pallas_kernels.kda import kernel_config  # pylint: disable=g-import-not-at-top
  from pallas_kernels.kda import kernel_intra_fwd as kf  # pylint: disable=g-import-not-at-top

  b, t, h, d = (int(x) for x in _SHAPE.value.split("x"))
  if _INTERPRET.value:
    b, t, h = 1, 128, 2
  c, ell = 64, 16
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  dt = jnp.bfloat16
  q = (jax.random.normal(keys[0], (b, t, h * d)) / d ** 0.5).astype(dt)
  k = (jax.random.normal(keys[1], (b, t, h * d)) / d ** 0.5).astype(dt)
  v = jax.random.normal(keys[2], (b, t, h * d)).astype(dt)
  g = -5.0 * jax.nn.sigmoid(jax.random.normal(keys[3], (b, t // c, c, h * d)))
  g_cum = jnp.cumsum(g, axis=2).reshape(b, t, h * d)
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, h, t, 1)))
  base = kernel_config.make_config(backend="interpret" if _INTERPRET.value else "triton",
                                   dtype=dt, head_k=d, head_v=d, chunk_size=c, sub_chunk=ell,
                                   state_programs=b * h,
                                   overrides=dict(inverse="blocked"))
  stand_ins = _stand_ins(kf)
  for spec in _VARIANTS.value:
    name, _, ov = spec.partition("@")
    if name not in stand_ins:
      raise app.UsageError(f"unknown variant {name!r}; variants are {sorted(stand_ins)}")
    cfg = dataclasses.replace(base, **bench.parse_overrides(ov.split("+"))) if ov else base
    saved = {attr: getattr(kf, attr) for attr in stand_ins[name]}
    try:
      for attr, fn in stand_ins[name].items():
        setattr(kf, attr, fn)
      run = jax.jit(lambda *xs, cfg=cfg: kf.intra_fwd(
          *xs, heads=h, chunk_size=c, sub_chunk=ell, diagonal="dense", scale=d ** -0.5,
          cfg=cfg, save_gated=True))
      ms = bench.pipelined_ms(run, q, k, v, g_cum, beta, iters=_CALLS.value, rounds=1,
                              warmup=1)
    finally:
      for attr, fn in saved.items():
        setattr(kf, attr, fn)
    print(f"{spec}: {ms:.3f} ms", flush=True)


if __name__ == "__main__":
  app.run(main)
