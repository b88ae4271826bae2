"""Grouped SwiGLU experts on rows laid out by `moe_dispatch.SlotPlan`.

One function, three backends:

- "einsum": capacity layout, [G, c, d] buffers and one batched matmul per
  projection. On the H200 this runs at about the rate of a dense matmul of
  the same FLOPs (docs/benchmarks.md, "MoE layer"), so "auto" picks it for
  the capacity layout.
- "xla": ragged layout through `jax.lax.ragged_dot`. Exact and portable, but
  XLA (jax 0.11) expands it to every group for every row on CPU and NVIDIA
  GPUs: G times the work (11x the einsum layer at the gpu_1b shape).
- "tokamax": ragged layout through tokamax's `ragged_dot` kernel (optional
  extra, `pip install -e ".[tokamax]"`); 2.3x the dense SwiGLU at the gpu_1b
  shape. Opt-in only: its gradients did not match the dense reference in the
  one H200 run of `tests/test_moe_dispatch.py`'s GPU twin, so "auto" does
  not pick it.

- "pallas": either layout through our own grouped matmuls
  (`pallas_kernels.gmm`, Triton on the GPU, the interpreter elsewhere),
  which gather their rows as they load them; the MoE layer runs it through
  `routed_gmm`, not through `grouped_swiglu`, since it takes the token rows
  and the plan rather than dispatched rows.

"auto" is einsum for the capacity layout. For the ragged layout it is
pallas on NVIDIA GPUs, where the caller can run it (it reads token rows
through a plan, so `routed_swiglu` can and `grouped_swiglu` cannot) and the
widths are multiples of 16, since XLA's `ragged_dot` there materialises
every group for every row (192 GiB at a 256-expert layer); xla elsewhere
(TPUs lower `ragged_dot` to a grouped matmul; the CPU runs tests).

Products take operands in the compute dtype and write the compute dtype
(tensor cores accumulate in float32), so the backward's products run on the
same operands: a float32 output here would turn every backward product into
a float32 one.
"""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from k3jax.layers.ffn import silu_mul, swiglu
from pallas_kernels import platform

BACKENDS = ("auto", "einsum", "xla", "tokamax", "pallas")
# What the ragged (dropless) layout accepts.
RAGGED_BACKENDS = ("auto", "xla", "tokamax", "pallas")
# What `resolve_backend` returns and the products take.
RESOLVED = ("einsum", "xla", "tokamax", "pallas")


def tokamax_available() -> bool:
  """Whether tokamax is importable (the optional grouped-matmul kernels)."""
  return importlib.util.find_spec("tokamax") is not None


def resolve_backend(backend: str, *, ragged: bool,
                    pallas_widths: tuple[int, ...] | None = None) -> str:
  """The backend "auto" stands for, checked against the layout.

  Called once, where the layout is chosen (`MoEConfig.path`); the functions
  that run the products take its answer.

  Args:
    backend: one of BACKENDS.
    ragged: the ragged (dropless) layout; False for the capacity layout.
    pallas_widths: the expert widths (d, h) when the caller can run the
      "pallas" kernels (it holds the token rows and the plan); None when it
      takes dispatched rows.

  Returns:
    one of RESOLVED.
  """
  if backend not in BACKENDS:
    raise ValueError(f"grouped-matmul backend={backend!r}; allowed: {BACKENDS}")
  if backend == "auto":
    if not ragged:
      return "einsum"
    pallas_fits = pallas_widths is not None and all(w % 16 == 0 for w in pallas_widths)
    return "pallas" if pallas_fits and not platform.interprets("gmm") else "xla"
  if backend == "tokamax" and not tokamax_available():
    raise ValueError("grouped-matmul backend='tokamax' but tokamax is not installed; "
                     "install the extra (pip install -e '.[tokamax]') or use 'auto'")
  check_resolved(backend, ragged=ragged)
  return backend


def check_resolved(backend: str, *, ragged: bool) -> None:
  """Raises unless `backend` is a resolved backend the layout can run."""
  if backend not in RESOLVED:
    raise ValueError(f"grouped-matmul backend={backend!r} is not resolved; pass one of "
                     f"{RESOLVED}, e.g. grouped_matmul.resolve_backend({backend!r}, ...)")
  if backend == "einsum" and ragged:
    raise ValueError("grouped-matmul backend='einsum' needs the capacity layout (buffers); "
                     "the ragged (dropless) layout takes 'auto', 'pallas', 'xla' or 'tokamax'")


def _ragged_dot_fn(backend: str):
  if backend == "xla":
    return jax.lax.ragged_dot
  import tokamax  # pylint: disable=g-import-not-at-top  (optional extra)
  return tokamax.ragged_dot


def grouped_swiglu(rows_sd: jax.Array, wi_gate_gdh: jax.Array, wi_up_gdh: jax.Array,
                   wo_ghd: jax.Array, *, group_sizes: jax.Array, capacity: int | None,
                   backend: str, dtype=jnp.float32) -> jax.Array:
  """SwiGLU of group g's weights on group g's rows.

  Args:
    rows_sd: [S, d] rows in slot order (S = G * capacity for the capacity
      layout; ragged: groups consecutive from row 0, sizes `group_sizes`).
    wi_gate_gdh, wi_up_gdh: [G, d, h]; wo_ghd: [G, h, d].
    group_sizes: [G] int32 rows per group (ragged layout; ignored for buffers).
    capacity: slots per group, or None for the ragged layout.
    backend: one of RESOLVED (`resolve_backend`).
    dtype: operand and output dtype of the products.

  Returns:
    [S, d] in `dtype`. Capacity layout: empty (zero) slots give zero rows.
    Ragged layout: rows past sum(group_sizes) are unspecified; the plan never
    reads them.
  """
  check_resolved(backend, ragged=capacity is None)
  if backend == "pallas":
    raise ValueError("grouped_swiglu takes dispatched rows; the 'pallas' backend reads the "
                     "token rows through the plan: call routed_gmm.routed_swiglu_gmm")
  num_groups, d, hidden = wi_gate_gdh.shape
  if backend == "einsum":
    if rows_sd.shape[0] != num_groups * capacity:
      raise ValueError(f"capacity layout needs G * capacity = {num_groups * capacity} rows, "
                       f"got {rows_sd.shape[0]}")
    # The dense SwiGLU mapped over the groups: each product becomes one
    # batched matmul over the [G, capacity, d] buffers.
    per_group = jax.vmap(lambda x_cd, wg_dh, wu_dh, wo_hd: swiglu(x_cd, wg_dh, wu_dh, wo_hd, dtype))
    buf = rows_sd.reshape(num_groups, capacity, d)
    return per_group(buf, wi_gate_gdh, wi_up_gdh, wo_ghd).reshape(num_groups * capacity, d)
  # Gate and up as one product against [G, d, 2h], as `ffn.swiglu` does.
  w_in = jnp.concatenate([wi_gate_gdh, wi_up_gdh], axis=-1).astype(dtype)
  ragged_dot = _ragged_dot_fn(backend)
  sizes = group_sizes.astype(jnp.int32)
  gate_up = ragged_dot(rows_sd.astype(dtype), w_in, sizes, preferred_element_type=dtype)
  h = silu_mul(gate_up[:, :hidden], gate_up[:, hidden:], dtype)
  return ragged_dot(h, wo_ghd.astype(dtype), sizes, preferred_element_type=dtype)
