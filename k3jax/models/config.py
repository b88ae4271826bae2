"""ModelConfig: the frozen description of a hybrid K3 model."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from k3jax.layers.gates import GATES
from k3jax.layers.grouped_matmul import RAGGED_BACKENDS
from k3jax.layers.moe import MOE_IMPLS
from k3jax.layers.residual import STRATEGIES as RESIDUALS
from k3jax.routing.config import RouterConfig
from pallas_kernels.kda.decode import DECODE_IMPLEMENTATIONS
from pallas_kernels.kda.spec import KdaSpec

LAYER_KINDS = ("K", "A")  # K: KDA token mixer, A: softmax attention
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The model's KDA default: KdaSpec's tiling with the bounded gate at g_min = -5
# (|-5| * (16 - 1) = 75 <= 85: dense diagonal tiles of 16 rows are safe).
DEFAULT_KDA = KdaSpec(lower_bound=-5.0)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hybrid decoder: KDA / attention mixers, MoE FFNs, a residual strategy."""

  # Vocabulary size V of token ids and logits.
  vocab_size: int = 256
  # Model (residual stream) width D.
  d_model: int = 256
  # Number of decoder layers; each has a token mixer and an FFN sublayer.
  num_layers: int = 4
  # Mixer kinds over {"K", "A"}, repeated (and truncated) to num_layers.
  layer_pattern: str = "KKKA"
  # Heads of both mixers (query heads for attention).
  num_heads: int = 4
  # Per-head width (KDA key and value width, attention head width).
  head_dim: int = 64
  # Attention key/value heads (GQA); must divide num_heads.
  num_kv_heads: int = 4
  # Width of KDA's short causal depthwise convolutions.
  conv_size: int = 4
  # KDA's chunk_kda choices, whole (`pallas_kernels.kda.spec.KdaSpec`): chunk and
  # diagonal-tile lengths, diagonal strategy, implementation, and the gate's lower
  # bound. A bound makes the gate the bounded `lower_bound * sigmoid(.)`; None makes
  # it the unbounded softplus baseline, which needs diagonal="pairwise". The
  # trainer config spells these fields flat (`TRAINER_KDA_KEYS`).
  kda: KdaSpec = DEFAULT_KDA
  # How decoding steps the KDA state: "auto" (on the GPU the decode kernel for
  # steps of 2 or more tokens at a power-of-two head width, else the fused jnp
  # step; `kda_decode.resolve_decode`), "pallas" (the decode kernel), "fused" or
  # "naive" (the reference token loop; `pallas_kernels.kda.decode`).
  kda_decode: str = "auto"
  # Bounded gate with the pallas path only: apply lower_bound * sigmoid(.) inside the
  # gate-cumsum kernels instead of writing the f32 gate (same values; off until
  # timed on a GPU, `experiments/bench/bench_gate_fusion.py`).
  kda_fuse_gate: bool = False
  # Routed experts per MoE layer; 0 makes every FFN a dense SwiGLU.
  num_experts: int = 8
  # Experts each token is routed to.
  top_k: int = 2
  # Hidden width of each routed (and shared) expert.
  expert_hidden: int = 256
  # Always-on shared experts per MoE layer.
  num_shared_experts: int = 1
  # Layer 0's FFN is a dense SwiGLU instead of an MoE.
  first_layer_dense: bool = True
  # Hidden width of dense SwiGLU FFNs.
  dense_hidden: int = 1024
  # Router of every MoE layer.
  router: RouterConfig = dataclasses.field(default_factory=RouterConfig)
  # MoE expert path: "buffered" (capacity mode: per-expert buffers of the
  # router's capacity and one batched matmul; needs router.capacity_factor),
  # "ragged" (dropless mode: grouped matmul on tokens sorted by expert; the
  # GPU presets' choice, `configs/gpu_base.py`), "dense" (reference).
  moe_impl: str = "ragged"
  # Grouped-matmul backend of the ragged mode: "auto" ("pallas" on NVIDIA
  # GPUs, XLA's ragged_dot elsewhere; see grouped_matmul.resolve_backend),
  # "xla", "tokamax" (tokamax's kernel; opt-in, see grouped_matmul) or
  # "pallas" (the project's grouped matmuls, `pallas_kernels.gmm`; the one
  # backend that also serves "buffered").
  moe_grouped_backend: str = "auto"
  # Residual strategy: "prenorm", "block_attnres" or "full_attnres".
  residual: str = "prenorm"
  # Sublayers per block of block_attnres (each layer has two sublayers).
  attnres_block_size: int = 4
  # Share the embedding matrix with the output projection.
  tie_embeddings: bool = True
  # Activation/compute dtype: "float32" or "bfloat16" (gates, norms,
  # softmax, KDA states and logits stay float32).
  dtype: str = "float32"
  # Parameter storage dtype: "float32" or "bfloat16".
  param_dtype: str = "float32"

  def __post_init__(self):
    def positive(name):
      value = getattr(self, name)
      if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"ModelConfig.{name}={value!r}; must be a positive int")

    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "head_dim",
                 "num_kv_heads", "conv_size", "expert_hidden", "dense_hidden",
                 "attnres_block_size"):
      positive(name)
    if not self.layer_pattern or set(self.layer_pattern) - set(LAYER_KINDS):
      raise ValueError(f"ModelConfig.layer_pattern={self.layer_pattern!r}; must be a non-empty "
                       f"string over {LAYER_KINDS}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_kv_heads={self.num_kv_heads} must divide "
                       f"num_heads={self.num_heads}")
    if not isinstance(self.kda, KdaSpec):  # a KdaSpec checked itself when it was built
      raise ValueError(f"ModelConfig.kda must be a KdaSpec, got {type(self.kda).__name__}")
    if self.kda_decode != "auto" and self.kda_decode not in DECODE_IMPLEMENTATIONS:
      raise ValueError(f"ModelConfig.kda_decode={self.kda_decode!r}; allowed: 'auto', "
                       f"{', '.join(map(repr, DECODE_IMPLEMENTATIONS))}")
    if self.kda_fuse_gate and not self.kda.bounded:  # the one check of the pair
      raise ValueError("ModelConfig.kda_fuse_gate=True needs gate='bounded' (the kernels fuse "
                       "lower_bound * sigmoid), got gate='softplus' (a spec without lower_bound); "
                       "set kda_fuse_gate=False or gate='bounded' with a g_min")
    if not (isinstance(self.num_experts, int) and self.num_experts >= 0):
      raise ValueError(f"ModelConfig.num_experts={self.num_experts!r}; must be an int >= 0")
    if self.num_experts > 0 and not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f"ModelConfig.top_k={self.top_k!r}; must be in [1, num_experts="
                       f"{self.num_experts}]")
    if not (isinstance(self.num_shared_experts, int) and self.num_shared_experts >= 0):
      raise ValueError(f"ModelConfig.num_shared_experts={self.num_shared_experts!r}; "
                       "must be an int >= 0")
    if not isinstance(self.router, RouterConfig):
      raise ValueError(f"ModelConfig.router must be a RouterConfig, got {type(self.router)}")
    if self.moe_impl not in MOE_IMPLS:
      raise ValueError(f"ModelConfig.moe_impl={self.moe_impl!r}; allowed: {MOE_IMPLS}")
    if self.moe_grouped_backend not in RAGGED_BACKENDS:
      raise ValueError(f"ModelConfig.moe_grouped_backend={self.moe_grouped_backend!r}; "
                       f"allowed: {RAGGED_BACKENDS}")
    if self.moe_impl == "buffered" and self.router.capacity_factor is None:
      raise ValueError("ModelConfig.moe_impl='buffered' sizes its buffers by the router's "
                       "capacity_factor, which is None (dropless); set one or use 'ragged'")
    if self.residual not in RESIDUALS:
      raise ValueError(f"ModelConfig.residual={self.residual!r}; allowed: {RESIDUALS}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; allowed: {tuple(DTYPES)}")

  # -- derived ---------------------------------------------------------------

  @property
  def gate(self) -> str:
    """The KDA gate `kda.lower_bound` implies: "bounded" with a bound, else "softplus"."""
    return "bounded" if self.kda.bounded else "softplus"

  @property
  def layer_types(self) -> tuple[str, ...]:
    """Mixer kind ("K" or "A") of each of the num_layers layers."""
    reps = -(-self.num_layers // len(self.layer_pattern))
    return tuple((self.layer_pattern * reps)[:self.num_layers])

  @property
  def num_sublayers(self) -> int:
    """Mixer + FFN per layer."""
    return 2 * self.num_layers

  def is_moe_layer(self, layer: int) -> bool:
    """Whether layer `layer`'s FFN is a mixture of experts."""
    return self.num_experts > 0 and not (layer == 0 and self.first_layer_dense)

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def params_dtype(self):
    return DTYPES[self.param_dtype]

  # -- construction ----------------------------------------------------------

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
    """Builds a config from the trainer's flat mapping (e.g. an ml_collections dict).

    The KDA spec comes from the flat keys of `TRAINER_KDA_KEYS` (`kda` itself
    may be given instead, as a KdaSpec or a mapping of its fields); `router`
    may be a RouterConfig or a mapping of its fields. Unknown keys are
    rejected by name.
    """
    d = dict(d)
    known = set(trainer_keys()) | {"kda"}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ValueError(f"unknown ModelConfig keys {unknown}; allowed: {sorted(known)}")
    d["kda"] = _kda_from_flat(d)
    router = d.get("router")
    if router is not None and not isinstance(router, RouterConfig):
      router = dict(router)
      r_known = {f.name for f in dataclasses.fields(RouterConfig)}
      r_unknown = sorted(set(router) - r_known)
      if r_unknown:
        raise ValueError(f"unknown RouterConfig keys {r_unknown}; allowed: {sorted(r_known)}")
      d["router"] = RouterConfig(**router)
    return cls(**d)

  def to_dict(self) -> dict:
    """The trainer's flat form (KDA fields as in `TRAINER_KDA_KEYS`, router as a dict), the
    inverse of `from_dict`."""
    d = dataclasses.asdict(self)
    kda = d.pop("kda")
    d.update({key: kda[field] for key, field in TRAINER_KDA_KEYS.items() if field})
    d["gate"] = self.gate
    if kda["lower_bound"] is None:
      d["g_min"] = None
    return d


# The trainer config's flat keys for `ModelConfig.kda`, each with its KdaSpec field;
# `gate` picks whether g_min is the bound ("bounded") or there is none ("softplus").
TRAINER_KDA_KEYS = {"gate": None, "g_min": "lower_bound", "kda_sub_chunk": "sub_chunk",
                    "kda_chunk_size": "chunk_size", "kda_diagonal": "diagonal",
                    "kda_implementation": "implementation"}


def trainer_keys() -> list[str]:
  """The keys of the trainer config's `model` section: every field, `kda` spelled flat."""
  return [name for f in dataclasses.fields(ModelConfig)
          for name in (TRAINER_KDA_KEYS if f.name == "kda" else (f.name,))]


def _kda_from_flat(d: dict) -> KdaSpec:
  """Pops the flat KDA keys of `d` and returns the KdaSpec they describe (or `d["kda"]`).

  Keys left out take `DEFAULT_KDA`'s fields; g_min is read for the bounded gate only.
  """
  flat = {key: d.pop(key) for key in TRAINER_KDA_KEYS if key in d}
  kda = d.get("kda")
  if kda is not None and flat:
    raise ValueError(f"ModelConfig: pass either kda or its flat keys {sorted(flat)}, not both")
  if isinstance(kda, KdaSpec):
    return kda
  if kda is not None:
    return KdaSpec(**kda)
  gate = flat.pop("gate", "bounded")
  if gate not in GATES:
    raise ValueError(f"ModelConfig.gate={gate!r}; allowed: {GATES}")
  fields = dict(dataclasses.asdict(DEFAULT_KDA),
                **{TRAINER_KDA_KEYS[key]: value for key, value in flat.items()})
  if gate == "softplus":
    fields["lower_bound"] = None
  try:
    return KdaSpec(**fields)
  except ValueError as e:
    # Named as the trainer spells them, the field to change first.
    shown = {key: fields[field] for key, field in TRAINER_KDA_KEYS.items() if field}
    lead = "g_min" if gate == "bounded" else "kda_diagonal"
    rest = ", ".join(f"{key}={value!r}" for key, value in shown.items() if key != lead)
    if gate == "softplus":
      rest = f"gate='softplus' (no bound), {rest.replace('g_min=None, ', '')}"
    raise ValueError(f"ModelConfig.{lead}={shown[lead]!r} with {rest}: {e}") from None
