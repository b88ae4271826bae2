"""ModelConfig: the frozen description of a hybrid K3 model."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from k3jax.layers.grouped_matmul import RAGGED_BACKENDS
from k3jax.layers.moe import MOE_IMPLS
from k3jax.layers.residual import STRATEGIES as RESIDUALS
from k3jax.routing.config import RouterConfig
from pallas_kernels.kda.decode import DECODE_IMPLEMENTATIONS
from pallas_kernels.kda.spec import KdaSpec

LAYER_KINDS = ("K", "A")  # K: KDA token mixer, A: softmax attention
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The model's KDA default: KdaSpec's tiling with the bounded gate at lower_bound = -5
# (|-5| * (16 - 1) = 75 <= 85: dense diagonal tiles of 16 rows are safe).
DEFAULT_KDA = KdaSpec(lower_bound=-5.0)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hybrid decoder: KDA / attention mixers, MoE FFNs, a residual strategy.

  Each check's message starts with the field's path below the config
  (`num_kv_heads=3 ...`, `kda.lower_bound=...`, `router.name=...`), so that a
  caller holding the config at a path (the trainer's `model`) names the key by
  putting that path in front.
  """

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
  # trainer config's section `model.kda` holds the same fields by the same names.
  kda: KdaSpec = DEFAULT_KDA
  # How decoding steps the KDA state: "auto" (on the GPU the decode kernel at a
  # power-of-two head width for steps of 2 or more tokens or batches of many
  # states, else the fused jnp step; `kda_decode.resolve_decode`), "pallas" (the
  # decode kernel), "fused" or "naive" (the reference token loop;
  # `pallas_kernels.kda.decode`).
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
        raise ValueError(f"{name}={value!r}; must be a positive int")

    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "head_dim",
                 "num_kv_heads", "conv_size", "expert_hidden", "dense_hidden",
                 "attnres_block_size"):
      positive(name)
    if not self.layer_pattern or set(self.layer_pattern) - set(LAYER_KINDS):
      raise ValueError(f"layer_pattern={self.layer_pattern!r}; must be a non-empty "
                       f"string over {LAYER_KINDS}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide "
                       f"num_heads={self.num_heads}")
    if not isinstance(self.kda, KdaSpec):  # a KdaSpec checked itself when it was built
      raise ValueError(f"kda must be a KdaSpec, got {type(self.kda).__name__}")
    if self.kda_decode != "auto" and self.kda_decode not in DECODE_IMPLEMENTATIONS:
      raise ValueError(f"kda_decode={self.kda_decode!r}; allowed: 'auto', "
                       f"{', '.join(map(repr, DECODE_IMPLEMENTATIONS))}")
    if self.kda_fuse_gate and not self.kda.bounded:  # the one check of the pair
      raise ValueError("kda_fuse_gate=True needs the bounded gate (the kernels fuse "
                       "lower_bound * sigmoid), got kda.lower_bound=None (the softplus gate); "
                       "set kda_fuse_gate=False or a kda.lower_bound")
    if not (isinstance(self.num_experts, int) and self.num_experts >= 0):
      raise ValueError(f"num_experts={self.num_experts!r}; must be an int >= 0")
    if self.num_experts > 0 and not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f"top_k={self.top_k!r}; must be in [1, num_experts="
                       f"{self.num_experts}]")
    if not (isinstance(self.num_shared_experts, int) and self.num_shared_experts >= 0):
      raise ValueError(f"num_shared_experts={self.num_shared_experts!r}; "
                       "must be an int >= 0")
    if not isinstance(self.router, RouterConfig):
      raise ValueError(f"router must be a RouterConfig, got {type(self.router)}")
    if self.moe_impl not in MOE_IMPLS:
      raise ValueError(f"moe_impl={self.moe_impl!r}; allowed: {MOE_IMPLS}")
    if self.moe_grouped_backend not in RAGGED_BACKENDS:
      raise ValueError(f"moe_grouped_backend={self.moe_grouped_backend!r}; "
                       f"allowed: {RAGGED_BACKENDS}")
    if self.moe_impl == "buffered" and self.router.capacity_factor is None:
      raise ValueError("moe_impl='buffered' sizes its buffers by router.capacity_factor, "
                       "which is None (dropless); set one or use 'ragged'")
    if self.residual not in RESIDUALS:
      raise ValueError(f"residual={self.residual!r}; allowed: {RESIDUALS}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"{name}={getattr(self, name)!r}; allowed: {tuple(DTYPES)}")

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
    """Builds a config from a nested mapping of its fields (the inverse of `to_dict`).

    `kda` may be a KdaSpec or a mapping of its fields (those left out take
    `DEFAULT_KDA`'s), `router` a RouterConfig or a mapping of its fields;
    other fields left out take their defaults. Unknown keys are rejected by
    name; an error inside `kda` or `router` is named by its path
    (`kda.lower_bound=...`).
    """
    d = dict(d)
    _reject_unknown(d, cls, "")
    kda, router = d.get("kda"), d.get("router")
    if isinstance(kda, Mapping):
      d["kda"] = _build(KdaSpec, dataclasses.asdict(DEFAULT_KDA) | dict(kda), "kda.")
    if isinstance(router, Mapping):
      d["router"] = _build(RouterConfig, dict(router), "router.")
    return cls(**d)

  def to_dict(self) -> dict:
    """Every field as a plain nested dict (`kda` and `router` as dicts of their fields)."""
    return dataclasses.asdict(self)


def _reject_unknown(d: Mapping[str, Any], cls, where: str) -> None:
  allowed = sorted(f.name for f in dataclasses.fields(cls))
  unknown = sorted(set(d) - set(allowed))
  if unknown:
    raise ValueError(f"{where}{unknown[0]}: unknown key {unknown}; allowed: {allowed}")


def _build(cls, d: dict, where: str):
  """`cls(**d)`, its errors led by the section's path `where` ("kda.")."""
  _reject_unknown(d, cls, where)
  try:
    return cls(**d)
  except ValueError as e:
    raise ValueError(f"{where}{e}") from None
