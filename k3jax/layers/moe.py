"""Mixture-of-experts SwiGLU FFN: sigmoid router, routed experts, shared expert(s).

The routed experts run in one of two modes (`impl`):

- "buffered" (capacity mode): every expert has ceil(cf * N * k / E) slots,
  the same capacity the router enforces, so every kept assignment fits and
  one batched matmul runs over the [E, capacity, d] buffers. The quantile
  router keeps expert loads even, so a tight factor (1.0-1.25) wastes little;
  the GPU presets use this mode.
- "ragged" (dropless mode): tokens sorted by expert in groups of any size,
  through a grouped matmul (`grouped_matmul`: XLA's `ragged_dot`, or
  tokamax's kernel on request).

Both share one dispatch and combine (`moe_dispatch`): each token row is
gathered once into the grouped layout, and each token's k expert rows are
gathered back and summed with the combine weights, in the compute dtype and
with gathers in the backward too. `impl="dense"` evaluates every expert on
every token and is the reference the grouped modes are tested against.
"""
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import routing
from k3jax.layers import grouped_matmul
from k3jax.layers import moe_dispatch
from k3jax.layers import routed_gmm
from k3jax.layers.ffn import swiglu
from k3jax.layers.params import logical_param
from k3jax.routing import RouterConfig
from k3jax.routing import capacity as capacity_lib
from pallas_kernels.gmm.config import GmmConfig

MOE_IMPLS = ("ragged", "buffered", "dense")


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
      ("auto": einsum for "buffered", XLA's ragged_dot for "ragged";
      "tokamax" is opt-in, see `grouped_matmul`; "pallas": our grouped
      matmuls for either mode, `routed_gmm`).
    gmm_config: tiles of the "pallas" backend (None: the heuristic,
      `pallas_kernels.gmm.config.default_config`).
    dtype: compute dtype of the expert matmuls (accumulation is float32).
    param_dtype: parameter dtype.
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
                       "use 'auto', 'xla' or 'tokamax', or impl='buffered'")
    if self.impl == "buffered" and self.router.capacity_factor is None:
      raise ValueError(
          "MoEConfig.impl='buffered' needs router.capacity_factor (buffer size); "
          "got None (dropless): use impl='ragged' or set a capacity factor")


class MoE(nnx.Module):
  """Routed SwiGLU experts + optional shared experts.

  Parameters and their logical axes:
    router_kernel [d, E] ("embed", None): small, kept replicated over experts.
    wi_gate, wi_up [E, d, h] ("expert", "embed", "mlp"); wo [E, h, d]
    ("expert", "mlp", "embed"); shared_* [d, hs] ("embed", "mlp") and
    [hs, d] ("mlp", "embed").
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

  def __call__(self, x_btd: jax.Array, *, deterministic: bool = False):
    """Applies the layer.

    Args:
      x_btd: [B, T, d] input.
      deterministic: eval mode; the router state is read but not updated.

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
    idx_nk, w_nk, stats, new_state = routing.route(
        scores_ne, k=c.top_k, config=c.router, state=state)
    if self.router_state is not None and not deterministic:
      self.router_state.set_value(new_state)
    y_nd, dispatch_drop = self._experts(x_nd, idx_nk, w_nk)
    if self.shared_gate is not None:
      y_nd = y_nd + swiglu(x_nd, self.shared_gate[...], self.shared_up[...],
                           self.shared_out[...], c.dtype)
    aux = {key: stats[key] for key in
           ("max_vio", "max_vio_routed", "drop_fraction", "reassigned_fraction", "load_cv",
            "aux_loss", "load")}
    aux["dispatch_drop_fraction"] = dispatch_drop
    return y_nd.reshape(b, t, d).astype(x_btd.dtype), aux

  def _experts(self, x_nd, idx_nk, w_nk):
    """Routed experts by `impl`: ([N, d] f32, fraction of router-kept assignments the
    expert dispatch dropped; always 0 on one device, see `ExpertParallelMoE`)."""
    routed = self._routed_dense if self.config.impl == "dense" else self._routed_grouped
    return routed(x_nd, idx_nk, w_nk), jnp.zeros((), jnp.float32)

  def _routed_grouped(self, x_nd, idx_nk, w_nk):
    """Dispatch to the grouped layout, grouped SwiGLU, weighted combine. [N, d] f32."""
    c = self.config
    n, k = idx_nk.shape
    # The router keeps at most `cap` assignments per expert (same formula), so
    # every kept assignment has a slot; "ragged" places all kept ones.
    cap = (None if c.impl == "ragged" else
           capacity_lib.expert_capacity(n, c.num_experts, k, c.router.capacity_factor))
    return routed_swiglu(x_nd, idx_nk, w_nk, self.wi_gate[...], self.wi_up[...], self.wo[...],
                         capacity=cap, backend=c.grouped_backend, dtype=c.dtype,
                         gmm_config=c.gmm_config)

  def _routed_dense(self, x_nd, idx_nk, w_nk):
    """Every expert on every token, combined by dense weights. [N, d] f32 (reference)."""
    c = self.config
    combine_ne = jnp.einsum("nke,nk->ne",
                            jax.nn.one_hot(idx_nk, c.num_experts, dtype=jnp.float32), w_nk)
    # Operands and products rounded to the compute dtype, products accumulated
    # in float32: the same arithmetic as the grouped path, on every backend.
    rnd = lambda a: a.astype(c.dtype).astype(jnp.float32)
    xs = rnd(x_nd)
    gate = rnd(jnp.einsum("nd,edh->neh", xs, rnd(self.wi_gate[...])))
    up = rnd(jnp.einsum("nd,edh->neh", xs, rnd(self.wi_up[...])))
    h = rnd(jax.nn.silu(gate) * up)
    y_ned = rnd(jnp.einsum("neh,ehd->ned", h, rnd(self.wo[...])))
    return jnp.einsum("ned,ne->nd", y_ned, combine_ne)


def routed_swiglu(x_nd, idx_nk, w_nk, wi_gate_edh, wi_up_edh, wo_ehd, *, capacity: int | None,
                  backend: str = "auto", dtype=jnp.float32, positions: str = "auto",
                  gmm_config: GmmConfig | None = None):
  """Routed SwiGLU experts: plan, dispatch, grouped matmuls, combine.

  Args:
    x_nd: [N, d] tokens.
    idx_nk: [N, k] int expert ids; w_nk: [N, k] float32 combine weights
      (0 = dropped by the router: no slot, no work).
    wi_gate_edh, wi_up_edh: [E, d, h]; wo_ehd: [E, h, d].
    capacity: slots per expert (capacity layout; assignments past it add 0),
      or None (ragged layout, dropless).
    backend: grouped-matmul backend (`grouped_matmul.BACKENDS`).
    dtype: compute dtype of the rows and products.
    positions: `moe_dispatch.plan_slots` rank method.
    gmm_config: tiles of the "pallas" backend (None: the heuristic).

  Returns:
    [N, d] float32: sum_j w[n, j] * expert_{idx[n, j]}(x[n]).
  """
  num_experts = wi_gate_edh.shape[0]
  if grouped_matmul.resolve_backend(backend, capacity=capacity) == "pallas":
    cfg = routed_gmm.kernel_config(dtype, gmm_config)
    plan = moe_dispatch.plan_slots(idx_nk, w_nk > 0, num_experts, capacity, positions=positions,
                                   align=cfg.block_m)
    return routed_gmm.routed_swiglu_gmm(x_nd, w_nk, wi_gate_edh, wi_up_edh, wo_ehd, plan,
                                        dtype=dtype, config=cfg)
  plan = moe_dispatch.plan_slots(idx_nk, w_nk > 0, num_experts, capacity, positions=positions)
  rows_sd = moe_dispatch.dispatch_rows(x_nd.astype(dtype), plan.source_s, plan.slot_nk)
  y_sd = grouped_matmul.grouped_swiglu(rows_sd, wi_gate_edh, wi_up_edh, wo_ehd,
                                       group_sizes=plan.group_sizes, capacity=capacity,
                                       backend=backend, dtype=dtype)
  return moe_dispatch.combine_rows(y_sd, w_nk, plan.slot_nk, plan.assign_s)
