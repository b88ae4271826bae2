"""Context-parallel KDA on 8 fake CPU devices against single-device `chunk_kda`."""
import functools

import jax
import jax.numpy as jnp
import pytest

from k3jax.parallel.context_parallel import chunk_kda_context_parallel
from k3jax.sharding.mesh import MeshConfig, make_mesh
from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda.spec import KdaSpec
from tests.kda_inputs import assert_close, make_inputs

# Relative L2 error allowed between two float32 evaluations of the same
# recurrence with different chunk boundaries (and a state composed across
# devices instead of carried); gradients go through one more triangular solve.
RTOL = {jnp.dtype(jnp.float32): {"out": 2e-5, "grad": 5e-5}}
KW = dict(chunk_size=16, sub_chunk=8, lower_bound=-5.0)
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _loss(fn, q, k, v, g, beta, h0):
  o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
  # Nonlinear in o and s, so every cotangent entry differs.
  return jnp.sum(o * jnp.sin(o)) + jnp.sum(s * jnp.cos(s)), (o, s)


@functools.cache
def _reference(impl):
  fn = functools.partial(chunk_kda, implementation=impl, **KW)
  return jax.jit(jax.value_and_grad(functools.partial(_loss, fn), argnums=range(6),
                                    has_aux=True))


def _sharded(mesh, impl):
  fn = functools.partial(chunk_kda_context_parallel, mesh=mesh, implementation=impl,
                         interpret=impl == "pallas", **KW)
  return jax.jit(jax.value_and_grad(functools.partial(_loss, fn), argnums=range(6),
                                    has_aux=True))


def _check(mesh, x, impl="xla", ref_impl="xla"):
  args = (x.q, x.k, x.v, x.g, x.beta, x.h0)
  (_, (o_ref, s_ref)), g_ref = _reference(ref_impl)(*args)
  (_, (o, s)), grads = _sharded(mesh, impl)(*args)
  # Each device holds only its slice of the sequence.
  assert o.addressable_shards[0].data.shape[1] == x.q.shape[1] // mesh.shape["context"]
  tol = RTOL[jnp.dtype(x.q.dtype)]
  errs = {"o": assert_close(o, o_ref, tol["out"], "output"),
          "final_state": assert_close(s, s_ref, tol["out"], "final state")}
  for name, a, b in zip(NAMES, grads, g_ref):
    errs["d" + name] = assert_close(a, b, tol["grad"], f"gradient of {name}")
  return errs


@pytest.mark.parametrize("n_ctx", [2, 4, 8])
def test_matches_single_device_with_initial_state(n_ctx):
  # The batch is sharded over the remaining devices (data axis) at the same time.
  mesh = make_mesh(MeshConfig(data=-1, context=n_ctx))
  # T = 72: 9 tokens per device at n = 8, so local blocks are partial chunks
  # and device boundaries fall inside the single-device chunks.
  x = make_inputs(n_ctx, batch=4, seq_len=72, heads=2, dk=16, dv=8, gate="mixed")
  _check(mesh, x)


def test_scalar_gate_without_initial_state_forward():
  mesh = make_mesh(MeshConfig(data=-1, context=4))
  x = make_inputs(5, batch=2, seq_len=32, heads=2, dk=16, dv=8, scalar_gate=True)
  o, s = jax.jit(lambda *a: chunk_kda_context_parallel(
      *a, mesh=mesh, output_final_state=True, **KW))(*x.args())
  o_ref, s_ref = chunk_kda(*x.args(), output_final_state=True, **KW)
  assert_close(o, o_ref, RTOL[jnp.dtype(jnp.float32)]["out"], "output")
  assert_close(s, s_ref, RTOL[jnp.dtype(jnp.float32)]["out"], "final state")


@pytest.mark.slow
def test_pallas_local_kernel_composes():
  # Pallas (interpret mode) for the local blocks, against the xla reference.
  mesh = make_mesh(MeshConfig(data=-1, context=2))
  x = make_inputs(3, batch=4, seq_len=64, heads=1, dk=16, dv=16)
  _check(mesh, x, impl="pallas")


def _zeros(b, t, h=1, dk=16, dv=8):
  return (jnp.zeros((b, t, h, dk)), jnp.zeros((b, t, h, dk)), jnp.zeros((b, t, h, dv)),
          jnp.full((b, t, h, dk), -1.0), jnp.zeros((b, t, h)))


def test_rejects_indivisible_shapes():
  mesh = make_mesh(MeshConfig(data=-1, context=4))
  with pytest.raises(ValueError, match="T=30 must be divisible by the context axis size 4"):
    chunk_kda_context_parallel(*_zeros(2, 30), mesh=mesh, **KW)
  with pytest.raises(ValueError, match="batch B=3"):
    chunk_kda_context_parallel(*_zeros(3, 32), mesh=mesh, **KW)
  with pytest.raises(ValueError, match="initial_state must be"):
    chunk_kda_context_parallel(*_zeros(2, 32), mesh=mesh, initial_state=jnp.zeros((2, 1, 8, 8)),
                               **KW)


def test_naive_local_recurrence_composes():
  mesh = make_mesh(MeshConfig(data=-1, context=2))
  x = make_inputs(8, batch=4, seq_len=16, heads=1, dk=8, dv=8)
  o, s = jax.jit(lambda *a: chunk_kda_context_parallel(
      *a, mesh=mesh, initial_state=x.h0, output_final_state=True, implementation="naive",
      **KW))(*x.args())
  o_ref, s_ref = chunk_kda(*x.args(), initial_state=x.h0, output_final_state=True, **KW)
  assert_close(o, o_ref, RTOL[jnp.dtype(jnp.float32)]["out"], "output")
  assert_close(s, s_ref, RTOL[jnp.dtype(jnp.float32)]["out"], "final state")


def test_pallas_runs_each_devices_batch_on_a_data_mesh(monkeypatch):
  """Context 1, batch over 4 devices: each Pallas call sees B / 4 sequences; values unchanged."""
  from k3jax.parallel import context_parallel  # pylint: disable=g-import-not-at-top
  seen = []
  real = context_parallel.kda_api.chunk_kda

  def spy(q, *args, **kwargs):
    seen.append(q.shape[0])
    return real(q, *args, **kwargs)

  monkeypatch.setattr(context_parallel.kda_api, "chunk_kda", spy)
  mesh = make_mesh(MeshConfig(data=4, context=1), devices=jax.devices()[:4])
  x = make_inputs(11, batch=8, seq_len=40, heads=1, dk=16, dv=16)
  o, s = jax.jit(lambda *a: chunk_kda_context_parallel(
      *a, mesh=mesh, initial_state=x.h0, output_final_state=True, implementation="pallas",
      interpret=True, **KW))(x.q, x.k, x.v, x.g, x.beta)
  assert seen == [2]
  assert o.addressable_shards[0].data.shape[0] == 2
  o_ref, s_ref = chunk_kda(x.q, x.k, x.v, x.g, x.beta, initial_state=x.h0,
                           output_final_state=True, **KW)
  assert_close(o, o_ref, RTOL[jnp.dtype(jnp.float32)]["out"], "output")
  assert_close(s, s_ref, RTOL[jnp.dtype(jnp.float32)]["out"], "final state")


def test_layer_with_fused_gate_runs_context_parallel():
  """ContextParallelKDA(fuse_gate=True) on a context-2 mesh: the sharded scan gets the
  activated gate, and the layer equals the unfused one-device layer."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from k3jax.layers.kda import KDA  # pylint: disable=g-import-not-at-top
  from k3jax.parallel.layers import ContextParallelKDA  # pylint: disable=g-import-not-at-top
  kw = dict(conv_size=3, spec=KdaSpec(chunk_size=16, sub_chunk=8, lower_bound=-5.0))
  cp = ContextParallelKDA(16, 2, 8, fuse_gate=True, rngs=nnx.Rngs(0), **kw)
  plain = KDA(16, 2, 8, fuse_gate=False, rngs=nnx.Rngs(0), **kw)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 16))
  mesh = make_mesh(MeshConfig(data=1, context=2), devices=jax.devices()[:2])
  with jax.set_mesh(mesh):
    y, _ = nnx.jit(lambda m, x: m(x))(cp, x)
  y_ref, _ = nnx.jit(lambda m, x: m(x))(plain, x)
  assert_close(y, y_ref, RTOL[jnp.dtype(jnp.float32)]["out"], "layer output")
  assert np.all(np.isfinite(np.asarray(y)))


def test_fused_gate_in_batch_sharded_pallas_calls():
  """Context 1, batch over 2 devices: the fused gate runs in each device's kernels; output,
  state and the gradients of the pre-activation and the shared bias equal one device's."""
  mesh = make_mesh(MeshConfig(data=2, context=1), devices=jax.devices()[:2])
  x = make_inputs(12, batch=4, seq_len=40, heads=1, dk=16, dv=16)
  raw = 2.0 * jax.random.normal(jax.random.PRNGKey(13), x.g.shape)
  bias = jax.random.normal(jax.random.PRNGKey(14), x.g.shape[2:])

  def loss(fn, raw, bias, v):
    o, s = fn(x.q, x.k, v, raw, x.beta, initial_state=x.h0, output_final_state=True,
              gate_activation="bounded_sigmoid", gate_bias=bias)
    return jnp.sum(o * jnp.sin(o)) + jnp.sum(s * jnp.cos(s)), (o, s)

  sharded = functools.partial(chunk_kda_context_parallel, mesh=mesh, implementation="pallas",
                              interpret=True, **KW)
  plain = functools.partial(chunk_kda, implementation="xla", **KW)
  run = lambda fn: jax.jit(jax.value_and_grad(functools.partial(loss, fn), argnums=(0, 1, 2),
                                              has_aux=True))(raw, bias, x.v)
  (_, (o, s)), grads = run(sharded)
  (_, (o_ref, s_ref)), grads_ref = run(plain)
  tol = RTOL[jnp.dtype(jnp.float32)]
  assert_close(o, o_ref, tol["out"], "output")
  assert_close(s, s_ref, tol["out"], "final state")
  for name, a, b in zip(("raw gate", "gate bias", "v"), grads, grads_ref):
    assert_close(a, b, tol["grad"], f"gradient of {name}")
