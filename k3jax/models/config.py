"""ModelConfig: the frozen description of a hybrid K3 model."""
from __future__ import annotations

import dataclasses
import functools
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
  # KDA log-decay gate: "bounded" (g_min * sigmoid) or "softplus" baseline.
  gate: str = "bounded"
  # Lower bound of the bounded gate; must be safe for kda_sub_chunk.
  g_min: float = -5.0
  # Chunk length of the chunked KDA scan.
  kda_chunk_size: int = 64
  # Diagonal sub-tile length inside a chunk (the tile the bound protects).
  kda_sub_chunk: int = 16
  # Diagonal-tile strategy: "dense" (needs the bounded gate) or "pairwise".
  kda_diagonal: str = "dense"
  # chunk_kda implementation: "xla", "pallas" or "naive" (recurrent loop;
  # `pallas_kernels.kda.spec.IMPLEMENTATIONS`).
  kda_implementation: str = "xla"
  # How decoding steps the KDA state: "auto" (the fused jnp step), "pallas"
  # (the decode kernel, opt-in until timed on a GPU), "fused" or "naive" (the
  # reference token loop; `pallas_kernels.kda.decode`).
  kda_decode: str = "auto"
  # Bounded gate with the pallas path only: apply g_min * sigmoid(.) inside the
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
  # router's capacity and one batched matmul; needs router.capacity_factor;
  # the GPU presets' choice), "ragged" (dropless mode: grouped matmul on
  # tokens sorted by expert), "dense" (reference).
  moe_impl: str = "ragged"
  # Grouped-matmul backend of the ragged mode: "auto" (= "xla", XLA's
  # ragged_dot), "tokamax" (tokamax's kernel; opt-in, see grouped_matmul) or
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
                 "num_kv_heads", "conv_size", "kda_chunk_size", "kda_sub_chunk",
                 "expert_hidden", "dense_hidden", "attnres_block_size"):
      positive(name)
    if not self.layer_pattern or set(self.layer_pattern) - set(LAYER_KINDS):
      raise ValueError(f"ModelConfig.layer_pattern={self.layer_pattern!r}; must be a non-empty "
                       f"string over {LAYER_KINDS}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_kv_heads={self.num_kv_heads} must divide "
                       f"num_heads={self.num_heads}")
    if self.gate not in GATES:
      raise ValueError(f"ModelConfig.gate={self.gate!r}; allowed: {GATES}")
    if self.gate == "bounded" and not self.g_min < 0:
      raise ValueError(f"ModelConfig.g_min={self.g_min!r}; the bounded gate needs g_min < 0")
    if self.gate == "softplus" and self.kda_diagonal == "dense":
      raise ValueError("ModelConfig.gate='softplus' is unbounded and needs "
                       "kda_diagonal='pairwise', got 'dense'")
    try:
      self.kda_spec  # pylint: disable=pointless-statement  (built and validated once)
    except ValueError as e:
      raise ValueError(f"ModelConfig.g_min={self.g_min} with kda_sub_chunk="
                       f"{self.kda_sub_chunk}, kda_chunk_size={self.kda_chunk_size}, "
                       f"kda_diagonal={self.kda_diagonal!r}, kda_implementation="
                       f"{self.kda_implementation!r}: {e}") from None
    if self.kda_decode != "auto" and self.kda_decode not in DECODE_IMPLEMENTATIONS:
      raise ValueError(f"ModelConfig.kda_decode={self.kda_decode!r}; allowed: 'auto', "
                       f"{', '.join(map(repr, DECODE_IMPLEMENTATIONS))}")
    if self.kda_fuse_gate and self.gate != "bounded":
      raise ValueError(f"ModelConfig.kda_fuse_gate=True needs gate='bounded' (the kernels fuse "
                       f"g_min * sigmoid), got gate={self.gate!r}")
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

  @functools.cached_property
  def kda_spec(self) -> KdaSpec:
    """The KDA layers' chunk_kda choices, validated once (by `KdaSpec`); the
    lower bound is g_min for the bounded gate, None for the unbounded one."""
    return KdaSpec(chunk_size=self.kda_chunk_size, sub_chunk=self.kda_sub_chunk,
                   diagonal=self.kda_diagonal,
                   lower_bound=self.g_min if self.gate == "bounded" else None,
                   implementation=self.kda_implementation)

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
    """Builds a config from a plain mapping (e.g. an ml_collections dict).

    `router` may be a RouterConfig or a mapping of its fields. Unknown keys are
    rejected by name.
    """
    d = dict(d)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ValueError(f"unknown ModelConfig keys {unknown}; allowed: {sorted(known)}")
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
    """Plain nested dict (router as a dict), the inverse of `from_dict`."""
    return dataclasses.asdict(self)
