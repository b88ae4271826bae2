"""The Mosaic GPU body of the GPU forward's output kernel (`kernel_output_mosaic`,
`config_overrides={"output_body": "mosaic_gpu"}`) against the Triton body and a
plain-jnp product: Mosaic GPU's interpreter on the CPU with race detection, and
compiled in the GPU twins."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
# The interpreter's race record has no public name yet.
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

from pallas_kernels.kda import api, kernel_config, kernel_output_mosaic, kernel_state_split
from pallas_kernels.tools import mosaic_ir
from tests.kda_inputs import rel_err
from tests.test_kda_pallas import _inputs


def _operands(seed, b, t, h, dk, dv, c, dtype=jnp.bfloat16):
  """qg [B, T, H*K], A_qk [B, H, T, C], entry states [B, H, NC*K, V], V' [B, T, H*V]."""
  rng = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype)
  return (normal(b, t, h * dk), normal(b, h, t, c), normal(b, h, t // c * dk, dv),
          normal(b, t, h * dv))


def _product(qg, a_qk, hs, v_new, h, c):
  """O = A_qk V' + qg S per chunk, in float32 (numpy)."""
  f = lambda x: jnp.asarray(x, jnp.float32)
  b, t, hk = qg.shape
  nc, dk, dv = t // c, hk // h, v_new.shape[-1] // h
  q = f(qg).reshape(b, nc, c, h, dk)
  v = f(v_new).reshape(b, nc, c, h, dv)
  a = f(a_qk).reshape(b, h, nc, c, c)
  s = f(hs).reshape(b, h, nc, dk, dv)
  o = (jnp.einsum("bhncd,bndhv->bnchv", a, v, precision="highest")
       + jnp.einsum("bncht,bhntv->bnchv", q, s, precision="highest"))
  return np.asarray(o.reshape(b, t, h * dv))


@pytest.mark.parametrize("dk, dv", [(64, 64), (128, 64)])
def test_mosaic_output_interpret_matches_triton_body(dk, dv):
  b, t, h, c = 2, 128, 2, 64
  args = _operands(0, b, t, h, dk, dv, c)
  params = plgpu.InterpretGPUParams(detect_races=True)
  out = kernel_output_mosaic.output_fwd(*args, heads=h, chunk_size=c, out_dtype=jnp.float32,
                                        interpret=params)
  assert not interpret_pallas_call.get_races().races_found
  cfg = kernel_config.make_config(backend="interpret", dtype=jnp.bfloat16, head_k=dk,
                                  head_v=dv, chunk_size=c, sub_chunk=16)
  base = kernel_state_split.output_fwd(*args, heads=h, chunk_size=c, cfg=cfg,
                                       out_dtype=jnp.float32)
  want = _product(*args, h, c)
  # bf16 products are exact in float32; only the order of the sums differs.
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-4, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(out), np.asarray(base), atol=1e-4, rtol=1e-5)


def test_mosaic_output_selection_and_limits():
  args = _operands(1, 1, 64, 1, 64, 64, 64)
  with pytest.raises(ValueError, match="16-bit"):
    kernel_output_mosaic.output_fwd(*(x.astype(jnp.float32) for x in args), heads=1,
                                    chunk_size=64, out_dtype=jnp.float32)
  with pytest.raises(ValueError, match="multiple of 64"):
    kernel_output_mosaic.output_fwd(*args, heads=1, chunk_size=32, out_dtype=jnp.float32)
  make = functools.partial(kernel_config.make_config, dtype=jnp.bfloat16, head_k=128,
                           head_v=128, chunk_size=64, sub_chunk=16)
  assert make(backend="triton").output_body == "triton"
  with pytest.raises(ValueError, match="not lowered for TPU"):
    make(backend="tpu", overrides={"output_body": "mosaic_gpu"})
  with pytest.raises(ValueError, match="output_body"):
    make(backend="triton", overrides={"output_body": "cuda"})


def test_mosaic_output_lowers_for_cuda_on_the_cpu():
  """The kernel lowers for CUDA without a GPU: four TMA tiles in, two wgmma
  products per 16-deep step of K and C, one TMA store."""
  h, d, c = 2, 128, 64
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  fn = lambda *a: kernel_output_mosaic.output_fwd(*a, heads=h, chunk_size=c,
                                                  out_dtype=jnp.bfloat16)
  lowered = jax.jit(fn).trace(spec(1, 256, h * d), spec(1, h, 256, c), spec(1, h, 4 * d, d),
                              spec(1, 256, h * d)).lower(lowering_platforms=("cuda",))
  (text,) = mosaic_ir.kernel_modules(lowered)
  info = mosaic_ir.summary(text)
  assert info["wgmma_shapes"] == ["m64n128k16"] and info["wgmma"] == (c + d) // 16
  assert info["tma_loads"] == 4 and info["tma_stores"] == 1


def _forward(interpret, body, xs):
  """chunk_kda's bf16 forward (o) on the output body `body`, which must run."""
  fn = functools.partial(api.chunk_kda, implementation="pallas", interpret=interpret,
                         lower_bound=-5.0, config_overrides={"output_body": body})
  ran = "kda_output_fwd_mosaic" in str(jax.make_jaxpr(fn)(*xs))
  assert ran == (body == "mosaic_gpu")
  return jax.jit(fn)(*xs)[0]


def test_mosaic_output_in_chunk_kda_interpret():
  """The forward of chunk_kda with the Mosaic output body, in interpret mode,
  against the same call on the Triton body (T not a multiple of the chunk)."""
  xs = _inputs(2, 1, 100, 2, 64, 64, dtype=jnp.bfloat16)[:5]
  o = _forward(True, "mosaic_gpu", xs)
  o_base = _forward(True, "triton", xs)
  assert rel_err(o, o_base, jnp.bfloat16) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1024, 4, 128), (16, 2048, 16, 128)])
def test_gpu_mosaic_output_matches_triton_body(shape):
  """The compiled kernel at the issue shape and the first KDA benchmark shape,
  against the product in float32 and the Triton body on the same inputs."""
  b, t, h, d = shape
  args = _operands(3, b, t, h, d, d, 64)
  out = kernel_output_mosaic.output_fwd(*args, heads=h, chunk_size=64, out_dtype=jnp.float32)
  cfg = kernel_config.make_config(backend="triton", dtype=jnp.bfloat16, head_k=d, head_v=d,
                                  chunk_size=64, sub_chunk=16)
  base = kernel_state_split.output_fwd(*args, heads=h, chunk_size=64, cfg=cfg,
                                       out_dtype=jnp.float32)
  want = _product(*args, h, 64)
  top = float(np.abs(want).max())
  for name, got in (("mosaic_gpu", out), ("triton", base)):
    np.testing.assert_allclose(np.asarray(got) / top, want / top, atol=1e-4, err_msg=name)


@pytest.mark.gpu
def test_gpu_chunk_kda_forward_on_mosaic_output_body():
  """chunk_kda's bf16 forward at B1 T1024 H4 D128 on both output bodies."""
  xs = _inputs(9, 1, 1024, 4, 128, 128, dtype=jnp.bfloat16)[:5]
  assert rel_err(_forward(False, "mosaic_gpu", xs), _forward(False, "triton", xs),
                 jnp.bfloat16) < 1e-2
