"""Mixture-of-experts SwiGLU FFN: sigmoid router, routed experts, shared expert(s).

The router (`k3jax.routing`) picks each token's k experts and combine
weights; the routed experts then run on the layer's `MoEPath`
(`moe_path`), built once from the config: "buffered" (capacity mode),
"ragged" (dropless mode) or "dense" (the reference the grouped modes are
tested against), locally or, with `MoEConfig.expert_parallel`, sharded over
a mesh axis.
"""
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import routing
from k3jax.layers import grouped_matmul
from k3jax.layers import moe_path
from k3jax.layers.ffn import swiglu
from k3jax.layers.params import logical_param
from k3jax.routing import RouterConfig
from pallas_kernels.gmm.config import GmmConfig

MOE_IMPLS = moe_path.IMPLS


class RouterState(nnx.Variable):
  """Non-trainable carried router state (the per-expert bias of stateful routers)."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Shape and routing of one MoE FFN.

  Attributes:
    d_model: model width.
    num_experts: routed experts E.
    top_k: routed experts per token.
    expert_hidden: SwiGLU width of one routed expert.
    num_shared_experts: always-on experts (merged into one SwiGLU of width
      num_shared_experts * shared_hidden).
    shared_hidden: width of one shared expert; None means expert_hidden.
    router: RouterConfig.
    impl: "buffered" (capacity mode: per-expert buffers of the router's
      capacity, one batched matmul; needs router.capacity_factor), "ragged"
      (dropless mode: grouped matmul on tokens sorted by expert) or "dense"
      (every expert on every token; the reference).
    grouped_backend: grouped-matmul backend, one of `grouped_matmul.BACKENDS`
      ("auto": einsum for "buffered"; for "ragged", "pallas" on NVIDIA
      GPUs and XLA's ragged_dot elsewhere, `grouped_matmul.resolve_backend`;
      "tokamax" is opt-in, see `grouped_matmul`; "pallas": our grouped
      matmuls for either mode, `routed_gmm`).
    gmm_config: tiles of the "pallas" backend (None: the heuristic,
      `pallas_kernels.gmm.config.default_config`).
    dtype: compute dtype of the expert matmuls (accumulation is float32).
    param_dtype: parameter dtype.
    expert_parallel: None runs the routed experts on each device's tokens;
      a `moe_path.ExpertParallel` shards them over its mesh axis when the
      layer runs under a mesh where that axis is > 1 (same parameters).
  """

  d_model: int
  num_experts: int
  top_k: int
  expert_hidden: int
  num_shared_experts: int = 0
  shared_hidden: int | None = None
  router: RouterConfig = dataclasses.field(default_factory=RouterConfig)
  impl: str = "ragged"
  grouped_backend: str = "auto"
  gmm_config: GmmConfig | None = None
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  expert_parallel: moe_path.ExpertParallel | None = None

  def __post_init__(self):
    for name in ("d_model", "num_experts", "top_k", "expert_hidden"):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"MoEConfig.{name}={value!r}; must be an int >= 1")
    if self.top_k > self.num_experts:
      raise ValueError(
          f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}")
    if not (isinstance(self.num_shared_experts, int) and self.num_shared_experts >= 0):
      raise ValueError(
          f"MoEConfig.num_shared_experts={self.num_shared_experts!r}; must be an int >= 0")
    if self.shared_hidden is not None and not (
        isinstance(self.shared_hidden, int) and self.shared_hidden >= 1):
      raise ValueError(
          f"MoEConfig.shared_hidden={self.shared_hidden!r}; must be an int >= 1 or None")
    if not isinstance(self.router, RouterConfig):
      raise ValueError(f"MoEConfig.router must be a RouterConfig, got {self.router!r}")
    if self.impl not in MOE_IMPLS:
      raise ValueError(f"MoEConfig.impl={self.impl!r}; allowed: {MOE_IMPLS}")
    if self.grouped_backend not in grouped_matmul.BACKENDS:
      raise ValueError(f"MoEConfig.grouped_backend={self.grouped_backend!r}; allowed: "
                       f"{grouped_matmul.BACKENDS}")
    if self.impl == "buffered" and self.grouped_backend not in ("auto", "einsum", "pallas"):
      raise ValueError(f"MoEConfig.impl='buffered' runs its buffers through the batched "
                       f"einsum or the 'pallas' grouped matmuls; grouped_backend="
                       f"{self.grouped_backend!r} is for impl='ragged'")
    if self.grouped_backend == "pallas":
      for name in ("d_model", "expert_hidden"):
        if getattr(self, name) % 16:
          raise ValueError(f"MoEConfig.{name}={getattr(self, name)} must be a multiple of 16 "
                           "for grouped_backend='pallas' (tensor-core tiles): pad it, or use "
                           "grouped_backend='auto'")
    if self.gmm_config is not None and not isinstance(self.gmm_config, GmmConfig):
      raise ValueError(f"MoEConfig.gmm_config must be a GmmConfig or None, got "
                       f"{self.gmm_config!r}")
    if self.impl == "ragged" and self.grouped_backend not in grouped_matmul.RAGGED_BACKENDS:
      raise ValueError("MoEConfig.impl='ragged' has no buffers for grouped_backend='einsum'; "
                       "use 'auto', 'pallas', 'xla' or 'tokamax', or impl='buffered'")
    if self.impl == "buffered" and self.router.capacity_factor is None:
      raise ValueError(
          "MoEConfig.impl='buffered' needs router.capacity_factor (buffer size); "
          "got None (dropless): use impl='ragged' or set a capacity factor")
    if self.expert_parallel is not None and not isinstance(self.expert_parallel,
                                                           moe_path.ExpertParallel):
      raise ValueError(f"MoEConfig.expert_parallel must be a moe_path.ExpertParallel or None, "
                       f"got {self.expert_parallel!r}")

  def path(self) -> moe_path.MoEPath:
    """The routed experts' execution path these settings choose, with the
    grouped backend resolved here, once, for this layout and platform."""
    backend = None if self.impl == "dense" else grouped_matmul.resolve_backend(
        self.grouped_backend, ragged=self.impl == "ragged",
        pallas_widths=(self.d_model, self.expert_hidden))
    return moe_path.MoEPath(impl=self.impl, capacity_factor=self.router.capacity_factor,
                            grouped_backend=backend, gmm_config=self.gmm_config,
                            dtype=self.dtype, expert_parallel=self.expert_parallel)


class MoE(nnx.Module):
  """Routed SwiGLU experts + optional shared experts.

  Parameters and their logical axes:
    router_kernel [d, E] ("embed", None): small, kept replicated over experts.
    wi_gate, wi_up [E, d, h] ("expert", "embed", "mlp"); wo [E, h, d]
    ("expert", "mlp", "embed"); shared_* [d, hs] ("embed", "mlp") and
    [hs, d] ("mlp", "embed").

  `path` (a `moe_path.MoEPath`, built here from the config) runs the routed
  experts, locally or expert-parallel; the parameters are the same for both.
  """

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
    self.config = config
    c = config
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                             in_axis=-2, out_axis=-1)
    e, d, h = c.num_experts, c.d_model, c.expert_hidden
    param = lambda shape, axes, dtype=c.param_dtype: logical_param(rngs, init, shape, axes, dtype)
    self.router_kernel = param((d, e), ("embed", None), jnp.float32)
    self.wi_gate = param((e, d, h), ("expert", "embed", "mlp"))
    self.wi_up = param((e, d, h), ("expert", "embed", "mlp"))
    self.wo = param((e, h, d), ("expert", "mlp", "embed"))
    if c.num_shared_experts:
      hs = c.num_shared_experts * (c.shared_hidden or c.expert_hidden)
      self.shared_gate = param((d, hs), ("embed", "mlp"))
      self.shared_up = param((d, hs), ("embed", "mlp"))
      self.shared_out = param((hs, d), ("mlp", "embed"))
    else:
      self.shared_gate = self.shared_up = self.shared_out = None
    state = routing.init_router_state(c.num_experts, c.router)
    self.router_state = None if state is None else RouterState(state)
    self.path = c.path()

  def __call__(self, x_btd: jax.Array, *, deterministic: bool = False, segments=None):
    """Applies the layer.

    Args:
      x_btd: [B, T, d] input.
      deterministic: eval mode; the router state is read but not updated.
      segments: the rows' documents (`k3jax.layers.segments.Segments`) or
        None. Padding tokens (segment id 0) are masked out of routing
        (`route(..., token_mask_t=...)`): no expert, no capacity, no part in
        thresholds, biases or statistics, so the real tokens route as if the
        padding were absent. Their routed output is 0; the shared experts
        still run on them (masked from the loss by the caller).

    Returns:
      y_btd: [B, T, d] in x's dtype.
      aux: dict of float32 scalars max_vio, max_vio_routed, drop_fraction,
        reassigned_fraction, load_cv, aux_loss (0 for routers without one),
        dispatch_drop_fraction (expert-parallel dispatch drops; 0 on one device),
        and load [E].
    """
    c = self.config
    if x_btd.ndim != 3 or x_btd.shape[-1] != c.d_model:
      raise ValueError(f"x must have shape [B, T, {c.d_model}], got {x_btd.shape}")
    b, t, d = x_btd.shape
    x_nd = x_btd.reshape(b * t, d)
    scores_ne = jax.nn.sigmoid(
        jnp.dot(x_nd.astype(jnp.float32), self.router_kernel[...].astype(jnp.float32)))
    state = None if self.router_state is None else self.router_state.get_value()
    mask_n = None if segments is None else segments.token_mask_bt().reshape(b * t)
    idx_nk, w_nk, stats, new_state = routing.route(
        scores_ne, k=c.top_k, config=c.router, state=state, token_mask_t=mask_n)
    if self.router_state is not None and not deterministic:
      self.router_state.set_value(new_state)
    y_nd, dispatch_drop = self.path(x_nd, idx_nk, w_nk, self.wi_gate[...], self.wi_up[...],
                                    self.wo[...])
    if self.shared_gate is not None:
      y_nd = y_nd + swiglu(x_nd, self.shared_gate[...], self.shared_up[...],
                           self.shared_out[...], c.dtype)
    aux = {key: stats[key] for key in
           ("max_vio", "max_vio_routed", "drop_fraction", "reassigned_fraction", "load_cv",
            "aux_loss", "load")}
    aux["dispatch_drop_fraction"] = dispatch_drop
    return y_nd.reshape(b, t, d).astype(x_btd.dtype), aux
