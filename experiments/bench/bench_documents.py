r"""What documents in a row cost the whole model: the training loss's forward+backward of a
config's model with and without segment ids, and with one use of the segments at a time.

GPU, one H100 or H200, in one call. The configs import the data package (grain), so the
wheels go in first, as for the trainer (configs/gpu_1b.py). Each arm compiles once (the
"compile s" column), so the profile runs four layers ("KKKA", one of each kind) of gpu_1b
at its width and batch, then the whole model takes three arms; rows and kernel tables
print as each arm ends, so a `timeout` keeps what was measured:

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl \
    && python3 -m pip install -q --no-index --find-links .whl/data grain array-record tokenizers \
    && export PYTHONPATH=.:/tmp/site \
    && { timeout 300 python3 experiments/bench/bench_documents.py --config=configs/gpu_1b.py \
           --config.model.num_layers=4 --profile --json=$OUT/documents_1b4.json; \
         timeout 280 python3 experiments/bench/bench_documents.py --config=configs/gpu_1b.py \
           --arms=none,mask,packed --json=$OUT/documents_1b.json; }

`--arms=none,mask,moe` (any subset, none first for the ratios and kernel tables) trims
the compiles; `--kernel_names=raw` keeps XLA's fusion numbers in the kernel tables.

CPU smoke test (seconds per arm; the times say nothing, the packed arm needs cuDNN and is
skipped; two layers "KA" hold every use):

  PYTHONPATH=. python experiments/bench/bench_documents.py --config=configs/tiny.py \
      --config.model.num_layers=2 --config.model.layer_pattern=KA --batch=2 --seq_len=32 \
      --iters=1 --rounds=1

The model is built as the trainer builds it for one device (`ModelLayout.build_lm` on the
config's `ModelConfig`, the seed's parameters) and traced under the trainer's one-device
mesh and logical rules (`--nomesh` traces without them). Each arm times one jitted call:
the value and gradient over the parameters of the trainer's loss (`step.make_train_step`:
masked cross-entropy plus the routers' aux loss, `step.model_inputs` handing over the
segment ids with max_segments = data.max_documents_per_row + 1), returning the loss and
the gradients' global norm as the step computes it. The optimizer update is not included.
Batch and sequence length are the config's unless `--batch` / `--seq_len` say otherwise.

Arms (`--arms`, in this order):
* `none`: no segment ids (the plain program);
* `mask`: segment ids reach every layer, attention by the [B, 1, T, T] document mask;
* `packed`: the same, attention in cuDNN's packed layout (the model built with
  `packed_attention.DEFAULT_ON_GPU` set; GPU only);
and the ablations, segment ids reaching one use only (the others see none), attention on
the mask path:
* `kda_state`: the KDA state restarts per document (`chunk_kda(segment_ids=...)`);
* `conv`: KDA's convolutions restarted at document boundaries;
* `moe`: padding masked out of routing (the router's token mask);
* `attention`: attention by document (the mask).
The ablations wrap the layers in the benchmark (`Withheld`), not in the library.

Segment ids: each row holds `--docs_per_row` documents of random lengths (cuts drawn
uniformly) followed by a padding tail (id 0) of up to `--padding` of the row.

Prints a table (arm, what reaches the layers, compile s, the program's temporaries in
GiB (XLA rematerializes when they near the device's memory), ms per forward+backward,
tokens/s, ratio to `none`, loss). `--profile` adds, after each arm's row, its kernels'
device time against `none`'s (`pallas_kernels.tools.device_profile.kernel_ms`, over
`--profile_calls` calls): kernel, ms none, ms arm, delta, launches, the `--top` largest
|delta| first, XLA's numbered fusions summed by kind, under a first row "all kernels"
(when its delta falls short of the wall-clock difference, the time is spent outside the
kernels); the summary is then printed whole again at the end.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from k3jax.data import packing_of
from k3jax.layers import packed_attention
from k3jax.layers.attention import CausalSelfAttention
from k3jax.layers.kda import KDA
from k3jax.layers.moe import MoE
from k3jax.layers.segments import Segments
from k3jax.parallel.model_layout import ModelLayout
from k3jax.sharding import rules as rules_lib
from k3jax.train import step
from k3jax.train.config_schema import validate_for_devices
from pallas_kernels.tools import bench
from pallas_kernels.tools import bench_json
from pallas_kernels.tools import device_profile

# The uses of the segments, one per ablation arm.
USES = ("kda_state", "conv", "moe", "attention")


@dataclasses.dataclass(frozen=True)
class Arm:
  """One timed program: whether the model gets segment ids, which layers' uses see them,
  and the attention's documents path."""
  segments: bool
  uses: frozenset = frozenset(USES)
  documents: str = "mask"

  def describe(self) -> str:
    if not self.segments:
      return "-"
    return "all" if self.uses == frozenset(USES) else ",".join(sorted(self.uses))


ARMS = {
    "none": Arm(segments=False),
    "mask": Arm(segments=True),
    "packed": Arm(segments=True, documents="packed"),
    **{use: Arm(segments=True, uses=frozenset([use])) for use in USES},
}

FLAGS = flags.FLAGS


def _define_flags():
  """The command line. Defined only when this file runs as a script, so that tests can
  import its functions in one process."""
  config_flags.DEFINE_config_file(
      "config", "configs/gpu_1b.py", "Training config file (configs/*.py[:arg]); its fields "
      "may be overridden as for the trainer (--config.model.num_layers=2).", lock_config=True)
  flags.DEFINE_integer("batch", 0, "Rows B; 0 takes the config's batch_size.")
  flags.DEFINE_integer("seq_len", 0, "Tokens per row T; 0 takes the config's seq_len.")
  flags.DEFINE_list("arms", list(ARMS), f"Arms to time, of {list(ARMS)}.")
  flags.DEFINE_integer("docs_per_row", 3, "Documents per row.")
  flags.DEFINE_float("padding", 0.05, "Longest padding tail of a row, as a fraction of T.")
  flags.DEFINE_bool("mesh", True, "Trace under the trainer's one-device mesh and rules.")
  flags.DEFINE_integer("iters", 3, "Calls per pipelined round.")
  flags.DEFINE_integer("rounds", 3, "Pipelined rounds (median).")
  flags.DEFINE_bool("profile", False, "Also each arm's kernels against none's.")
  flags.DEFINE_integer("profile_calls", 2, "Calls in each profiler trace.")
  flags.DEFINE_integer("top", 15, "Kernels per profile table.")
  flags.DEFINE_enum("kernel_names", "kind", ["kind", "raw"],
                    "kind: XLA's numbered fusions summed by kind; raw: as traced.")
  flags.DEFINE_string("json", "", "Also write the tables' rows, the command line, device and "
                      "commit to this JSON file (see pallas_kernels/tools/bench_json.py).")


class KdaSegments:
  """What a KDA layer reads of `Segments` (`ids_bt`, `run_bt`, `offsets_bm`), with the
  state restarts (run_bt None) or the conv restarts (offsets_bm None) withheld:
  `KDA._forward` then runs that part's plain path."""

  def __init__(self, segments: Segments, *, state: bool, conv: bool):
    self.ids_bt = segments.ids_bt
    self.run_bt = segments.run_bt if state else None
    self.offsets_bm = segments.offsets_bm if conv else None


class Withheld(nnx.Module):
  """A layer that sees the rows' segments only for the uses in `uses` (benchmark ablation).

  Mixers are called `layer(x, segments)`, FFNs `layer(x, deterministic=..., segments=...)`;
  both take `segments=` by keyword, which this passes on: the real `Segments`, None, or
  for KDA a `KdaSegments` keeping one of its two uses.
  """

  def __init__(self, layer: nnx.Module, uses: frozenset):
    self.layer, self.uses = layer, uses

  def _view(self, segments: Segments | None):
    if segments is None:
      return None
    if isinstance(self.layer, KDA):
      state, conv = "kda_state" in self.uses, "conv" in self.uses
      if state and conv:
        return segments
      return KdaSegments(segments, state=state, conv=conv) if state or conv else None
    if isinstance(self.layer, CausalSelfAttention):
      return segments if "attention" in self.uses else None
    if isinstance(self.layer, MoE):
      return segments if "moe" in self.uses else None
    return segments  # per-token layers (a dense first FFN) ignore them

  def __call__(self, x_btd, segments=None, **kw):
    return self.layer(x_btd, segments=self._view(segments), **kw)


@contextlib.contextmanager
def packed_default(on: bool):
  """`packed_attention.DEFAULT_ON_GPU` set to `on` while the model is built (the attention
  layers resolve their documents path then)."""
  before = packed_attention.DEFAULT_ON_GPU
  packed_attention.DEFAULT_ON_GPU = on
  try:
    yield
  finally:
    packed_attention.DEFAULT_ON_GPU = before


def attention_paths(model) -> set[str]:
  """The documents paths of the model's attention layers."""
  return {layer.mixer.documents for layer in model.layers
          if isinstance(layer.mixer, CausalSelfAttention)}


def arm_model(arm: Arm, build, params, rest):
  """The model of `arm` over the shared parameters: built (abstractly) with its attention
  path, the arrays merged in, its layers wrapped when it withholds a use."""
  with packed_default(arm.documents == "packed"):
    graphdef = nnx.split(nnx.eval_shape(build), nnx.Param, ...)[0]
  model = nnx.merge(graphdef, params, rest)
  if arm.segments and arm.uses != frozenset(USES):
    for layer in model.layers:
      layer.mixer = Withheld(layer.mixer, arm.uses)
      layer.ffn = Withheld(layer.ffn, arm.uses)
  return model


def loss_grad_fn(model, max_segments: int | None):
  """(jitted fn(params, rest, batch) -> (loss, gradients' global norm), params, rest): the
  train step's loss (`step.make_train_step`) and its value_and_grad, without the update."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, rest, batch):
    model = nnx.merge(graphdef, params, rest, copy=True)
    logits_btv, aux = model(batch["inputs"], deterministic=False,
                            **step.model_inputs(batch, max_segments))
    nll, _, count = step.masked_cross_entropy(logits_btv, batch["targets"], batch["mask"])
    return nll / jnp.maximum(count, 1.0) + jnp.asarray(aux["aux_loss"], jnp.float32)

  @jax.jit
  def fwd_bwd(params, rest, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, rest, batch)
    return loss, optax.global_norm(grads)

  return fwd_bwd, params, rest


def make_batch(vocab: int, ids_bt: np.ndarray, seed: int = 0) -> dict:
  """Random tokens and targets [B, T] int32, the loss mask (document tokens) and the ids."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (2,) + ids_bt.shape).astype(np.int32)
  return {"inputs": jnp.asarray(tokens[0]), "targets": jnp.asarray(tokens[1]),
          "mask": jnp.asarray(ids_bt != 0, jnp.float32), "segment_ids": jnp.asarray(ids_bt)}


def kernel_kind(name: str) -> str:
  """A kernel name without XLA's instance numbers ("loop_add_fusion.12" -> "loop_add_fusion")."""
  return re.sub(r"([._]\d+)+$", "", name)


def kernel_deltas(base, other, *, by_kind: bool) -> list[tuple[str, float, float, float, float, float]]:
  """[(kernel, ms base, ms other, delta, launches base, launches other)] of two
  `device_profile.kernel_ms` results, "all kernels" first, then by |delta|, largest first."""
  def totals(rows):
    out = {}
    for name, ms, launches in rows:
      key = kernel_kind(name) if by_kind else name
      prev = out.get(key, (0.0, 0.0))
      out[key] = (prev[0] + ms, prev[1] + launches)
    return out

  a, b = totals(base), totals(other)
  rows = []
  for name in set(a) | set(b):
    (ms_a, n_a), (ms_b, n_b) = a.get(name, (0.0, 0.0)), b.get(name, (0.0, 0.0))
    rows.append((name, ms_a, ms_b, ms_b - ms_a, n_a, n_b))
  rows.sort(key=lambda row: -abs(row[3]))
  sum_a, sum_b = (sum(ms for ms, _ in t.values()) for t in (a, b))
  launches_a, launches_b = (sum(n for _, n in t.values()) for t in (a, b))
  return [("all kernels", sum_a, sum_b, sum_b - sum_a, launches_a, launches_b)] + rows


def _arms(on_gpu: bool) -> list[str]:
  """The arms of --arms this machine runs (packed needs cuDNN's packed layout)."""
  unknown = [name for name in FLAGS.arms if name not in ARMS]
  if unknown:
    raise app.UsageError(f"unknown arms {unknown}; arms are {list(ARMS)}")
  packed_ok = on_gpu and packed_attention.available()
  if "packed" in FLAGS.arms and not packed_ok:
    print("note: arm packed skipped: cuDNN's packed layout needs a Hopper GPU and a checked jax")
  return [name for name in FLAGS.arms if name != "packed" or packed_ok]


def _compile(fn, args):
  """(the compiled program, compile s, its temporaries in GiB or None where the backend
  does not say). A program near the device's memory has XLA rematerialize, which the
  time alone would not tell apart from slower kernels."""
  t0 = time.perf_counter()
  compiled = fn.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  memory = compiled.memory_analysis()
  temp = getattr(memory, "temp_size_in_bytes", None)
  return compiled, compile_s, None if temp is None else temp / 2**30


def _time_arm(compiled, args) -> tuple[float, float]:
  """(ms per call, loss) of the compiled program."""
  loss, _ = jax.block_until_ready(compiled(*args))
  ms = bench.pipelined_ms(compiled, *args, iters=FLAGS.iters, rounds=FLAGS.rounds, warmup=1)
  return ms, float(loss)


def _profile_table(tables, name: str, kernels: dict) -> None:
  """Prints arm `name`'s kernels against none's (a table of `tables` of its own)."""
  base, rows = kernels.get("none"), kernels[name]
  if name == "none" or base is None:
    return
  if not base:
    print(f"no device kernels in the trace (CPU): no kernel table for {name}")
    return
  print(f"\n## kernels: none vs {name} (ms per call, top {FLAGS.top} by |delta|)")
  tables.start(f"kernels {name}", ["kernel", "ms none", f"ms {name}", "delta ms",
                                   "launches none", f"launches {name}"])
  deltas = kernel_deltas(base, rows, by_kind=FLAGS.kernel_names == "kind")
  for kernel, ms_a, ms_b, delta, n_a, n_b in deltas[:FLAGS.top + 1]:
    tables.row([kernel[:90], f"{ms_a:.3f}", f"{ms_b:.3f}", f"{delta:+.3f}", f"{n_a:.0f}",
                f"{n_b:.0f}"])
  print(flush=True)


def _reprint(table: dict) -> None:
  """A table of `Tables.tables` printed whole again (the summary, after the kernel tables)."""
  print("\n## summary")
  print("| " + " | ".join(table["columns"]) + " |")
  print("|---" * len(table["columns"]) + "|")
  for row in table["rows"]:
    print("| " + " | ".join(str(row[c]) for c in table["columns"]) + " |")


@dataclasses.dataclass
class Setup:
  """What every arm shares: the config's model (built as the trainer builds it), its
  parameters, the batch, the trainer's segment bound and mesh."""
  name: str
  model_cfg: object
  build: object
  params: object
  rest: object
  batch: dict
  max_segments: int
  mesh: object
  rules: object


def setup(config, name: str) -> Setup:
  """The model of `config` for one device, its parameters and the batch of the flags."""
  model_cfg, pconf, sizes = validate_for_devices(config, 1)
  b, t = FLAGS.batch or config.batch_size, FLAGS.seq_len or config.seq_len
  max_segments = packing_of(config.data, t).max_segments  # the trainer's bound
  if FLAGS.docs_per_row + 1 > max_segments:
    raise app.UsageError(f"--docs_per_row={FLAGS.docs_per_row} and a padding run exceed the "
                         f"config's max_segments={max_segments} (data.max_documents_per_row + 1)")
  layout = ModelLayout.for_mesh(sizes, model_cfg.kda.implementation, pconf.microbatches)
  build = lambda: layout.build_lm(model_cfg, rngs=nnx.Rngs(config.seed),
                                  expert_parallel=pconf.expert_parallel(sizes["expert"]))
  with packed_default(False):
    _, params, rest = nnx.split(build(), nnx.Param, ...)
  batch = make_batch(model_cfg.vocab_size, bench.document_ids(b, t, FLAGS.docs_per_row,
                                                              FLAGS.padding))
  mesh = pconf.make_mesh(jax.devices()[:1]) if FLAGS.mesh else None
  return Setup(name, model_cfg, build, params, rest, batch, max_segments, mesh, pconf.rules)


def _print_header(s: Setup) -> None:
  cfg, (b, t) = s.model_cfg, s.batch["inputs"].shape
  print(f"# {s.name}: {cfg.num_layers} layers '{cfg.layer_pattern}', d={cfg.d_model}, "
        f"{cfg.dtype}, kda={cfg.kda.implementation}; device: {jax.devices()[0].device_kind}")
  print(f"# B={b} T={t}, {FLAGS.docs_per_row} documents a row + a padding tail <= "
        f"{FLAGS.padding:.0%}, max_segments={s.max_segments}; value_and_grad of the train loss "
        f"(no optimizer update), pipelined ms per call, {FLAGS.iters} calls x {FLAGS.rounds} "
        f"rounds; mesh: {'the trainer one-device' if s.mesh else 'none'}", flush=True)


def run_arm(s: Setup, name: str, summary, profiles, kernels: dict, base_ms: float | None
            ) -> float | None:
  """Times arm `name` and prints its row of the `summary` table; with --profile keeps its
  kernels in `kernels` and prints their table against none's in `profiles` at once, so that
  a run cut short keeps what it measured. Returns its ms, None when skipped."""
  arm = ARMS[name]
  # Built off the mesh, as the trainer builds its models; traced on it.
  model = arm_model(arm, s.build, s.params, s.rest)
  if arm.documents == "packed" and attention_paths(model) != {"packed"}:
    print(f"note: arm packed skipped: the attention layers resolved to {attention_paths(model)}")
    return None
  fn, params, rest = loss_grad_fn(model, s.max_segments if arm.segments else None)
  args = (params, rest, s.batch)
  with _on_mesh(s.mesh, s.rules):
    compiled, compile_s, temp_gib = _compile(fn, args)
    ms, loss = _time_arm(compiled, args)
    if FLAGS.profile:
      kernels[name] = device_profile.kernel_ms(compiled, *args, calls=FLAGS.profile_calls)
  tokens = s.batch["inputs"].size
  ratio = f"{ms / base_ms:.3f}" if base_ms else ("1.000" if name == "none" else "-")
  temp = "-" if temp_gib is None else f"{temp_gib:.2f}"
  summary.row([name, arm.describe(), f"{compile_s:.1f}", temp, f"{ms:.3f}",
               f"{tokens / ms * 1e3:.0f}", ratio, f"{loss:.6f}"])
  if FLAGS.profile:
    _profile_table(profiles, name, kernels)
  return ms


def main(argv):
  del argv
  s = setup(FLAGS.config, config_flags.get_config_filename(FLAGS["config"]))
  _print_header(s)
  summary, profiles = bench_json.Tables(), bench_json.Tables()
  summary.start("documents", ["arm", "segments reach", "compile s", "temp GiB", "ms fwd+bwd", "tokens/s",
                              "ratio vs none", "loss"])
  base_ms, kernels = None, {}
  for name in _arms(jax.default_backend() == "gpu"):
    ms = run_arm(s, name, summary, profiles, kernels, base_ms)
    base_ms = ms if name == "none" else base_ms
  if profiles.tables:  # the summary's rows lie between the kernel tables
    _reprint(summary.tables["documents"])
  if FLAGS.json:
    b, t = s.batch["inputs"].shape
    bench_json.write(FLAGS.json, {**summary.tables, **profiles.tables}, peer_or_base=(
        "base: arm none (the same model and batch without segment ids) in the same run"),
        config=s.name, batch=b, seq_len=t, max_segments=s.max_segments)


@contextlib.contextmanager
def _on_mesh(mesh, rules):
  """The mesh and rules the trainer traces its steps under (`trainer._Build.on_mesh`);
  nothing for mesh None."""
  if mesh is None:
    yield
    return
  with jax.set_mesh(mesh), rules_lib.use_rules(rules):
    yield


if __name__ == "__main__":
  _define_flags()
  app.run(main)
