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


def _fwd_bwd(dk, dv, varlen=False):
  fn = functools.partial(api.chunk_kda, implementation="pallas", chunk_size=64,
                         lower_bound=-5.0, output_final_state=True,
                         cu_seqlens=jnp.asarray([0, 50, 128], jnp.int32) if varlen else None)

  def run(q, k, v, g, beta):
    (o, ht), vjp = jax.vjp(lambda *xs: fn(*xs), q, k, v, g, beta)
    return o, ht, vjp((o, ht))
  x = make_inputs(21, batch=1, seq_len=128, heads=1, dk=dk, dv=dv, dtype=jnp.bfloat16,
                  num_states=2 if varlen else None)
  return jax.jit(run), x.args()


@pytest.mark.parametrize("dk,dv,varlen", [(128, 128, False), (48, 96, True)])
def test_exports_for_tpu(dk, dv, varlen):
  fn, args = _fwd_bwd(dk, dv, varlen)
  text = jax.export.export(fn, platforms=["tpu"])(*args).mlir_module()
  assert "tpu_custom_call" in text
  assert "xla.gpu.triton" not in text


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
  # T is a multiple of C: only non-kernel head widths are padded.
  assert ("stablehlo.pad" in text) == ((dk, dv) != (128, 128))


def test_cpu_run_raises_clear_error():
  """Without interpret=True the CPU has no kernels: eager and jitted calls say so."""
  fn, args = _fwd_bwd(16, 16)
  with pytest.raises(ValueError, match="GPU .Triton. and TPU .Mosaic. only.*interpret=True"):
    fn(*args)
  x = make_inputs(22, batch=1, seq_len=16, heads=1, dk=16, dv=16)
  with pytest.raises(ValueError, match=platform_lowering.NO_KERNELS_MESSAGE[:40]):
    api.chunk_kda(*x.args(), implementation="pallas", chunk_size=16, lower_bound=-5.0)
