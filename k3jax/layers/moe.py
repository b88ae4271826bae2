"""Mixture-of-experts SwiGLU FFN: sigmoid router, routed experts, shared expert(s).

Routed experts run on tokens sorted by expert through a grouped matmul
(`jax.lax.ragged_dot`); `impl="dense"` evaluates every expert on every token
with einsums and is the reference the grouped path is tested against.
`impl="buffered"` scatters the sorted tokens into per-expert buffers of the
router's capacity and runs one batched matmul; it needs a capacity factor.
XLA (jax 0.11) lowers `ragged_dot` on CPU and on NVIDIA GPUs by expanding it
to every expert for every row (E times the work and memory), so at scale the
buffered path is the practical one until a grouped-matmul kernel lands.
"""
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import routing
from k3jax.layers.params import logical_param
from k3jax.routing import RouterConfig
from k3jax.routing import capacity as capacity_lib

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
    impl: "ragged" (grouped matmul on sorted tokens), "buffered" (per-expert
      capacity buffers, batched matmul; needs router.capacity_factor) or
      "dense" (every expert on every token; the reference).
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
      y_nd = y_nd + _swiglu(x_nd, self.shared_gate[...], self.shared_up[...],
                            self.shared_out[...], c.dtype)
    aux = {key: stats[key] for key in
           ("max_vio", "max_vio_routed", "drop_fraction", "reassigned_fraction", "load_cv",
            "aux_loss", "load")}
    aux["dispatch_drop_fraction"] = dispatch_drop
    return y_nd.reshape(b, t, d).astype(x_btd.dtype), aux

  def _experts(self, x_nd, idx_nk, w_nk):
    """Routed experts by `impl`: ([N, d] f32, fraction of router-kept assignments the
    expert dispatch dropped; always 0 on one device, see `ExpertParallelMoE`)."""
    impl = {"ragged": self._routed_ragged, "buffered": self._routed_buffered,
            "dense": self._routed_dense}[self.config.impl]
    return impl(x_nd, idx_nk, w_nk), jnp.zeros((), jnp.float32)

  def _routed_ragged(self, x_nd, idx_nk, w_nk):
    """Sorts (token, expert) pairs by expert and runs grouped matmuls. [N, d] f32."""
    c = self.config
    n, k = idx_nk.shape
    # Dropped pairs are empty rows: they sort after every expert, outside all groups.
    expert_a = jnp.where((w_nk > 0).reshape(-1), idx_nk.reshape(-1), c.num_experts)
    token_a = jnp.arange(n * k, dtype=jnp.int32) // k
    y_a = ragged_swiglu(x_nd, token_a, expert_a, c.num_experts, self.wi_gate[...],
                        self.wi_up[...], self.wo[...], c.dtype)
    return jnp.sum((y_a * w_nk.reshape(-1)[:, None]).reshape(n, k, -1), axis=1)

  def _routed_buffered(self, x_nd, idx_nk, w_nk):
    """Per-expert buffers of the router's capacity, one batched matmul. [N, d] f32."""
    c = self.config
    n, k = idx_nk.shape
    cap = capacity_lib.expert_capacity(n, c.num_experts, k, c.router.capacity_factor)
    # Dropped pairs are empty rows. The router keeps at most `cap` per expert,
    # so kept rows always fit.
    expert_a = jnp.where((w_nk > 0).reshape(-1), idx_nk.reshape(-1), c.num_experts)
    token_a = jnp.arange(n * k, dtype=jnp.int32) // k
    y_a, _ = buffered_swiglu(x_nd, token_a, expert_a, c.num_experts, cap, self.wi_gate[...],
                             self.wi_up[...], self.wo[...], c.dtype)
    return jnp.sum((y_a * w_nk.reshape(-1)[:, None]).reshape(n, k, -1), axis=1)

  def _routed_dense(self, x_nd, idx_nk, w_nk):
    """Every expert on every token, combined by dense weights. [N, d] f32 (reference)."""
    c = self.config
    combine_ne = jnp.einsum("nke,nk->ne",
                            jax.nn.one_hot(idx_nk, c.num_experts, dtype=jnp.float32), w_nk)
    # Operands rounded to the compute dtype, products accumulated in float32:
    # the same arithmetic as the grouped path, on every backend.
    rnd = lambda a: a.astype(c.dtype).astype(jnp.float32)
    xs = rnd(x_nd)
    gate = jnp.einsum("nd,edh->neh", xs, rnd(self.wi_gate[...]))
    up = jnp.einsum("nd,edh->neh", xs, rnd(self.wi_up[...]))
    h = rnd(jax.nn.silu(gate) * up)
    y_ned = jnp.einsum("neh,ehd->ned", h, rnd(self.wo[...]))
    return jnp.einsum("ned,ne->nd", y_ned, combine_ne)


def ragged_swiglu(x_nd, src_r, expert_r, num_experts: int, wi_gate_edh, wi_up_edh, wo_ehd, dtype):
  """SwiGLU experts on rows sorted by expert, through `jax.lax.ragged_dot`.

  Row r is x_nd[src_r[r]] for expert expert_r[r] (num_experts = an empty row).

  Args:
    x_nd: [N, d]; src_r, expert_r: [R] int32.
    wi_gate_edh, wi_up_edh: [E, d, h]; wo_ehd: [E, h, d]; dtype: operand dtype.

  Returns:
    [R, d] f32 expert outputs in row order, zero on empty rows.
  """
  order = jnp.argsort(expert_r, stable=True)
  sizes = jnp.bincount(expert_r, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  xs = x_nd[src_r[order]].astype(dtype)
  gate = jax.lax.ragged_dot(xs, wi_gate_edh.astype(dtype), sizes, preferred_element_type=jnp.float32)
  up = jax.lax.ragged_dot(xs, wi_up_edh.astype(dtype), sizes, preferred_element_type=jnp.float32)
  h = (jax.nn.silu(gate) * up).astype(dtype)
  ys = jax.lax.ragged_dot(h, wo_ehd.astype(dtype), sizes, preferred_element_type=jnp.float32)
  # Rows past the last group are unspecified by ragged_dot: mask them.
  ys = jnp.where((expert_r[order] < num_experts)[:, None], ys, 0.0)
  return jnp.zeros_like(ys).at[order].set(ys)


def buffered_swiglu(x_nd, src_r, expert_r, num_experts: int, cap: int, wi_gate_edh, wi_up_edh,
                    wo_ehd, dtype):
  """SwiGLU experts on rows grouped into per-expert buffers, one batched matmul.

  Row r is x_nd[src_r[r]] for expert expert_r[r] (num_experts = an empty row).
  Each expert's rows fill its `cap` slots in row order; rows past them overflow.

  Args:
    x_nd: [N, d]; src_r, expert_r: [R] int32.
    wi_gate_edh, wi_up_edh: [E, d, h]; wo_ehd: [E, h, d]; dtype: operand dtype.

  Returns:
    ([R, d] f32 expert outputs in row order, zero on empty and overflowing rows;
    [R] bool, the row overflowed its expert's buffer).
  """
  rows = expert_r.shape[0]
  order = jnp.argsort(expert_r, stable=True)
  e_sorted = expert_r[order]
  sizes = jnp.bincount(expert_r, length=num_experts + 1)
  starts = jnp.cumsum(sizes) - sizes
  pos = jnp.arange(rows, dtype=jnp.int32) - starts[e_sorted]
  real = e_sorted < num_experts
  fits = real & (pos < cap)
  slot = jnp.where(fits, e_sorted * cap + pos, num_experts * cap)
  buf = jnp.zeros((num_experts * cap, x_nd.shape[1]), dtype).at[slot].set(
      x_nd[src_r[order]].astype(dtype), mode="drop").reshape(num_experts, cap, -1)
  gate = jnp.einsum("ecd,edh->ech", buf, wi_gate_edh.astype(dtype), preferred_element_type=jnp.float32)
  up = jnp.einsum("ecd,edh->ech", buf, wi_up_edh.astype(dtype), preferred_element_type=jnp.float32)
  h = (jax.nn.silu(gate) * up).astype(dtype)
  out = jnp.einsum("ech,ehd->ecd", h, wo_ehd.astype(dtype),
                   preferred_element_type=jnp.float32).reshape(num_experts * cap, -1)
  ys = jnp.where(fits[:, None], out[jnp.minimum(slot, num_experts * cap - 1)], 0.0)
  overflow = jnp.zeros((rows,), bool).at[order].set(real & ~fits)
  return jnp.zeros_like(ys).at[order].set(ys), overflow


def _swiglu(x_nd, w_gate, w_up, w_out, dtype):
  """Dense SwiGLU, [N, d] -> [N, d] float32."""
  xs = x_nd.astype(dtype)
  gate = jnp.dot(xs, w_gate.astype(dtype), preferred_element_type=jnp.float32)
  up = jnp.dot(xs, w_up.astype(dtype), preferred_element_type=jnp.float32)
  h = (jax.nn.silu(gate) * up).astype(dtype)
  return jnp.dot(h, w_out.astype(dtype), preferred_element_type=jnp.float32)
