"""The complete default config: every field the trainer reads, each with its meaning (the
model's in its dataclasses, from which the `model` section is built).

Config files in `configs/` start from `base_config()` and override what they need;
`config_schema.validate` rejects any key not listed here.
"""
from __future__ import annotations

import dataclasses

import ml_collections

from k3jax.models.config import ModelConfig


def model_config(**overrides) -> ml_collections.ConfigDict:
  """`ModelConfig()` as a ConfigDict, built from the dataclasses: `model.kda` and `model.router`
  are sections of their fields, a None is written as its number in `NONE_AS`.

  What each field means is said once, beside its default, in `k3jax.models.config.ModelConfig`,
  `pallas_kernels.kda.spec.KdaSpec` and `k3jax.routing.config.RouterConfig`.
  """
  c = config_dict(ModelConfig())
  c.update(overrides)
  return c


# Fields whose None the ConfigDict writes as a number, because a field holding None
# cannot be overridden on the command line; `config_schema.model_config_from` reads it back.
NONE_AS = {
    "kda.lower_bound": 0.0,         # no bound: the unbounded softplus gate (needs kda.diagonal="pairwise")
    "router.capacity_factor": 0.0,  # dropless
    "router.overflow_choices": -1,  # the router's default, k
}

# The model section's flat keys of config files and run directories from before it was nested,
# each with its key now; `gate` became the bound's presence (0: the softplus gate).
MOVED_MODEL_KEYS = {"g_min": "kda.lower_bound", "gate": "kda.lower_bound",
                    "kda_chunk_size": "kda.chunk_size", "kda_sub_chunk": "kda.sub_chunk",
                    "kda_diagonal": "kda.diagonal", "kda_implementation": "kda.implementation"}


def config_dict(obj, where: str = "") -> ml_collections.ConfigDict:
  """A frozen dataclass as a ConfigDict of its fields (nested dataclasses as sections)."""
  c = ml_collections.ConfigDict()
  for field in dataclasses.fields(obj):
    value, key = getattr(obj, field.name), where + field.name
    if dataclasses.is_dataclass(value):
      value = config_dict(value, key + ".")
    elif value is None:
      if key not in NONE_AS:
        raise ValueError(f"model.{key} defaults to None, which a ConfigDict field cannot be "
                         "overridden from; give it a number in defaults.NONE_AS")
      value = NONE_AS[key]
    c[field.name] = value
  return c


def parallel_config(**overrides) -> ml_collections.ConfigDict:
  """The device mesh and sharding rules (`k3jax.parallel.config.ParallelConfig.from_trainer_config`).

  The mesh's axis sizes multiply to the devices used (see `num_devices`); the
  default puts every device on `data` (plain data parallelism; one device: no
  sharding at all). Example for two GPUs: `--config.parallel.expert=2`.
  """
  c = ml_collections.ConfigDict()
  c.data = -1                   # data-parallel axis size; -1 = the devices the other axes leave
  # Parameter/optimizer-state sharding axis (ZeRO-3 over "embed"); also shards the batch.
  c.fsdp = 1
  # Expert-parallel axis: routed experts split over it (divides model.num_experts); it shards
  # the batch elsewhere.
  c.expert = 1
  # Context-parallel axis: each sequence split over it (seq_len divisible by context *
  # model.kda.chunk_size).
  c.context = 1
  # Pipeline stages (the mesh's stage axis): layers split into this many equal stages (divides
  # model.num_layers; with block_attnres on block boundaries).
  c.stages = 1
  # Pipeline microbatches per step: batch_size divisible by microbatches x the axes of
  # rules.batch; GPipe bubble (stages - 1) / (microbatches + stages - 1).
  c.microbatches = 1
  # Expert-parallel send slots per device pair relative to an even split; 0 = lossless
  # (worst-case buffers).
  c.dispatch_slot_factor = 0.0
  # Logical axis -> comma-separated mesh axes ("" = replicated); defaults below.
  c.rules = ml_collections.ConfigDict()
  # Sequences of a batch (must cover every axis but context for full use of the devices).
  c.rules.batch = "data,fsdp,expert"
  c.rules.length = "context"    # positions of a sequence
  c.rules.attn_heads = "context"  # softmax-attention heads while it sees whole sequences (all-to-all)
  c.rules.embed = "fsdp"        # model width of weights (ZeRO-3 sharding when fsdp > 1)
  c.rules.expert = "expert"     # routed-expert index of expert weights and their optimizer moments
  c.rules.vocab = ""            # vocabulary dim of embedding / head
  c.rules.mlp = ""              # FFN / expert hidden width
  c.rules.heads = ""            # mixer heads
  c.rules.kv = ""               # per-head width
  c.update(overrides)
  return c


def base_config() -> ml_collections.ConfigDict:
  """Every trainer field with its default (a small byte-level CPU run)."""
  c = ml_collections.ConfigDict()
  c.seed = 0                    # seeds the model init and the data order
  c.num_steps = 200             # optimizer updates in the whole run (the schedule's length)
  c.batch_size = 16             # global batch (sequences per step), split over processes and devices
  # Devices the mesh spans: the first N of one process (0 = all devices of all processes).
  c.num_devices = 0
  c.seq_len = 256               # tokens per sequence
  c.log_every = 10              # steps between train-metric records
  c.eval_every = 100            # steps between held-out evaluations (0: only at the start and end)
  c.eval_batches = 4            # held-out batches per evaluation (a fixed set)
  c.checkpoint_every = 100      # steps between checkpoints (0: only at the end and on SIGTERM/SIGINT)
  c.keep_checkpoints = 2        # newest checkpoints kept on disk
  c.async_checkpoints = True    # write checkpoints in the background
  c.progress_bar = True         # tqdm bar on process 0
  c.peak_tflops_per_device = 0.0  # for MFU; 0 = look up the device kind (no MFU on unknown devices/CPU)

  c.model = model_config()
  c.parallel = parallel_config()

  c.data = ml_collections.ConfigDict()
  # "bytes" (local text files), "prepared" (experiments/prepare_data.py), "token_file"
  # (memory-mapped ids) or "mqar".
  c.data.kind = "bytes"
  c.data.path = ""              # prepared: the directory experiments/prepare_data.py wrote
  c.data.tokenizer = ""         # prepared: "" = the tokenizer saved with the data; a path must be that same file
  c.data.tokenizer_sha256 = ""  # filled in by the trainer: the digest of the run's tokenizer, kept in config.json
  # bytes / prepared: "documents" (packed rows, segment ids) or "windows" (bytes: random
  # windows of one stream).
  c.data.packing = "documents"
  # documents: the model sees segment_ids (state, conv and attention restart per document).
  c.data.reset_at_boundaries = True
  # documents: most documents first-fit packs into one row (the model's static segment bound + 1).
  c.data.max_documents_per_row = 8
  c.data.packing_bins = 64      # documents: rows first-fit fills at once (more: tighter packing)
  c.data.prefetch = 2           # documents: batches prepared ahead by a background thread (0: none)
  c.data.paths = ()             # bytes: files/directories to read; empty = this Python's stdlib sources
  c.data.patterns = ("*.py",)   # bytes: file-name globs kept when walking directories
  c.data.heldout_fraction = 0.05  # bytes: share of documents held out; token_file: tail share if no held-out file
  c.data.max_bytes = 0          # bytes: stop reading after this many bytes (0 = all)
  c.data.token_file = ""        # token_file: path of the training ids
  c.data.token_dtype = "uint16"  # token_file: "uint16" or "uint32"
  c.data.heldout_token_file = ""  # token_file: held-out ids (empty = tail of token_file)
  c.data.vocab_size = 0         # token_file / mqar: vocabulary of the data (0 for bytes: 256)
  c.data.mqar_num_kv_pairs = 8  # mqar: key-value pairs per sequence
  c.data.mqar_num_queries = 0   # mqar: queries per sequence (0 = as many as fit, <= pairs)

  c.optim = ml_collections.ConfigDict()
  c.optim.learning_rate = 3e-3  # peak learning rate after warmup
  c.optim.end_lr_fraction = 0.1  # final learning rate as a fraction of the peak (cosine decay)
  c.optim.warmup_steps = 20     # linear warmup steps from 0
  c.optim.b1 = 0.9              # AdamW first-moment decay
  c.optim.b2 = 0.95             # AdamW second-moment decay
  c.optim.eps = 1e-8            # AdamW epsilon
  c.optim.weight_decay = 0.1    # decoupled weight decay on matrices only
  c.optim.grad_clip = 1.0       # global gradient-norm clip
  return c
