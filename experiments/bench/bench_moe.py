"""MoE layer benchmark: the layer against a dense SwiGLU of equal active width,
and where the layer's time goes.

    PYTHONPATH=. python experiments/bench/bench_moe.py                       # three shapes, GPU
    PYTHONPATH=. python experiments/bench/bench_moe.py --shapes=gpu_1b --impls=buffered,ragged:tokamax
    PYTHONPATH=. python experiments/bench/bench_moe.py --shapes=smoke --iters=2 --rounds=1 \
        --rate_matmul=256                                              # CPU smoke
    PYTHONPATH=. python experiments/bench/bench_moe.py ... --json=/tmp/moe.json       # rows as JSON too

Shapes (B, T, d, experts, top-k, expert hidden; one shared expert of the
expert hidden width): gpu_1b 16,2048,1536,16,2,768; gpu_150m
32,2048,768,8,2,512; fine 16,2048,1536,256,8,256 (a K3-like fine-grained
layer). The dense SwiGLU has hidden width (top_k + shared) * expert hidden.

Table 1 ("layer"): forward and forward+backward ms of each `--impls` entry
(`impl` or `impl:grouped_backend`) and of the dense SwiGLU, the ratio to the
dense one, and the layer's roofline floor (its matmul FLOPs, capacity
padding included, over the bf16 matmul rate measured in the same run).
Table 3 ("grouped matmuls", --kernels): the Pallas grouped matmuls
(`pallas_kernels.gmm`) alone on the layer's routed plan (dropless, tiles
aligned to block_m): the forward gate/up product with its rows gathered, the
dgrad product (transposed weights) and the weight gradient, each against a
dense bf16 matmul of the same [N k, K] x [K, N] shape in the same run; rates
count only real rows (padding excluded); `--gmm_mosaic` adds the gathered
forward on the Mosaic GPU body. `--gmm_config` sets the tiles of
table 3 and of every "pallas" row of table 1 (e.g. block_n=128,num_warps=8).
On the GPU, table 3 also times a peer (`--peer_mgpu`): jax's Mosaic GPU
`ragged_dot` and `transposed_ragged_dot` (TMA and wgmma, Hopper only) on
the same FLOPs with the rows already gathered and contiguous, the fastest
of a few tile choices, to show what the Triton lowering leaves on the table.
Table 4 ("device kernels", --profile): every device kernel of one
forward+backward of the dense SwiGLU and of each `--impls` entry, from a
profiler trace of `--iters` calls (`pallas_kernels.tools.device_profile`):
ms per call, launches and share of the path's device time; empty off the GPU.
Table 2 ("parts", --parts): the router's pieces (scores, the quantile
thresholds of each `quantile_impl`, the candidates' top-k), the whole
router in capacity and dropless mode with exact and radix thresholds, the
dropless slot plan aligned to the kernels' tile and its tile map, then the
buffered layer's parts: router, the capacity pass alone (both position
methods, `capacity.assign_with_capacity(positions=...)`), slot plan,
dispatch gather, grouped expert matmuls, combine, the dropless routed
experts through the "pallas" kernels, and the shared expert. Each part is
jitted on its own, so their sum is an upper bound of the layer's. Timers:
"pipelined" (calls back to back, GPU time per call) and "sync" (each call
waited for). Forward+backward = forward and the VJP of a fixed random
cotangent. Benchmarks print tables; they are not tests.
"""
import os
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: E402
from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu  # noqa: E402

from k3jax import routing  # noqa: E402
from k3jax.layers import moe  # noqa: E402
from k3jax.layers import moe_dispatch  # noqa: E402
from k3jax.layers import routed_gmm  # noqa: E402
from k3jax.layers.ffn import SwiGLU, swiglu  # noqa: E402
from k3jax.routing import RouterConfig  # noqa: E402
from k3jax.routing import capacity as capacity_lib  # noqa: E402
from k3jax.routing import quantiles  # noqa: E402
from pallas_kernels import platform  # noqa: E402
from pallas_kernels import timing  # noqa: E402
from pallas_kernels.gmm import api as gmm_api  # noqa: E402
from pallas_kernels.gmm import config as gmm_config  # noqa: E402
from pallas_kernels.gmm import layout as gmm_layout  # noqa: E402
from pallas_kernels.tools import bench_json  # noqa: E402
from pallas_kernels.tools import device_profile  # noqa: E402

SHAPES = {
    # name: (B, T, d, E, k, expert hidden)
    "gpu_1b": (16, 2048, 1536, 16, 2, 768),
    "gpu_150m": (32, 2048, 768, 8, 2, 512),
    "fine": (16, 2048, 1536, 256, 8, 256),
    "smoke": (2, 64, 32, 8, 2, 16),
}

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["gpu_1b", "gpu_150m", "fine"], f"Layer shapes: {list(SHAPES)}.")
flags.DEFINE_list("impls", ["buffered"],
                  "MoE paths: impl[:grouped_backend], impl in buffered | ragged | dense.")
flags.DEFINE_float("capacity_factor", 1.25, "Router capacity factor (buffered needs one).")
flags.DEFINE_string("router", "quantile", "Router name.")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype.")
flags.DEFINE_bool("parts", True, "Also time the layer's parts (table 2).")
flags.DEFINE_bool("backward", True, "Also time forward+backward.")
flags.DEFINE_integer("iters", 10, "Calls per pipelined round / sync timings.")
flags.DEFINE_integer("rounds", 5, "Pipelined rounds (median).")
flags.DEFINE_integer("warmup", 2, "Untimed calls after compilation.")
flags.DEFINE_bool("layer", True, "Time the layer against the dense SwiGLU (table 1).")
flags.DEFINE_bool("kernels", False, "Also time the Pallas grouped matmuls alone (table 3).")
flags.DEFINE_bool("profile", False, "Also list the device kernels of one forward+backward of "
                  "each --impls entry and the dense SwiGLU, from a profiler trace (table 4).")
flags.DEFINE_integer("profile_top", 12, "Kernels listed per path in table 4 (the rest summed).")
flags.DEFINE_list("gmm_config", [], "GmmConfig fields for the 'pallas' backend, "
                  "name=int (any int field of GmmConfig, e.g. block_n=256,wgrad_stages=4).")
flags.DEFINE_bool("gmm_mosaic", False, "With --kernels, also time the gathered forward on "
                  "the Mosaic GPU body (GmmConfig backend=mosaic_gpu, Hopper) beside the "
                  "Triton one, same inputs and tiles.")
flags.DEFINE_bool("peer_mgpu", True, "With --kernels on the GPU, also time jax's Mosaic GPU "
                  "ragged_dot ops on pre-gathered contiguous rows (best of a few tiles).")
flags.DEFINE_integer("rate_matmul", 8192, "Size n of the n^3 bf16 matmul that measures the rate.")
flags.DEFINE_string("json", "", "Also write every printed table's rows, the command line, device "
                    "and commit to this JSON file (see pallas_kernels/tools/bench_json.py).")

# The tables printed so far (their rows kept as bench_json.Tables does), for --json.
_TABLES = bench_json.Tables()


def _has_new_dispatch() -> bool:
  return importlib.util.find_spec("k3jax.layers.moe_dispatch") is not None


def _times(fn, *args):
  """(pipelined ms, sync ms) of a jitted fn."""
  call = lambda: fn(*args)
  jax.block_until_ready(call())  # compile
  pipe = timing.pipelined_ms(call, jax.block_until_ready, iters=FLAGS.iters,
                             rounds=FLAGS.rounds, warmup=FLAGS.warmup)
  sync = timing.sync_ms(call, jax.block_until_ready, iters=FLAGS.iters, warmup=0)
  return pipe, sync


def _fwd_bwd(f, args, key):
  """jitted forward, and forward + VJP of a random cotangent, of f(*args)."""
  out = jax.eval_shape(f, *args)
  ct = jax.tree.map(lambda o: jax.random.normal(key, o.shape, jnp.float32).astype(o.dtype)
                    if jnp.issubdtype(o.dtype, jnp.floating) else None, out)

  def fb(*a):
    y, vjp = jax.vjp(f, *a)
    return y, vjp(ct)

  return jax.jit(f), jax.jit(fb)


def _matmul_tflops():
  size = FLAGS.rate_matmul
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
  fn = jax.jit(lambda x, y: x @ y)
  pipe, _ = _times(fn, a, a)
  return 2 * size ** 3 / pipe / 1e9


def _layer_fns(config, x_btd):
  layer = moe.MoE(config, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  f = lambda state, x: nnx.merge(graphdef, state)(x, deterministic=True)[0]
  return _fwd_bwd(f, (state, x_btd), jax.random.key(7)), (state, x_btd)


def _dense_fns(d, hidden, dtype, x_btd):
  mlp = SwiGLU(d, hidden, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(mlp)
  f = lambda state, x: nnx.merge(graphdef, state)(x)
  return _fwd_bwd(f, (state, x_btd), jax.random.key(7)), (state, x_btd)


def _gmm_config(dtype) -> gmm_config.GmmConfig:
  """--gmm_config applied to the heuristic's tiles."""
  return gmm_config.with_fields(FLAGS.gmm_config, dtype)


def _config(shape, impl_spec, dtype):
  _, _, d, e, k, h = shape
  impl, _, backend = impl_spec.partition(":")
  cf = None if impl == "ragged" else FLAGS.capacity_factor
  kw = dict(d_model=d, num_experts=e, top_k=k, expert_hidden=h, num_shared_experts=1,
            router=RouterConfig(name=FLAGS.router, capacity_factor=cf), impl=impl,
            dtype=dtype, param_dtype=jnp.float32)
  if backend:
    kw["grouped_backend"] = backend
  if backend == "pallas":
    kw["gmm_config"] = _gmm_config(dtype)
  return moe.MoEConfig(**kw)


def _layer_flops(shape, n_rows):
  """Matmul FLOPs of one forward: routed rows (capacity slots) + shared + router."""
  b, t, d, e, _, h = shape
  n = b * t
  return 2 * 3 * d * h * (n_rows + n) + 2 * n * d * e


def _table(name, columns):
  """Prints a table's heading and header; the rows `_row` prints next belong to it."""
  print(f"\n## {name}\n")
  _TABLES.start(name, columns)


def _row(cells):
  """Prints a row of the table started last."""
  _TABLES.row(cells)


def layer_table(shape_name, dtype, tflops):
  shape = SHAPES[shape_name]
  b, t, d, e, k, h = shape
  n = b * t
  x = jax.random.normal(jax.random.key(1), (b, t, d), jnp.float32).astype(dtype)
  (df, dfb), dargs = _dense_fns(d, (k + 1) * h, dtype, x)
  dense_fwd, dense_sync = _times(df, *dargs)
  dense_fb = _times(dfb, *dargs) if FLAGS.backward else (float("nan"),) * 2
  dense_flops = 2 * 3 * d * (k + 1) * h * n
  _row([shape_name, f"dense SwiGLU {(k + 1) * h}", f"{dense_fwd:.3f}", f"{dense_fb[0]:.3f}",
        "1.00 / 1.00", f"{dense_flops / tflops / 1e9:.3f} / {3 * dense_flops / tflops / 1e9:.3f}",
        f"{dense_sync:.3f} / {dense_fb[1]:.3f}"])
  for spec in FLAGS.impls:
    config = _config(shape, spec, dtype)
    cap = capacity_lib.expert_capacity(n, e, k, config.router.capacity_factor)
    rows = n * k if cap is None or config.impl != "buffered" else e * cap
    if config.impl == "dense":
      rows = n * e
    (lf, lfb), largs = _layer_fns(config, x)
    fwd, fwd_sync = _times(lf, *largs)
    fb = _times(lfb, *largs) if FLAGS.backward else (float("nan"),) * 2
    flops = _layer_flops(shape, rows)
    _row([shape_name, f"MoE {spec}", f"{fwd:.3f}", f"{fb[0]:.3f}",
          f"{fwd / dense_fwd:.2f} / {fb[0] / dense_fb[0]:.2f}",
          f"{flops / tflops / 1e9:.3f} / {3 * flops / tflops / 1e9:.3f}",
          f"{fwd_sync:.3f} / {fb[1]:.3f}"])


def profile_table(shape_name, dtype):
  """Device kernels of one forward+backward per path, longest first."""
  b, t, d, e, k, h = SHAPES[shape_name]
  x = jax.random.normal(jax.random.key(1), (b, t, d), jnp.float32).astype(dtype)
  paths = [(f"dense SwiGLU {(k + 1) * h}", _dense_fns(d, (k + 1) * h, dtype, x))]
  paths += [(f"MoE {spec}", _layer_fns(_config(SHAPES[shape_name], spec, dtype), x))
            for spec in FLAGS.impls]
  for label, ((_, fb), args) in paths:
    rows = device_profile.kernel_ms(fb, *args, calls=FLAGS.iters)
    total = sum(ms for _, ms, _ in rows)
    rest = rows[FLAGS.profile_top:]
    rows = rows[:FLAGS.profile_top]
    if rest:
      rows.append((f"({len(rest)} other kernels)", sum(r[1] for r in rest),
                   sum(r[2] for r in rest)))
    for name, ms, launches in rows:
      _row([shape_name, label, name, f"{ms:.3f}", f"{launches:g}",
            f"{ms / total:.1%}" if total else "-"])
    _row([shape_name, label, "total device time", f"{total:.3f}", "", "100%"])


def parts_table(shape_name, dtype):
  """Each part of the buffered layer jitted alone (new dispatch only)."""
  from k3jax.layers import grouped_matmul  # pylint: disable=g-import-not-at-top
  from k3jax.layers import moe_dispatch  # pylint: disable=g-import-not-at-top
  shape = SHAPES[shape_name]
  b, t, d, e, k, h = shape
  n = b * t
  config = _config(shape, "buffered", dtype)
  layer = moe.MoE(config, rngs=nnx.Rngs(0))
  keys = jax.random.split(jax.random.key(3), 4)
  x_nd = jax.random.normal(keys[0], (n, d), jnp.float32).astype(dtype)
  kernel = layer.router_kernel[...]
  cap = capacity_lib.expert_capacity(n, e, k, config.router.capacity_factor)

  def router_with(router_config):
    def router(x_nd, kernel):
      scores = jax.nn.sigmoid(jnp.dot(x_nd.astype(jnp.float32), kernel))
      idx, w, _, _ = routing.route(scores, k=k, config=router_config)
      return idx, w
    return router

  router = router_with(config.router)
  idx, w = jax.jit(router)(x_nd, kernel)
  scores = jax.nn.sigmoid(jnp.dot(x_nd.astype(jnp.float32), kernel))
  extra = k if config.router.overflow_choices is None else config.router.overflow_choices
  cand = jax.lax.top_k(scores, min(e, k + extra))[1]
  count = capacity_lib.expert_capacity(n, e, k, 1.0)
  rc = lambda **kw: dataclasses.replace(config.router, **kw)
  block_m = _gmm_config(dtype).block_m
  idx_free, w_free = jax.jit(router_with(rc(capacity_factor=None)))(x_nd, kernel)
  plan_free = moe_dispatch.plan_slots(idx_free, w_free > 0, e, None, align=block_m)
  plan = moe_dispatch.plan_slots(idx, w > 0, e, cap)
  rows = moe_dispatch.dispatch_rows(x_nd, plan.source_s, plan.slot_nk)
  wg, wu, wo = (layer.wi_gate[...], layer.wi_up[...], layer.wo[...])
  y_sd = grouped_matmul.grouped_swiglu(rows, wg, wu, wo, group_sizes=plan.group_sizes,
                                       capacity=cap, backend="einsum", dtype=dtype)
  router_parts = [
      ("router scores, sigmoid(x W_r)", lambda x, r: jax.nn.sigmoid(
          jnp.dot(x.astype(jnp.float32), r)), (x_nd, kernel), False),
  ] + [
      (f"quantile thresholds ({impl})", lambda s, impl=impl: quantiles.column_threshold(
          s, count, impl=impl, num_bins=config.router.num_bins), (scores,), False)
      for impl in routing.QUANTILE_IMPLS
  ] + [
      (f"candidates top_k({cand.shape[1]} of {e})",
       lambda s: jax.lax.top_k(s, cand.shape[1])[1], (scores,), False),
  ] + [
      (f"router, {mode}, thresholds {impl}", router_with(rc(quantile_impl=impl, **kw)),
       (x_nd, kernel), False)
      for impl in ("exact", "radix")
      for mode, kw in (("capacity", {}), ("dropless", dict(capacity_factor=None)))
  ] + [
      (f"slot plan, dropless, align {block_m} ({pos})", lambda i, w, pos=pos:
       moe_dispatch.plan_slots(i, w > 0, e, None, positions=pos, align=block_m),
       (idx_free, w_free), False)
      for pos in ("count", "sort")
  ] + [
      ("tile map", lambda p: gmm_layout.tile_map(p.group_starts, p.group_sizes, p.num_slots,
                                                 block_m), (plan_free,), False),
  ]
  parts = router_parts + [
      ("router (scores, thresholds, top-k, capacity)", router, (x_nd, kernel), False),
      ("capacity pass alone (count)", lambda c: capacity_lib.assign_with_capacity(
          c, k=k, num_experts=e, capacity=cap, positions="count"), (cand,), False),
      ("capacity pass alone (sort)", lambda c: capacity_lib.assign_with_capacity(
          c, k=k, num_experts=e, capacity=cap, positions="sort"), (cand,), False),
      ("slot plan (count)", lambda i, w: moe_dispatch.plan_slots(
          i, w > 0, e, cap, positions="count"), (idx, w), False),
      ("slot plan (sort)", lambda i, w: moe_dispatch.plan_slots(
          i, w > 0, e, cap, positions="sort"), (idx, w), False),
      ("dispatch gather", lambda x: moe_dispatch.dispatch_rows(x, plan.source_s, plan.slot_nk),
       (x_nd,), True),
      ("expert matmuls (einsum buffers)", lambda r, a, bb, c: grouped_matmul.grouped_swiglu(
          r, a, bb, c, group_sizes=plan.group_sizes, capacity=cap, backend="einsum",
          dtype=dtype),
       (rows, wg, wu, wo), True),
      ("combine", lambda y, w: moe_dispatch.combine_rows(y, w, plan.slot_nk, plan.assign_s),
       (y_sd, w), True),
  ] + [
      (f"routed experts, dropless, pallas (plan given){label}",
       lambda x, w, a, bb, c, f=fuse: routed_gmm.routed_swiglu_gmm(
           x, w, a, bb, c, plan_free, dtype=dtype, config=_gmm_config(dtype), fuse_swiglu=f),
       (x_nd, w_free, wg, wu, wo), True)
      for fuse, label in ((False, ""), (True, ", SwiGLU fused"))
  ] + [
      ("shared expert", lambda x, a, bb, c: swiglu(x, a, bb, c, dtype),
       (x_nd, layer.shared_gate[...], layer.shared_up[...], layer.shared_out[...]), True),
  ]
  for label, f, args, differentiable in parts:
    fj, fbj = _fwd_bwd(f, args, keys[3]) if differentiable else (jax.jit(f), None)
    fwd, sync = _times(fj, *args)
    fb = _times(fbj, *args)[0] if (differentiable and FLAGS.backward) else float("nan")
    _row([shape_name, label, f"{fwd:.3f}", f"{fb:.3f}", f"{sync:.3f}"])


def kernel_table(shape_name, dtype):
  """The grouped matmuls alone on the layer's dropless plan, against dense matmuls."""
  b, t, d, e, k, h = SHAPES[shape_name]
  n = b * t
  cfg = _gmm_config(dtype)
  interp = platform.interprets("gmm")
  keys = jax.random.split(jax.random.key(5), 6)
  x_nd = jax.random.normal(keys[0], (n, d), jnp.float32).astype(dtype)
  scores = jax.nn.sigmoid(jax.random.normal(keys[1], (n, e), jnp.float32))
  idx, w, _, _ = routing.route(scores, k=k, config=RouterConfig(name=FLAGS.router,
                                                                capacity_factor=None))
  plan = moe_dispatch.plan_slots(idx, w > 0, e, None, align=cfg.block_m)
  tiles = gmm_layout.tile_map(plan.group_starts, plan.group_sizes, plan.num_slots, cfg.block_m)
  rows = n * k
  w_in = (jax.random.normal(keys[2], (e, d, 2 * h), jnp.float32) * d ** -0.5).astype(dtype)
  gu = jax.random.normal(keys[3], (plan.num_slots, 2 * h), jnp.float32).astype(dtype)
  dense_a = jax.random.normal(keys[4], (rows, d), jnp.float32).astype(dtype)
  dense_g = jax.random.normal(keys[5], (rows, 2 * h), jnp.float32).astype(dtype)
  dense_w = w_in[0]
  cases = [
      ("gmm fwd, rows gathered [S,d]x[d,2h]", 2 * rows * d * 2 * h,
       jax.jit(lambda x, ww: gmm_api.gmm(x, ww, tiles, row_index=plan.source_s, config=cfg, interpret=interp)),
       (x_nd, w_in), jax.jit(lambda a, ww: a @ ww), (dense_a, dense_w)),
      ("gmm dgrad [S,2h]x[2h,d]", 2 * rows * d * 2 * h,
       jax.jit(lambda g, ww: gmm_api.gmm(g, ww, tiles, transpose_rhs=True, config=cfg,
                                          interpret=interp)),
       (gu, w_in), jax.jit(lambda g, ww: g @ ww.T), (dense_g, dense_w)),
      ("tgmm wgrad, rows gathered [d,S]x[S,2h]", 2 * rows * d * 2 * h,
       jax.jit(lambda x, g: gmm_api.tgmm(x, g, tiles, lhs_index=plan.source_s, config=cfg,
                                           interpret=interp)),
       (x_nd, gu), jax.jit(lambda a, g: jnp.dot(a.T, g, preferred_element_type=jnp.float32)),
       (dense_a, dense_g)),
  ]
  if FLAGS.gmm_mosaic:
    mosaic = dataclasses.replace(cfg, backend="mosaic_gpu")
    cases.insert(1, (
        "gmm fwd, rows gathered, Mosaic GPU body", 2 * rows * d * 2 * h,
        jax.jit(lambda x, ww: gmm_api.gmm(x, ww, tiles, row_index=plan.source_s, config=mosaic,
                                          interpret=interp)),
        (x_nd, w_in), jax.jit(lambda a, ww: a @ ww), (dense_a, dense_w)))
  if FLAGS.peer_mgpu and not interp:
    cases += _mgpu_cases(plan.group_sizes.astype(jnp.int32), w_in, dense_a, dense_g, dense_w,
                         2 * rows * d * 2 * h)
  for label, flops, fn, args, dense_fn, dense_args in cases:
    ms = _times(fn, *args)[0]
    dense_ms = _times(dense_fn, *dense_args)[0]
    rate, dense_rate = flops / ms / 1e9, flops / dense_ms / 1e9
    _row([shape_name, label, f"{ms:.3f}", f"{rate:.0f}", f"{dense_ms:.3f}", f"{dense_rate:.0f}",
          f"{rate / dense_rate:.2f}"])


# (block_m, block_n, block_k, max_concurrent_steps, grid_block_n) tried for the peer.
_MGPU_TILES = ((64, 128, 64, 4, 4), (128, 128, 64, 4, 4), (128, 128, 64, 6, 4),
               (64, 256, 64, 4, 2))


def _best_mgpu(make, args):
  """(jitted fn, tiles) of the fastest `make(**tiles)` on args; tiles that do
  not fit (shared memory, divisibility) are skipped."""
  best = (float("inf"), None, None)
  for bm, bn, bk, steps, gbn in _MGPU_TILES:
    tiles = dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps,
                 grid_block_n=gbn)
    fn = jax.jit(make(**tiles))
    try:
      ms = _times(fn, *args)[0]
    except Exception as err:  # noqa: BLE001 - a tile that does not lower is skipped
      print(f"# mgpu tiles {tiles} skipped: {type(err).__name__}: {str(err)[:120]}", flush=True)
      continue
    if ms < best[0]:
      best = (ms, fn, tiles)
  return best[1], best[2]


def _mgpu_cases(group_sizes, w_in, dense_a, dense_g, dense_w, flops):
  """Peer rows: jax's Mosaic GPU ragged_dot ops on contiguous, pre-gathered
  rows grouped by `group_sizes` (no padding, no row index), same FLOPs."""
  specs = [
      ("fwd", lambda **t: lambda a, ww: ragged_dot_mgpu.ragged_dot(
          a, ww, group_sizes=group_sizes, **t), (dense_a, w_in),
       jax.jit(lambda a, ww: a @ ww), (dense_a, dense_w)),
      ("dgrad", lambda **t: lambda g, ww: ragged_dot_mgpu.ragged_dot(
          g, ww, group_sizes=group_sizes, transpose_rhs=True, **t), (dense_g, w_in),
       jax.jit(lambda g, ww: g @ ww.T), (dense_g, dense_w)),
      # Rows are the grouped contraction: lhs [rows, d], rhs [rows, 2h] -> [E, d, 2h].
      ("wgrad", lambda **t: lambda a, g: transposed_ragged_dot_mgpu.transposed_ragged_dot(
          a, g, group_sizes=group_sizes, **t), (dense_a, dense_g),
       jax.jit(lambda a, g: jnp.dot(a.T, g, preferred_element_type=jnp.float32)),
       (dense_a, dense_g)),
  ]
  cases = []
  for what, make, args, dense_fn, dense_args in specs:
    fn, tiles = _best_mgpu(make, args)
    if fn is not None:
      label = f"peer: jax mgpu ragged {what}, rows contiguous, {tuple(tiles.values())}"
      cases.append((label, flops, fn, args, dense_fn, dense_args))
  return cases


def main(argv):
  del argv
  dtype = jnp.dtype(FLAGS.dtype)
  for name in FLAGS.shapes:
    if name not in SHAPES:
      raise app.UsageError(f"--shapes: unknown shape {name!r}; known: {list(SHAPES)}")
  tflops = _matmul_tflops()
  print(f"# device: {jax.devices()[0].device_kind}; jax {jax.__version__}; dtype {FLAGS.dtype}; "
        f"router {FLAGS.router} cf={FLAGS.capacity_factor}; bf16 matmul {FLAGS.rate_matmul}^3: "
        f"{tflops:.0f} TFLOP/s; pipelined median of {FLAGS.rounds} rounds x {FLAGS.iters}",
        flush=True)
  if FLAGS.layer:
    _table("layer", ["shape", "what", "fwd ms", "fwd+bwd ms", "ratio to dense (fwd / fwd+bwd)",
                     "matmul floor ms (fwd / fwd+bwd)", "sync ms (fwd / fwd+bwd)"])
    for name in FLAGS.shapes:
      layer_table(name, dtype, tflops)
  if FLAGS.kernels:
    _table(f"grouped matmuls ({_gmm_config(dtype)})",
           ["shape", "kernel", "ms", "TFLOP/s", "dense matmul ms", "dense TFLOP/s", "rate / dense"])
    for name in FLAGS.shapes:
      kernel_table(name, dtype)
  if FLAGS.profile:
    _table("device kernels of one forward+backward (profiler trace)",
           ["shape", "path", "kernel", "ms per call", "launches per call", "share"])
    for name in FLAGS.shapes:
      profile_table(name, dtype)
  if FLAGS.parts and _has_new_dispatch():
    _table("parts (buffered)", ["shape", "part", "fwd ms", "fwd+bwd ms", "fwd sync ms"])
    for name in FLAGS.shapes:
      parts_table(name, dtype)
  if FLAGS.json:
    bench_json.write(FLAGS.json, _TABLES.tables,
                     peer_or_base="base: the dense SwiGLU of the layer's active "
                     "width in the same process (table 'layer'); dense matmuls of the same shapes "
                     "(table 'grouped matmuls')", dtype=FLAGS.dtype, router=FLAGS.router,
                     capacity_factor=FLAGS.capacity_factor, iters=FLAGS.iters, rounds=FLAGS.rounds,
                     matmul_tflop_s=tflops, shapes={name: SHAPES[name] for name in FLAGS.shapes})


if __name__ == "__main__":
  app.run(main)
