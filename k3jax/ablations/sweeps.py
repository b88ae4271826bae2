"""Sweep definitions of the three ablations, as frozen dataclasses with a `quick` and a `full` setting.

A sweep is a set of variants (config overrides), tasks (data overrides) and
seeds. Each (variant, task, seed) is one training run whose config is
`k3jax.train.defaults.base_config()` with the setting's base overrides, then
the task's, then the variant's, applied in that order.

* `quick`: CPU-sized (tiny models, tens of steps) so that CI can execute the
  notebooks; the numbers only show that the pipeline works.
* `full`: GPU-sized (d_model 256, 4-8 layers, 250 steps) for the
  results page; `experiments/run_ablations.py` runs it on one or two GPUs.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from k3jax.train.defaults import NONE_AS, base_config

SETTINGS = ("quick", "full")
SWEEPS = ("decay", "router", "residual")  # the three ablations `run_ablations.py` runs by default
# plus the long-context evaluation of the decay gate, and the reset at document boundaries
ALL_SWEEPS = SWEEPS + ("long", "documents")
Overrides = tuple[tuple[str, Any], ...]


def apply_overrides(config: ml_collections.ConfigDict, overrides: Overrides) -> ml_collections.ConfigDict:
  """Sets dotted paths (`"model.router.name"`) on `config` in place; unknown paths raise ValueError."""
  for path, value in overrides:
    *parents, leaf = path.split(".")
    node = config
    for name in parents:
      if name not in node:
        raise ValueError(f"config override {path!r}: no section {name!r}")
      node = node[name]
    if leaf not in node:
      raise ValueError(f"config override {path!r}: no field {leaf!r} (allowed: {sorted(node.keys())})")
    node[leaf] = value
  return config


@dataclasses.dataclass(frozen=True)
class Variant:
  """One arm of a sweep.

  Attributes:
    name: short id used in run directories and tables.
    overrides: dotted config paths and values.
    tags: (key, value) pairs for grouping in plots and tables (e.g. ("depth", 8)).
  """
  name: str
  overrides: Overrides = ()
  tags: tuple[tuple[str, Any], ...] = ()

  def tag(self, key: str, default: Any = None) -> Any:
    """The value of tag `key`, or `default`."""
    return dict(self.tags).get(key, default)


@dataclasses.dataclass(frozen=True)
class Task:
  """A data setting: name ("mqar", "bytes") and its config overrides."""
  name: str
  overrides: Overrides = ()


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One training run of a sweep."""
  sweep: str
  setting: str
  variant: Variant
  task: Task
  seed: int
  base: Overrides

  @property
  def key(self) -> str:
    """Run directory relative to the sweep output directory: `<sweep>/<variant>/<task>/seed<k>`."""
    return f"{self.sweep}/{self.variant.name}/{self.task.name}/seed{self.seed}"

  def config(self) -> ml_collections.ConfigDict:
    """The full trainer config of this run."""
    c = base_config()
    apply_overrides(c, self.base)
    apply_overrides(c, self.task.overrides)
    apply_overrides(c, self.variant.overrides)
    c.seed = self.seed
    return c


@dataclasses.dataclass(frozen=True)
class Sweep:
  """A sweep: base overrides x variants x tasks x seeds, plus what to evaluate after training.

  Attributes:
    name: one of ALL_SWEEPS.
    setting: one of SETTINGS.
    base: overrides shared by every run.
    variants: the arms.
    tasks: data settings (each variant runs on each task).
    seeds: one run per seed.
    length_multipliers: decay: held-out evaluation at these multiples of the
      training length (1 included).
    probe_position: router: the causality probe changes positions after this
      fraction of the sequence.
    gap_multipliers: long: MQAR recall with this many training lengths of pad
      between the key-value pairs and the queries.
    decode_prefill_x: long: prefill this many training lengths before the
      decode-vs-forward check (0: no check).
  """
  name: str
  setting: str
  base: Overrides
  variants: tuple[Variant, ...]
  tasks: tuple[Task, ...]
  seeds: tuple[int, ...]
  length_multipliers: tuple[int, ...] = (1,)
  probe_position: float = 0.5
  gap_multipliers: tuple[int, ...] = ()
  decode_prefill_x: int = 0

  def runs(self) -> list[RunSpec]:
    """Every run, variant-major then task then seed."""
    return [RunSpec(self.name, self.setting, v, t, s, self.base)
            for v in self.variants for t in self.tasks for s in self.seeds]

  def variant(self, name: str) -> Variant:
    """The variant called `name`."""
    for v in self.variants:
      if v.name == name:
        return v
    raise ValueError(f"sweep {self.name!r} has no variant {name!r}; "
                     f"allowed: {[v.name for v in self.variants]}")


# -- shared pieces -------------------------------------------------------------

# Every ablation run: one device, the final checkpoint only, no progress bar.
_RUN_COMMON: Overrides = (
    ("num_devices", 1), ("checkpoint_every", 0), ("keep_checkpoints", 1),
    ("async_checkpoints", False), ("progress_bar", False),
)
_RUN_QUICK: Overrides = _RUN_COMMON + (
    ("batch_size", 8), ("seq_len", 32), ("num_steps", 40), ("log_every", 5), ("eval_every", 20),
    ("eval_batches", 2), ("optim.warmup_steps", 4), ("optim.learning_rate", 3e-3),
    ("data.max_bytes", 300_000),
)
_RUN_FULL: Overrides = _RUN_COMMON + (
    ("batch_size", 16), ("seq_len", 256), ("num_steps", 250), ("log_every", 10),
    ("eval_every", 125), ("eval_batches", 4), ("optim.warmup_steps", 25),
    ("optim.learning_rate", 2e-3), ("data.max_bytes", 8_000_000),
)
# model.kda.lower_bound of the softplus arms: no bound.
_NO_BOUND = NONE_AS["kda.lower_bound"]
# Tiny CPU model: every sweep starts here and changes the layer stack it studies.
_MODEL_QUICK: Overrides = (
    ("model.d_model", 32), ("model.num_heads", 2), ("model.head_dim", 16), ("model.num_kv_heads", 2),
    ("model.dense_hidden", 64), ("model.expert_hidden", 32), ("model.num_experts", 0),
    ("model.first_layer_dense", False), ("model.kda.implementation", "xla"),
    ("model.kda.chunk_size", 16), ("model.kda.sub_chunk", 16), ("model.dtype", "float32"),
)
# GPU model: d_model 256, four heads of 64, bf16 compute, the XLA chunked KDA path
# (it accepts every (lower bound, tile) pair of the decay sweep; kernel times come from benchmarks).
_MODEL_FULL: Overrides = (
    ("model.d_model", 256), ("model.num_heads", 4), ("model.head_dim", 64), ("model.num_kv_heads", 4),
    ("model.dense_hidden", 768), ("model.expert_hidden", 256), ("model.num_experts", 8),
    ("model.top_k", 2), ("model.num_shared_experts", 1), ("model.first_layer_dense", True),
    ("model.kda.implementation", "xla"), ("model.moe_impl", "ragged"),
    ("model.kda.chunk_size", 64), ("model.kda.sub_chunk", 16), ("model.dtype", "bfloat16"),
)
# Byte-level text and MQAR share the 256-id vocabulary, so both tasks run the same compiled
# programs. MQAR keys come from [1, 128) and values from [128, 256).
# These sweeps' recorded results were trained on random windows of one byte stream; the
# documents sweep compares that with packed documents.
_BYTES = Task("bytes", (("data.kind", "bytes"), ("data.packing", "windows")))


def _mqar(pairs: int) -> Task:
  return Task("mqar", (("data.kind", "mqar"), ("data.vocab_size", 256),
                       ("data.mqar_num_kv_pairs", pairs), ("data.mqar_num_queries", 0)))


def _seeds(setting: str, seeds: tuple[int, ...] | None) -> tuple[int, ...]:
  if seeds is not None:
    if not seeds or any((not isinstance(s, int)) or s < 0 for s in seeds):
      raise ValueError(f"seeds must be non-negative ints, got {seeds!r}")
    return tuple(seeds)
  return (0,) if setting == "quick" else (0, 1, 2)


# -- the three sweeps ----------------------------------------------------------

# (name, gate, g_min, diagonal tile, diagonal strategy), as the runs are tagged; g_min is the
# bounded gate's model.kda.lower_bound, and every bounded pair keeps |g_min| * (tile - 1) <= 85
# (docs/design.md, "Why the bound matters"); softplus has no bound and needs pairwise tiles.
DECAY_ARMS = (
    ("softplus", "softplus", -5.0, 16, "pairwise"),
    ("g1.3_t64", "bounded", -1.3, 64, "dense"),
    ("g2.5_t32", "bounded", -2.5, 32, "dense"),
    ("g5_t16", "bounded", -5.0, 16, "dense"),
)
QUICK_DECAY_ARMS = ("softplus", "g5_t16")


def decay_sweep(setting: str = "quick", seeds: tuple[int, ...] | None = None) -> Sweep:
  """Bounded vs softplus KDA gate and bound/tile pairs, on MQAR recall and byte-level loss.

  The model is a pure KDA stack (no softmax attention, dense FFNs) so that recall
  has to come from the decaying state; each run is also evaluated at 4x and 16x
  its training length.
  """
  _check_setting(setting)
  if setting == "quick":
    # The two quick arms share 16-row tiles; one-tile chunks keep the CPU compile small.
    base = _RUN_QUICK + _MODEL_QUICK + (
        ("seq_len", 64), ("model.num_layers", 1), ("model.layer_pattern", "K"))
    pairs = 8
  else:
    # Shorter, wider batches than the other sweeps: MQAR needs many examples to be learnt,
    # and 16x the training length stays at 2048 tokens. The 64-row chunk holds the largest tile.
    base = _RUN_FULL + _MODEL_FULL + (
        ("batch_size", 64), ("seq_len", 128), ("optim.learning_rate", 3e-3),
        ("model.num_layers", 4), ("model.layer_pattern", "K"), ("model.num_experts", 0),
        ("model.first_layer_dense", False))
    pairs = 8
  # Each arm compiles its own programs; the CPU setting keeps the two ends of the comparison.
  arms = DECAY_ARMS if setting == "full" else tuple(a for a in DECAY_ARMS if a[0] in QUICK_DECAY_ARMS)
  variants = tuple(
      Variant(name, (("model.kda.lower_bound", g_min if gate == "bounded" else _NO_BOUND),
                     ("model.kda.sub_chunk", tile), ("model.kda.diagonal", diagonal)),
              (("gate", gate), ("g_min", g_min), ("tile", tile), ("diagonal", diagonal)))
      for name, gate, g_min, tile, diagonal in arms)
  return Sweep("decay", setting, base, variants, (_mqar(pairs), _BYTES), _seeds(setting, seeds),
               length_multipliers=(1, 4, 16))


# (name, router overrides). The quantile router is run as designed, with a batch capacity
# (cf 1.25); the lagged, bias-sign and aux-loss routers in their causal, dropless form.
ROUTER_ARMS = (
    ("quantile", (("model.router.name", "quantile"), ("model.router.capacity_factor", 1.25))),
    ("quantile_lagged", (("model.router.name", "quantile_lagged"), ("model.router.capacity_factor", 0.0))),
    ("bias_sign", (("model.router.name", "bias_sign"), ("model.router.capacity_factor", 0.0),
                   ("model.router.bias_update_rate", 1e-3))),
    ("aux_loss", (("model.router.name", "aux_loss"), ("model.router.capacity_factor", 0.0),
                  ("model.router.aux_loss_coef", 1e-2))),
)


def router_sweep(setting: str = "quick", seeds: tuple[int, ...] | None = None) -> Sweep:
  """Quantile / lagged quantile / bias-sign / aux-loss routers on byte-level text."""
  _check_setting(setting)
  if setting == "quick":
    # Two attention layers, both MoE: the cheapest stack with per-layer routers on a CPU.
    base = _RUN_QUICK + _MODEL_QUICK + (
        ("model.num_layers", 2), ("model.layer_pattern", "A"), ("model.num_experts", 4),
        ("model.top_k", 2), ("model.num_shared_experts", 1))
  else:
    base = _RUN_FULL + _MODEL_FULL + (("model.num_layers", 4), ("model.layer_pattern", "KKKA"))
  variants = tuple(Variant(name, ov, (("router", name),)) for name, ov in ROUTER_ARMS)
  return Sweep("router", setting, base, variants, (_BYTES,), _seeds(setting, seeds))


RESIDUAL_ARMS = ("prenorm", "block_attnres", "full_attnres")


def residual_sweep(setting: str = "quick", seeds: tuple[int, ...] | None = None) -> Sweep:
  """Pre-norm vs block AttnRes vs full AttnRes at several depths, on byte-level text.

  Block AttnRes groups 4 sublayers (two layers) per block (2 in the quick setting).
  """
  _check_setting(setting)
  if setting == "quick":
    # The router sweep's quick model, so its prenorm run shares compiled programs with that sweep.
    base = _RUN_QUICK + _MODEL_QUICK + (
        ("model.layer_pattern", "A"), ("model.num_experts", 4), ("model.top_k", 2),
        ("model.num_shared_experts", 1))
    depths, block = (2,), 2
  else:
    base = _RUN_FULL + _MODEL_FULL + (("model.layer_pattern", "KKKA"),)
    depths, block = (4, 8), 4
  variants = tuple(
      Variant(f"{arm}_L{depth}", (("model.residual", arm), ("model.num_layers", depth),
                                  ("model.attnres_block_size", block)),
              (("residual", arm), ("depth", depth)))
      for depth in depths for arm in RESIDUAL_ARMS)
  return Sweep("residual", setting, base, variants, (_BYTES,), _seeds(setting, seeds))


# (name, layer pattern, gate, gate overrides): the bounded and the softplus hybrid differ only in
# the gate (and the diagonal tiles softplus needs); the attention-only stack is the NoPE reference.
LONG_ARMS = (
    ("bounded", "hybrid", "bounded", (("model.kda.lower_bound", -5.0), ("model.kda.sub_chunk", 16),
                                      ("model.kda.diagonal", "dense"))),
    ("softplus", "hybrid", "softplus", (("model.kda.lower_bound", _NO_BOUND),
                                        ("model.kda.sub_chunk", 16), ("model.kda.diagonal", "pairwise"))),
    ("attention", "attention", "none", ()),
)


def long_sweep(setting: str = "quick", seeds: tuple[int, ...] | None = None) -> Sweep:
  """Bounded vs softplus gate in a KDA/attention hybrid, and a pure-attention reference,
  evaluated far past the training length (`k3jax.ablations.long_context`).

  quick: 2-layer models (hybrid "KA", attention "AA") trained at 64 tokens on a CPU,
  evaluated to 64x. full: 4-layer d=256 models ("KKKA" / "AAAA") trained at 2048
  tokens, evaluated at 2k, 8k, 32k and 128k tokens, MQAR gaps of 8x-64x, and a
  decode check after a 64x (128k-token) prefill.
  """
  _check_setting(setting)
  if setting == "quick":
    base = _RUN_QUICK + _MODEL_QUICK + (
        ("seq_len", 64), ("num_steps", 600), ("eval_every", 300), ("optim.warmup_steps", 20),
        ("model.num_layers", 2))
    hybrid, pairs, decode_x = "KA", 8, 4
  else:
    base = _RUN_FULL + _MODEL_FULL + (
        ("batch_size", 8), ("seq_len", 2048), ("num_steps", 500), ("eval_every", 250),
        ("eval_batches", 2), ("optim.warmup_steps", 100), ("model.num_layers", 4),
        ("model.num_experts", 0), ("model.first_layer_dense", False), ("data.max_bytes", 0))
    hybrid, pairs, decode_x = "KKKA", 64, 64
  num_layers = dict(base)["model.num_layers"]
  patterns = {"hybrid": hybrid, "attention": "A"}
  variants = tuple(
      Variant(name, (("model.layer_pattern", patterns[stack]),) + gate,
              (("stack", stack), ("gate", gate_name),
               ("layers", patterns[stack] * (num_layers // len(patterns[stack])))))
      for name, stack, gate_name, gate in LONG_ARMS)
  return Sweep("long", setting, base, variants, (_BYTES, _mqar(pairs)), _seeds(setting, seeds),
               length_multipliers=(1, 4, 16, 64), gap_multipliers=(8, 16, 32, 64),
               decode_prefill_x=decode_x)


# (name, data overrides): packed documents with the state, conv and attention restarted at each
# document, the same rows with the model blind to the boundaries, and random windows of one stream.
DOCUMENT_ARMS = (
    ("reset", (("data.packing", "documents"), ("data.reset_at_boundaries", True))),
    ("no_reset", (("data.packing", "documents"), ("data.reset_at_boundaries", False))),
    ("windows", (("data.packing", "windows"),)),
)


def documents_sweep(setting: str = "quick", seeds: tuple[int, ...] | None = None) -> Sweep:
  """Does restarting at document boundaries matter? The `tiny` model on stdlib bytes, three ways
  to feed it (DOCUMENT_ARMS), the same steps x batch x seq_len tokens each, evaluated on held-out
  documents alone by position in the document (`k3jax.ablations.document_eval`).

  Both settings run on a CPU: quick is the notebook's smoke size; full is `configs/tiny.py`'s
  model at 512-token rows.
  """
  _check_setting(setting)
  if setting == "quick":
    base = _RUN_QUICK + _MODEL_QUICK + (("seq_len", 128), ("model.num_layers", 2),
                                        ("model.layer_pattern", "KA"))
  else:
    base = _RUN_COMMON + (
        ("batch_size", 8), ("seq_len", 512), ("num_steps", 150), ("log_every", 10),
        ("eval_every", 75), ("eval_batches", 4), ("optim.warmup_steps", 10),
        ("optim.learning_rate", 3e-3), ("data.max_bytes", 8_000_000),
        ("model.d_model", 128), ("model.num_layers", 4), ("model.layer_pattern", "KKKA"),
        ("model.num_heads", 4), ("model.head_dim", 32), ("model.num_kv_heads", 4),
        ("model.num_experts", 4), ("model.top_k", 2), ("model.expert_hidden", 128),
        # The recurrent form is the fastest chunk_kda path on a CPU at this size (configs/tiny.py).
        ("model.dense_hidden", 256), ("model.kda.implementation", "naive"), ("model.dtype", "float32"))
  variants = tuple(Variant(name, ov, (("feed", name),)) for name, ov in DOCUMENT_ARMS)
  task = Task("bytes", (("data.kind", "bytes"),))
  return Sweep("documents", setting, base, variants, (task,), _seeds(setting, seeds))


_BUILDERS = {"decay": decay_sweep, "router": router_sweep, "residual": residual_sweep, "long": long_sweep,
             "documents": documents_sweep}


def make_sweep(name: str, setting: str = "quick", seeds: tuple[int, ...] | None = None) -> Sweep:
  """The sweep called `name` (one of ALL_SWEEPS) at `setting` ("quick" or "full")."""
  if name not in _BUILDERS:
    raise ValueError(f"sweep name {name!r}; allowed: {ALL_SWEEPS}")
  return _BUILDERS[name](setting, seeds)


def _check_setting(setting: str) -> None:
  if setting not in SETTINGS:
    raise ValueError(f"setting {setting!r}; allowed: {SETTINGS}")
