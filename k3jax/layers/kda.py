"""Kimi Delta Attention (KDA) token mixer.

Per head h (docs/design.md, "Model"):
    q, k, v = silu(causal_depthwise_conv(x W_{q,k,v}))
    q, k    = l2_norm(q), l2_norm(k)
    g       = gate(x W_fa W_fb + b_f)      [B, T, H, K] float32 log-decay
    beta    = sigmoid(x W_beta)            [B, T, H]
    o       = chunk_kda(q, k, v, g, beta)  (K ** -0.5 folded into q)
    y       = (rms_norm_h(o) * sigmoid(x W_out_gate)) W_o

The gate is the bounded `lower_bound * sigmoid(.)` (the spec has a lower
bound) or the softplus baseline `-exp(A_log) * softplus(. + dt_bias)` (it has
none), from `k3jax.layers.gates`.
With `fuse_gate` the layer passes the pre-activation x W_fa W_fb and b_f to
`chunk_kda(..., gate_activation="bounded_sigmoid")`, whose gate-cumsum kernels
apply the sigmoid and its derivative, so the [B, T, H, K] float32 g is never
written (off by default until timed on the GPU: `experiments/bench/bench_gate_fusion.py`).
With `segments` (documents packed in a row) the convolutions stop at document
boundaries and the state restarts at each document: `chunk_kda(segment_ids=...)`
with the run index of each token, masks inside the chunks of the plain grid.
Decoding carries the conv windows and the [B, H, K, V] float32 state and
steps it with `pallas_kernels.kda.decode.kda_decode_step`
(`decode_implementation`).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.layers import gates
from k3jax.layers.norms import l2_norm, rms_norm
from k3jax.layers.params import fan_in_init, logical_param
from k3jax.layers.segments import Segments
from pallas_kernels import platform
from pallas_kernels.kda import api as kda_api
from pallas_kernels.kda import decode as kda_decode
from pallas_kernels.kda.spec import KdaSpec


def interprets(implementation: str) -> bool:
  """Whether the KDA path `implementation` runs its Pallas kernels emulated: the "pallas"
  path where the chunked-scan kernels have no lowering (`pallas_kernels.platform`)."""
  return implementation == "pallas" and platform.interprets("kda")


def causal_depthwise_conv(x_bthk: jax.Array, w_whk: jax.Array,
                          offsets_bm: jax.Array | None = None) -> jax.Array:
  """y[t] = sum_j w[j] * x[t - (W - 1) + j], zeros before the start.

  x_bthk: [B, T, H, K]; w_whk: [W, H, K] -> [B, T, H, K]. offsets_bm [B, M + 1]
  int32 (`Segments.offsets_bm`: each row's run starts, then T): every run
  restarts the conv, its taps reading zeros before its start, so no tap reaches
  across a document boundary.
  """
  y_bthk = _conv_from_zeros(x_bthk, w_whk)
  if offsets_bm is None or w_whk.shape[0] == 1 or offsets_bm.shape[1] <= 2:
    return y_bthk
  return _restart_runs(y_bthk, x_bthk, w_whk, offsets_bm)


def _conv_from_zeros(x_bthk: jax.Array, w_whk: jax.Array) -> jax.Array:
  """The conv of each row [B, T, H, K] with zeros before its start."""
  width = w_whk.shape[0]
  t = x_bthk.shape[1]
  xp = jnp.pad(x_bthk, ((0, 0), (width - 1, 0), (0, 0), (0, 0)))
  y = jnp.zeros_like(x_bthk)
  for j in range(width):
    y = y + xp[:, j:j + t] * w_whk[j].astype(x_bthk.dtype)
  return y


def _restart_runs(y_bthk, x_bthk, w_whk, offsets_bm):
  """`y_bthk` (the row's conv) with the first W - 1 outputs of each run after the row's
  first recomputed from the run's own inputs, zeros before its start.

  Only those B (M - 1) (W - 1) positions are gathered, convolved and scattered back, so
  the [B, T] passes and their gradients stay the plain conv's: taps masked over all of
  [B, T] made XLA fuse the weight gradients into one slow reduction (docs/benchmarks.md,
  "Packed documents"). Mapped over the rows, so the gathers and scatters carry B as a
  batch dimension and a batch-sharded row stays on its device.
  """
  width, length = w_whk.shape[0], x_bthk.shape[1]
  lead = width - 1

  def row(y_thk, x_thk, offsets_m):
    pos_mi = offsets_m[1:-1, None] + jnp.arange(lead, dtype=offsets_m.dtype)
    # A run shorter than W - 1 ends early; unused runs start at T.
    inside_mi = pos_mi < offsets_m[2:, None]
    fresh_mihk = _conv_from_zeros(x_thk.at[pos_mi].get(mode="fill", fill_value=0), w_whk)
    # Positions outside their run go to distinct indices past T (dropped), which keeps
    # every index unique: the scatter's gradient then is a plain gather.
    spare_mi = length + jnp.arange(pos_mi.size, dtype=pos_mi.dtype).reshape(pos_mi.shape)
    target_mi = jnp.where(inside_mi, pos_mi, spare_mi)
    return y_thk.at[target_mi].set(fresh_mihk, mode="drop", unique_indices=True)

  return jax.vmap(row)(y_bthk, x_bthk, offsets_bm)


def _conv_tail(x_bthk: jax.Array, width: int) -> jax.Array:
  """The last `width - 1` inputs [B, W-1, H, K], zero-padded on the left."""
  keep = width - 1
  xp = jnp.pad(x_bthk, ((0, 0), (keep, 0), (0, 0), (0, 0)))
  return xp[:, xp.shape[1] - keep:]


class KDA(nnx.Module):
  """Multi-head KDA layer. Input and output [B, T, D].

  Args:
    d_model: D.
    num_heads: H.
    head_dim: K = V (per-head key and value width).
    spec: the `chunk_kda` choices (`KdaSpec`, validated when built;
      `ModelConfig.kda`), held whole and passed to every call. Its lower bound
      picks the gate: `lower_bound * sigmoid(.)` when set, the softplus
      baseline when None (which KdaSpec allows on the pairwise diagonal only).
    conv_size: width of the short causal depthwise convolutions.
    fuse_gate: hand the bounded gate's pre-activation to the kernel (see the
      module docstring). Same values either way. It needs a bounded spec:
      `ModelConfig` checks the pair (`kda_fuse_gate`); a direct caller
      without a bound gets the bounded gate's error at the first call. Default off.
    decode_implementation: how `decode` steps the state: "auto" (on the GPU
      the Pallas kernel for steps of 2 or more tokens or batches of at least
      `kda_decode.MIN_KERNEL_STATES_ONE_TOKEN` states B * H, else the fused jnp
      step; `kda_decode.resolve_decode`) or one of
      `kda_decode.DECODE_IMPLEMENTATIONS` ("pallas" on the CPU runs the
      kernel interpreted).
    dtype: compute dtype of projections and the kernel's q/k/v.
    param_dtype: parameter dtype.
  """

  def __init__(self, d_model: int, num_heads: int, head_dim: int, *, spec: KdaSpec,
               conv_size: int = 4, fuse_gate: bool = False, decode_implementation: str = "auto",
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if not isinstance(spec, KdaSpec):
      raise TypeError(f"spec must be a KdaSpec, got {type(spec).__name__}")
    if conv_size < 1:
      raise ValueError(f"conv_size must be >= 1, got {conv_size}")
    kda_decode.resolve_decode(decode_implementation)  # fails early on an unknown name
    self.d_model, self.num_heads, self.head_dim = d_model, num_heads, head_dim
    self.conv_size, self.spec = conv_size, spec
    self.decode_implementation = decode_implementation
    self.fuse_gate = bool(fuse_gate)
    self.dtype = dtype
    h, k = num_heads, head_dim
    dense = fan_in_init(d_model)
    self.wq = logical_param(rngs, dense, (d_model, h, k), ("embed", "heads", "kv"), param_dtype)
    self.wk = logical_param(rngs, dense, (d_model, h, k), ("embed", "heads", "kv"), param_dtype)
    self.wv = logical_param(rngs, dense, (d_model, h, k), ("embed", "heads", "kv"), param_dtype)
    conv = fan_in_init(conv_size)
    self.conv_q = logical_param(rngs, conv, (conv_size, h, k), (None, "heads", "kv"), param_dtype)
    self.conv_k = logical_param(rngs, conv, (conv_size, h, k), (None, "heads", "kv"), param_dtype)
    self.conv_v = logical_param(rngs, conv, (conv_size, h, k), (None, "heads", "kv"), param_dtype)
    # Low-rank gate projection (rank = head_dim), as the gate needs H*K outputs.
    self.wf_a = logical_param(rngs, dense, (d_model, k), ("embed", None), param_dtype)
    self.wf_b = logical_param(rngs, fan_in_init(k), (k, h, k), (None, "heads", "kv"), param_dtype)
    # Gate bias: initial per-channel decays spread log-uniformly over
    # g in [-0.5, -0.01] (forgetting horizons of ~2 to ~100 tokens).
    target = -np.exp(np.random.default_rng(0).uniform(np.log(0.01), np.log(0.5), (h, k)))
    if self.bounded:
      bias = gates.bounded_gate_preactivation(target, spec)
      self.f_bias = logical_param(None, lambda *_: jnp.asarray(bias, param_dtype), (h, k),
                                  ("heads", "kv"), param_dtype)
    else:
      # g = -exp(A_log) * softplus(z + dt_bias); A = 1, softplus(dt_bias) = -target.
      dt_bias = np.log(np.expm1(-target))
      self.a_log = logical_param(None, jax.nn.initializers.zeros, (h,), ("heads",), param_dtype)
      self.f_bias = logical_param(None, lambda *_: jnp.asarray(dt_bias, param_dtype), (h, k),
                                  ("heads", "kv"), param_dtype)
    self.wb = logical_param(rngs, dense, (d_model, h), ("embed", "heads"), param_dtype)
    self.w_og = logical_param(rngs, dense, (d_model, h, k), ("embed", "heads", "kv"), param_dtype)
    self.o_norm = logical_param(None, jax.nn.initializers.ones, (k,), ("kv",), param_dtype)
    self.wo = logical_param(rngs, fan_in_init(h * k), (h, k, d_model), ("heads", "kv", "embed"),
                            param_dtype)

  # -- pieces shared by the full pass and decoding --------------------------

  def _project(self, x_btd):
    """Pre-conv q, k, v projections [B, T, H, K] in the compute dtype."""
    x = x_btd.astype(self.dtype)
    proj = lambda w: jnp.einsum("btd,dhk->bthk", x, w[...].astype(self.dtype))
    return proj(self.wq), proj(self.wk), proj(self.wv)

  def _gate_preactivation(self, x_btd):
    """z = x W_fa W_fb [B, T, H, K] float32 (before the bias) and beta [B, T, H] float32."""
    x = x_btd.astype(jnp.float32)
    z = jnp.einsum("btd,dr->btr", x, self.wf_a[...].astype(jnp.float32))
    z = jnp.einsum("btr,rhk->bthk", z, self.wf_b[...].astype(jnp.float32))
    beta = jax.nn.sigmoid(jnp.einsum("btd,dh->bth", x, self.wb[...].astype(jnp.float32)))
    return z, beta

  def _gates(self, x_btd):
    """g [B, T, H, K] float32 log-decay and beta [B, T, H] float32."""
    z, beta = self._gate_preactivation(x_btd)
    if self.bounded:
      g = gates.bounded_gate(z + self.f_bias[...].astype(jnp.float32), self.spec)
    else:
      g = gates.softplus_gate(z, self.a_log[...].astype(jnp.float32)[:, None],
                              self.f_bias[...].astype(jnp.float32))
    return g.astype(jnp.float32), beta

  def _activate(self, q, k, v):
    """SiLU after the conv, unit-norm q and k."""
    q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
    return l2_norm(q), l2_norm(k), v

  def _output(self, x_btd, o_bthv):
    """Per-head RMS norm, sigmoid output gate, output projection -> [B, T, D]."""
    x = x_btd.astype(self.dtype)
    og = jax.nn.sigmoid(jnp.einsum("btd,dhk->bthk", x, self.w_og[...].astype(self.dtype)))
    o = rms_norm(o_bthv.astype(jnp.float32)) * self.o_norm[...].astype(jnp.float32)
    o = (o * og.astype(jnp.float32)).astype(self.dtype)
    return jnp.einsum("bthk,hkd->btd", o, self.wo[...].astype(self.dtype))

  @property
  def bounded(self) -> bool:
    """The bounded gate `lower_bound * sigmoid(.)` (else the softplus baseline)."""
    return self.spec.bounded

  @property
  def interpret(self) -> bool:
    """Pallas kernels run emulated where they have no lowering (`interprets`)."""
    return interprets(self.spec.implementation)

  def _kernel(self, q, k, v, g, beta, initial_state=None, output_final_state=False,
              gate_bias=None, segment_ids=None):
    """chunk_kda on the layer's spec; with gate_bias [H, K], g is the fused gate's
    pre-activation; with segment_ids [B, T] (`Segments.run_bt`) the state restarts
    at every run."""
    fused = {} if gate_bias is None else dict(gate_activation="bounded_sigmoid",
                                              gate_bias=gate_bias)
    return kda_api.chunk_kda(
        q, k, v, g, beta, spec=self.spec, initial_state=initial_state,
        output_final_state=output_final_state, segment_ids=segment_ids,
        interpret=self.interpret, **fused)

  @staticmethod
  def _stats(g):
    return {"g_mean": jnp.mean(g), "g_min": jnp.min(g)}

  def _kernel_gates(self, x_btd):
    """(gate input, gate_bias or None, beta, stats) for `_kernel`.

    Fused: the pre-activation and the bias go to the kernel; the logged
    stats come from a reduction over g that XLA fuses (g is not written).
    """
    if not self.fuse_gate:
      g, beta = self._gates(x_btd)
      return g, None, beta, self._stats(g)
    z, beta = self._gate_preactivation(x_btd)
    bias = self.f_bias[...].astype(jnp.float32)
    g = jax.lax.stop_gradient(gates.bounded_gate(z + bias, self.spec))
    return z, bias, beta, self._stats(g)

  def _check(self, x_btd):
    if x_btd.ndim != 3 or x_btd.shape[-1] != self.d_model:
      raise ValueError(f"KDA expects [B, T, {self.d_model}], got {x_btd.shape}")

  # -- public entry points ---------------------------------------------------

  def __call__(self, x_btd: jax.Array, segments: Segments | None = None
               ) -> tuple[jax.Array, dict]:
    """x_btd: [B, T, D] -> ([B, T, D] compute dtype, {g_mean, g_min}).

    With `segments` (the rows' documents, `k3jax.layers.segments`) no conv
    tap reaches across a document boundary and the state restarts at every
    document start (`chunk_kda`'s segment_ids, masks inside the chunks).
    """
    y, stats, _ = self._forward(x_btd, with_cache=False, segments=segments)
    return y, stats

  def prefill(self, x_btd: jax.Array, max_len: int | None = None,
              valid_bt: jax.Array | None = None) -> tuple[jax.Array, dict, dict]:
    """Full pass over a prompt that also returns the decoding cache.

    Returns ([B, T, D], stats, cache) where cache holds `conv_q/k/v`
    [B, W-1, H, K] (last pre-conv inputs) and `state` [B, H, K, V] float32.
    `max_len` is accepted for interface symmetry with attention; KDA's cache
    does not grow. valid_bt: [B, T] bool, False on each row's left padding, or
    None (no padding); see `_forward`.
    """
    del max_len
    return self._forward(x_btd, with_cache=True, valid_bt=valid_bt)

  def _forward(self, x_btd, *, with_cache, segments=None, valid_bt=None):
    """The full pass. Left padding (valid_bt False) has its pre-conv q, k, v zeroed:
    the conv taps of the first tokens then read zeros as at a sequence start, and
    with k = v = 0 the delta rule leaves the zero state untouched, so each row's
    tokens see exactly what they would alone."""
    self._check(x_btd)
    offsets, runs = None, None
    if segments is not None:
      if segments.ids_bt.shape != x_btd.shape[:2]:
        raise ValueError(f"segments of shape {segments.ids_bt.shape} for KDA input "
                         f"{x_btd.shape}: they must cover [B, T]")
      # Run indices, not ids: a row's runs past its M-th merge as Segments merges them.
      offsets, runs = segments.offsets_bm, segments.run_bt
    qp, kp, vp = self._project(x_btd)
    if valid_bt is not None:
      keep = valid_bt[:, :, None, None]
      qp, kp, vp = (jnp.where(keep, x, jnp.zeros((), x.dtype)) for x in (qp, kp, vp))
    q = causal_depthwise_conv(qp, self.conv_q[...], offsets)
    k = causal_depthwise_conv(kp, self.conv_k[...], offsets)
    v = causal_depthwise_conv(vp, self.conv_v[...], offsets)
    q, k, v = self._activate(q, k, v)
    g_in, gate_bias, beta, stats = self._kernel_gates(x_btd)
    o, state = self._kernel(q, k, v, g_in, beta, output_final_state=with_cache,
                            gate_bias=gate_bias, segment_ids=runs)
    y = self._output(x_btd, o)
    cache = None
    if with_cache:
      w = self.conv_size
      cache = {"conv_q": _conv_tail(qp, w), "conv_k": _conv_tail(kp, w),
               "conv_v": _conv_tail(vp, w), "state": state.astype(jnp.float32)}
    return y, stats, cache

  def init_cache(self, batch: int) -> dict:
    """Empty decoding cache for `batch` sequences (same layout as `prefill`'s)."""
    h, k, w = self.num_heads, self.head_dim, self.conv_size
    tail = jnp.zeros((batch, w - 1, h, k), self.dtype)
    return {"conv_q": tail, "conv_k": tail, "conv_v": tail,
            "state": jnp.zeros((batch, h, k, k), jnp.float32)}

  def decode(self, x_btd: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """A few tokens per sequence after the cached ones.

    x_btd: [B, T_new, D] with 1 <= T_new <= `kda_decode.MAX_DECODE_TOKENS`
    -> ([B, T_new, D], new cache of the same layout as `prefill`'s).
    """
    self._check(x_btd)
    t_new = x_btd.shape[1]
    if not 1 <= t_new <= kda_decode.MAX_DECODE_TOKENS:
      raise ValueError(f"decode takes 1 to {kda_decode.MAX_DECODE_TOKENS} tokens per sequence, "
                       f"got shape {x_btd.shape}; feed longer spans through prefill")
    qp, kp, vp = self._project(x_btd)
    new_cache = {}
    acts = []
    keep = self.conv_size - 1
    for name, xp, w in (("conv_q", qp, self.conv_q), ("conv_k", kp, self.conv_k),
                        ("conv_v", vp, self.conv_v)):
      window = jnp.concatenate([cache[name].astype(xp.dtype), xp], axis=1)  # [B, W-1+T, H, K]
      # The same conv as the full pass; its first W-1 outputs see the zero padding.
      acts.append(causal_depthwise_conv(window, w[...])[:, keep:])
      new_cache[name] = window[:, t_new:]
    q, k, v = self._activate(*acts)
    g, beta = self._gates(x_btd)
    # The step resolves "auto" from q's shape; interpret only reaches the Pallas kernel.
    o, state = kda_decode.kda_decode_step(
        q, k, v, g, beta, cache["state"].astype(jnp.float32),
        implementation=self.decode_implementation, interpret=platform.interprets("kda_decode"))
    new_cache["state"] = state
    return self._output(x_btd, o), new_cache
