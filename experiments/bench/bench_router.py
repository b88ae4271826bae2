"""Router benchmark: balance table on skewed scores, and router time vs the MoE layer.

    PYTHONPATH=. python experiments/bench/bench_router.py                  # both tables
    PYTHONPATH=. python experiments/bench/bench_router.py --tables=timing --experts=256 --topk=8 --tokens=65536
    PYTHONPATH=. python experiments/bench/bench_router.py ... --json=/tmp/router.json   # rows as JSON too

Balance table: T=16384, E=64, k=8, 4 hot experts (+1.5 logits), fresh batch
every step, router state carried. Causality: B=4 sequences of 4096 tokens;
positions > 2047 of sequence 0 are replaced and the probe reports whether the
routing of any token at position <= 2047 changed.
Timing table: median wall time of the jitted router (exact vs histogram
quantiles) and of the jitted MoE layer forward (--impl, quantile router cf=1.0).
Overhead table: each router's time against the layer without its router.
Thresholds table: the per-expert quantile step alone, exact vs histogram.
"""
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import routing
from k3jax.layers import moe
from k3jax.routing import evaluate
from k3jax.routing import probe
from k3jax.routing import quantile as quantile_lib
from k3jax.routing import quantiles
from k3jax.routing import synthetic
from pallas_kernels.tools import bench_json

FLAGS = flags.FLAGS
flags.DEFINE_list("tables", ["balance", "overhead", "thresholds", "timing"],
                  "balance, overhead, thresholds, timing")
flags.DEFINE_list("experts", ["64", "256", "896"], "E values for the timing table")
flags.DEFINE_list("topk", ["8", "16"], "k values for the timing table")
flags.DEFINE_list("tokens", ["16384", "65536"], "T values for the timing table")
flags.DEFINE_integer("d_model", 256, "MoE width for the layer timing")
flags.DEFINE_integer("expert_hidden", 128, "expert SwiGLU width for the layer timing")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "expert compute dtype")
flags.DEFINE_integer("steps", 200, "batches for the balance table (stateful routers)")
flags.DEFINE_integer("reps", 5, "timed calls per measurement (median)")
flags.DEFINE_integer("overhead_experts", 256, "E of the per-router overhead table")
flags.DEFINE_integer("overhead_topk", 8, "k of the per-router overhead table")
flags.DEFINE_integer("overhead_tokens", 65536, "T of the per-router overhead table")
flags.DEFINE_bool("layer", True, "time the whole MoE layer in the timing table")
flags.DEFINE_enum("impl", "buffered", ["buffered", "ragged", "dense"],
                  "MoE path for the layer timing. XLA (jax 0.11) expands ragged_dot to every "
                  "expert for every row on CPU and NVIDIA GPUs, so 'ragged' is E times slower")
flags.DEFINE_string("json", "", "Also write every printed table's rows, the command line, device "
                    "and commit to this JSON file (see pallas_kernels/tools/bench_json.py).")

# The printed tables, kept for --json.
_TABLES = bench_json.Tables()

# (label, RouterConfig kwargs) rows of the balance and overhead tables.
ROWS = (
    ("topk", dict(name="topk", capacity_factor=None)),
    ("topk cf=1.0", dict(name="topk", capacity_factor=1.0)),
    ("aux_loss", dict(name="aux_loss", capacity_factor=None)),
    ("expert_choice cf=1.0", dict(name="expert_choice", capacity_factor=1.0)),
    ("bias_sign", dict(name="bias_sign", capacity_factor=None)),
    ("quantile (dropless)", dict(name="quantile", capacity_factor=None)),
    ("quantile cf=1.0", dict(name="quantile", capacity_factor=1.0)),
    ("quantile cf=1.0 hist", dict(name="quantile", capacity_factor=1.0,
                                  quantile_impl="histogram")),
    ("quantile_lagged", dict(name="quantile_lagged", capacity_factor=None)),
    ("quantile_lagged hist", dict(name="quantile_lagged", capacity_factor=None,
                                  quantile_impl="histogram")),
    ("quantile_lagged cf=1.0", dict(name="quantile_lagged", capacity_factor=1.0)),
)


def _median_seconds(fn, *args):
  jax.block_until_ready(fn(*args))  # compile
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(FLAGS.reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _router_seconds(config, scores, k):
  state = routing.init_router_state(scores.shape[1], config)
  fn = jax.jit(lambda s, st: routing.route(s, k=k, config=config, state=st))
  return _median_seconds(fn, scores, state)


def _layer_seconds(config, num_tokens, num_experts, k):
  """Forward time of the MoE layer (FLAGS.impl) routed by `config`."""
  dtype = jnp.bfloat16 if FLAGS.dtype == "bfloat16" else jnp.float32
  layer = moe.MoE(moe.MoEConfig(
      d_model=FLAGS.d_model, num_experts=num_experts, top_k=k,
      expert_hidden=FLAGS.expert_hidden, router=config, impl=FLAGS.impl, dtype=dtype,
      param_dtype=dtype), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  fn = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x, deterministic=True)[0])
  x = jax.random.normal(jax.random.key(1), (1, num_tokens, FLAGS.d_model), dtype)
  return _median_seconds(fn, state, x)


def _scores(num_tokens, num_experts):
  return jax.jit(synthetic.skewed_scores, static_argnums=(1, 2))(
      jax.random.key(0), num_tokens, num_experts)


def balance_table():
  t, e, k = 16384, 64, 8
  b, s, cut = 4, 4096, 2047
  print(f"\n## Balance on skewed scores (T={t}, E={e}, k={k}, 4 hot experts +1.5; "
        f"{FLAGS.steps} fresh batches)\n")
  _TABLES.start("balance", [
      "router", "MaxVio batch 1", "MaxVio batch 10", "MaxVio last 10",
      "MaxVio routed (pre-capacity) last 10", "drop fraction last 10", "reassigned last 10",
      "causal", "tokens <= t changed"])
  key0, key1 = jax.random.split(jax.random.key(123))
  batch = synthetic.skewed_scores(key0, b * s, e).reshape(b, s, e)
  future = synthetic.skewed_scores(key1, s - cut - 1, e)
  for label, kw in ROWS:
    cfg = routing.RouterConfig(**kw)
    steps = FLAGS.steps if cfg.stateful else 3
    res = evaluate.balance_over_batches(cfg, num_tokens=t, num_experts=e, k=k, steps=steps)
    state = _carried_state(cfg, t, e, k, steps)
    pr = probe.routing_causality_probe(batch, future, t=cut, k=k, config=cfg, state=state)
    last = slice(-10, None)
    vio10 = res["max_vio"][min(9, steps - 1)]
    _TABLES.row([
        label, f"{res['max_vio'][0]:.3f}", f"{vio10:.3f}", f"{res['max_vio'][last].mean():.3f}",
        f"{res['max_vio_routed'][last].mean():.3f}", f"{res['drop_fraction'][last].mean():.4f}",
        f"{res['reassigned_fraction'][last].mean():.4f}", "yes" if pr["causal"] else "no",
        f"{pr['changed_fraction']:.4f}"])


def _carried_state(cfg, t, e, k, steps):
  """The state a stateful router holds after `steps` batches (None if stateless)."""
  if not cfg.stateful:
    return None
  fn = jax.jit(lambda s, st: routing.route(s, k=k, config=cfg, state=st)[3])
  state = routing.init_router_state(e, cfg)
  for i in range(steps):
    state = fn(synthetic.skewed_scores(jax.random.key(i), t, e), state)
  return state


def timing_table():
  print(f"\n## Quantile router time, exact vs histogram (1000 bins), cf=1.0; "
        f"layer: {FLAGS.impl} MoE d_model={FLAGS.d_model} expert_hidden={FLAGS.expert_hidden} "
        f"{FLAGS.dtype}, {jax.devices()[0].device_kind}\n")
  _TABLES.start("timing", ["E", "k", "T", "exact ms", "histogram ms", "exact/hist",
                          "layer ms (exact)", "router share of layer (exact)", "(histogram)"])
  for e in map(int, FLAGS.experts):
    for k in map(int, FLAGS.topk):
      for t in map(int, FLAGS.tokens):
        scores = _scores(t, e)
        ex = _router_seconds(routing.RouterConfig(name="quantile"), scores, k)
        hi = _router_seconds(routing.RouterConfig(name="quantile", quantile_impl="histogram"),
                             scores, k)
        if FLAGS.layer:
          layer = _layer_seconds(routing.RouterConfig(name="quantile", capacity_factor=1.0),
                                 t, e, k)
          # The histogram layer differs only in the router: swap its time in.
          layer_h = layer - ex + hi
          tail = [f"{layer * 1e3:.2f}", f"{ex / layer:.1%}", f"{hi / layer_h:.1%}"]
        else:
          tail = ["-", "-", "-"]
        _TABLES.row([e, k, t, f"{ex * 1e3:.2f}", f"{hi * 1e3:.2f}", f"{ex / hi:.2f}", *tail])


def thresholds_table():
  print(f"\n## Per-expert thresholds alone (the quantile step of the router), exact top_k vs "
        f"histogram (1000 bins), {jax.devices()[0].device_kind}\n")
  _TABLES.start("thresholds", ["E", "k", "T", "exact ms", "histogram ms", "exact/hist"])
  for e in map(int, FLAGS.experts):
    for k in map(int, FLAGS.topk):
      for t in map(int, FLAGS.tokens):
        scores = _scores(t, e)
        count = quantile_lib.balanced_count(t, e, k)
        ex = _median_seconds(jax.jit(lambda s, c=count: quantiles.column_threshold_exact(s, c)),
                             scores)
        hi = _median_seconds(jax.jit(
            lambda s, c=count: quantiles.column_threshold_histogram(s, c, 1000)), scores)
        _TABLES.row([e, k, t, f"{ex * 1e3:.2f}", f"{hi * 1e3:.2f}", f"{ex / hi:.2f}"])


def overhead_table():
  e, k, t = FLAGS.overhead_experts, FLAGS.overhead_topk, FLAGS.overhead_tokens
  print(f"\n## Router overhead at E={e} k={k} T={t}: {FLAGS.impl} MoE d_model={FLAGS.d_model} "
        f"expert_hidden={FLAGS.expert_hidden} {FLAGS.dtype}, {jax.devices()[0].device_kind}\n")
  scores = _scores(t, e)
  base_cfg = routing.RouterConfig(name="quantile", capacity_factor=1.0)
  layer = _layer_seconds(base_cfg, t, e, k)
  rest = layer - _router_seconds(base_cfg, scores, k)
  print(f"Whole layer with the quantile cf=1.0 router: {layer * 1e3:.2f} ms; "
        f"without its router: {rest * 1e3:.2f} ms (the same for every router: same "
        f"buffer size).\n")
  _TABLES.start("overhead", ["router", "router ms", "router share of layer"])
  for label, kw in ROWS:
    r = _router_seconds(routing.RouterConfig(**kw), scores, k)
    _TABLES.row([label, f"{r * 1e3:.2f}", f"{r / (rest + r):.1%}"])


def main(argv):
  del argv
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"device {jax.devices()[0].device_kind}")
  if "balance" in FLAGS.tables:
    balance_table()
  if "overhead" in FLAGS.tables:
    overhead_table()
  if "thresholds" in FLAGS.tables:
    thresholds_table()
  if "timing" in FLAGS.tables:
    timing_table()
  if FLAGS.json:
    bench_json.write(FLAGS.json, _TABLES.tables, peer_or_base=(
        "balance: none (absolute values); timing, thresholds: exact quantiles against the "
        "histogram in the same call; overhead: each router against the layer without its router"))


if __name__ == "__main__":
  app.run(main)
