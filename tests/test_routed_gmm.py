"""`k3jax.layers.routed_gmm`: the routed SwiGLU on the grouped-matmul kernels against a
float32 dense reference (every expert on every token), output and every gradient through
the custom VJP; interpret mode here, the Triton kernels in the GPU twin."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import routing
from k3jax.layers import moe_dispatch, routed_gmm
from k3jax.routing import RouterConfig
from pallas_kernels.gmm.config import GmmConfig


def _dense_reference(idx_nk, num_experts):
  """f32 sum_j w[n, j] SwiGLU_{idx[n, j]}(x[n]), every expert computed on every token."""
  def ref(x, w_nk, wg, wu, wo):
    hp = jax.lax.Precision.HIGHEST
    gate = jnp.einsum("nd,edh->neh", x, wg, precision=hp)
    up = jnp.einsum("nd,edh->neh", x, wu, precision=hp)
    y_ned = jnp.einsum("neh,ehd->ned", jax.nn.silu(gate) * up, wo, precision=hp)
    combine_ne = jnp.einsum("nk,nke->ne", w_nk, jax.nn.one_hot(idx_nk, num_experts))
    return jnp.einsum("ned,ne->nd", y_ned, combine_ne, precision=hp)
  return ref


def _check(n, d, e, k, h, dtype, cfg, tol, interpret, fuse_swiglu=False):
  keys = jax.random.split(jax.random.key(0), 7)
  scores = jax.nn.sigmoid(jax.random.normal(keys[0], (n, e)))
  router = RouterConfig(name="quantile", capacity_factor=None)  # dropless: all placed
  idx, w_nk, _, _ = routing.route(scores, k=k, config=router)
  plan = moe_dispatch.plan_slots(idx, w_nk > 0, e, None, align=cfg.block_m)
  args = (jax.random.normal(keys[1], (n, d)), w_nk,
          jax.random.normal(keys[2], (e, d, h)) * d ** -0.5,
          jax.random.normal(keys[3], (e, d, h)) * d ** -0.5,
          jax.random.normal(keys[4], (e, h, d)) * h ** -0.5)
  ct = jax.random.normal(keys[5], (n, d))

  def value_and_vjp(f):
    out, vjp = jax.vjp(f, *args)
    return out, vjp(ct)

  kernels = lambda *a: routed_gmm.routed_swiglu_gmm(*a, plan, dtype=dtype, config=cfg,
                                                    interpret=interpret,
                                                    fuse_swiglu=fuse_swiglu)
  out, grads = jax.jit(lambda: value_and_vjp(kernels))()
  out_ref, grads_ref = jax.jit(lambda: value_and_vjp(_dense_reference(idx, e)))()
  for name, got, want in zip(("out", "dx", "dw", "dwi_gate", "dwi_up", "dwo"),
                             (out, *grads), (out_ref, *grads_ref)):
    top = float(jnp.abs(want).max())
    np.testing.assert_allclose(np.asarray(got, np.float32) / top, np.asarray(want) / top,
                               atol=tol, err_msg=name)


@pytest.mark.parametrize("fuse_swiglu", [True, False])
def test_routed_swiglu_gmm_matches_dense_reference(fuse_swiglu):
  cfg = GmmConfig(block_m=16, block_n=16, block_k=16)
  _check(96, 32, 4, 2, 16, jnp.float32, cfg, 1e-4, interpret=True, fuse_swiglu=fuse_swiglu)


@pytest.mark.gpu
@pytest.mark.parametrize("fuse_swiglu", [True, False])
@pytest.mark.parametrize("dtype, tol", [(jnp.bfloat16, 2e-2), (jnp.float32, 1e-4)])
def test_routed_swiglu_gmm_matches_dense_reference_on_gpu(dtype, tol, fuse_swiglu):
  from pallas_kernels.gmm.config import default_config
  _check(4096, 256, 16, 2, 128, dtype, default_config(dtype), tol, interpret=False,
         fuse_swiglu=fuse_swiglu)
