"""Ahead-of-time export of `chunk_kda(implementation="pallas")` from a CPU host.

Through the public entry, without internal arguments: the program lowers
the platform it is exported for (Mosaic custom calls for TPU, Triton ones
for CUDA). On a GPU or TPU host the host's kernels are used, so these
checks need a CPU host.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from pallas_kernels.kda import api
from pallas_kernels.kda import platform_lowering
from tests.kda_inputs import make_inputs

pytestmark = [pytest.mark.tpu_export, pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="exports from a CPU host")]

# Triton custom calls are not on jax.export's list of stable targets.
_TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
# A CPU host has no GPU to ask for its compute capability: name one.
_H200 = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", num_cores=132, platform="gpu"))


def _fwd_bwd(dk, dv, varlen=False, heads=1, segment_ids=None):
  """A jitted forward and VJP of the op (one program: both in one export) and its bf16 inputs."""
  fn = functools.partial(api.chunk_kda, implementation="pallas", chunk_size=64,
                         lower_bound=-5.0, output_final_state=True, segment_ids=segment_ids,
                         cu_seqlens=jnp.asarray([0, 50, 128], jnp.int32) if varlen else None)

  def run(q, k, v, g, beta):
    (o, ht), vjp = jax.vjp(lambda *xs: fn(*xs), q, k, v, g, beta)
    return o, ht, vjp((o, ht))
  x = make_inputs(21, batch=1, seq_len=128, heads=heads, dk=dk, dv=dv, dtype=jnp.bfloat16,
                  num_states=2 if varlen else None)
  return jax.jit(run), x.args()


def _tpu_module(dk, dv, varlen=False, heads=1) -> str:
  fn, args = _fwd_bwd(dk, dv, varlen, heads)
  text = jax.export.export(fn, platforms=["tpu"])(*args).mlir_module()
  assert "tpu_custom_call" in text
  assert "xla.gpu.triton" not in text
  return text


@pytest.mark.parametrize("dk,dv,varlen", [(48, 96, True), (256, 192, False)])
def test_exports_for_tpu(dk, dv, varlen):
  _tpu_module(dk, dv, varlen, heads=2 if dk == 256 else 1)


@pytest.mark.parametrize("heads", [1, 2, 4])
@pytest.mark.parametrize("width", [32, 64, 96, 128])
def test_exports_for_tpu_any_heads(heads, width):
  """K = V = width at H heads, forward and backward in one export. Mosaic
  blocks of the [B, T, H*K] layout need 128 lanes or the whole array, so
  with H > 1 the TPU path pads narrower widths to 128; with H = 1 only a
  width that is not a power of two is padded (T is a multiple of C here)."""
  text = _tpu_module(width, width, heads=heads)
  padded = width % 128 != 0 if heads > 1 else width == 96
  assert ("stablehlo.pad" in text) == padded


@pytest.mark.parametrize("dk,dv", [(128, 128), (48, 96)])
def test_exports_for_cuda(dk, dv):
  fn, args = _fwd_bwd(dk, dv)
  with jax.sharding.use_abstract_mesh(_H200):
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=[_TRITON])(
        *args).mlir_module()
  # Forward: cumsum, intra, recurrence, output; backward: state, two intra, cumsum.
  assert text.count("@__gpu$xla.gpu.triton") == 8
  # The clamp of the traced gates runs inside the two cumsum kernels: no XLA
  # select passes over the f32 gate or its gradient.
  assert 'name = "kda_clamped_cumsum"' in text and 'name = "kda_clamped_cumsum_bwd"' in text
  assert "stablehlo.select" not in text
  assert "tpu_custom_call" not in text
  # T is a multiple of C, and widths that are multiples of 16 run in the
  # kernels as they are: no pad copy at all.
  assert "stablehlo.pad" not in text


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_exports_with_segment_ids(platform):
  """Runs restarting inside chunks (`segment_ids`): every kernel that takes the
  run codes lowers, forward and backward, the kernels as many as without them."""
  ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), jnp.asarray([10, 54, 1, 63]),
                   total_repeat_length=128)[None]
  fn, args = _fwd_bwd(128, 128, segment_ids=ids)
  if platform == "tpu":
    assert _tpu_module(128, 128).count("tpu_custom_call") == jax.export.export(
        fn, platforms=["tpu"])(*args).mlir_module().count("tpu_custom_call")
    return
  with jax.sharding.use_abstract_mesh(_H200):
    text = jax.export.export(fn, platforms=["cuda"], disabled_checks=[_TRITON])(
        *args).mlir_module()
  assert text.count("@__gpu$xla.gpu.triton") == 8


def test_cpu_run_raises_clear_error():
  """Without interpret=True the CPU has no kernels: eager and jitted calls say so."""
  fn, args = _fwd_bwd(16, 16)
  with pytest.raises(ValueError, match="GPU .Triton. and TPU .Mosaic. only.*interpret=True"):
    fn(*args)
  x = make_inputs(22, batch=1, seq_len=16, heads=1, dk=16, dv=16)
  with pytest.raises(ValueError, match=platform_lowering.NO_KERNELS_MESSAGE[:40]):
    api.chunk_kda(*x.args(), implementation="pallas", chunk_size=16, lower_bound=-5.0)
