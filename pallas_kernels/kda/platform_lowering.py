"""Which Pallas lowering a call takes: the host's, or the one being lowered for.

On a GPU or TPU host a call runs the host platform's kernels ("triton" or
"tpu"), as the program is compiled for it. On any other host (a CPU machine
exporting for an accelerator, `jax.export(..., platforms=["tpu"])`) the call
stages both lowerings with `jax.lax.platform_dependent` and the platform the
program is lowered for picks one, so ahead-of-time export needs no internal
argument. Lowering or running such a program for a platform without kernels
(CPU) raises a ValueError that names the fix.
"""
from __future__ import annotations

import functools

import jax
import jax.extend
from jax.interpreters import mlir

from pallas_kernels.kda import kernel_config

NO_KERNELS_MESSAGE = (
    "implementation='pallas' has kernels for GPU (Triton) and TPU (Mosaic) only, and this "
    "program is lowered or run for {platform!r}; run it on a GPU or TPU, export it with "
    "jax.export(..., platforms=['cuda'] or ['tpu']), pass interpret=True to emulate the kernels "
    "on the CPU, or use implementation='xla'")

_no_kernels_p = jax.extend.core.Primitive("kda_pallas_no_kernels")
_no_kernels_p.multiple_results = True
_no_kernels_p.def_abstract_eval(lambda *_, avals: avals)


def _no_kernels_lowering(ctx, *_, avals):
  del avals
  platforms = getattr(ctx.module_context, "platforms", None) or ("cpu",)
  raise ValueError(NO_KERNELS_MESSAGE.format(platform=",".join(platforms)))


mlir.register_lowering(_no_kernels_p, _no_kernels_lowering)


def host_backend(interpret: bool) -> str | None:
  """The backend fixed by the host: "interpret" if asked, "triton" on a GPU
  host, "tpu" on a TPU host; None elsewhere (chosen per lowered platform)."""
  if interpret:
    return "interpret"
  platform = jax.default_backend()
  if platform in ("gpu", "tpu"):
    return kernel_config.default_backend(False)
  return None


def _no_kernels(run, *operands):
  """The branch for platforms without kernels: run's output shapes, from a
  primitive whose lowering raises; eager calls raise at once."""
  leaves = jax.tree.leaves(operands)
  if not any(isinstance(x, jax.core.Tracer) for x in leaves):
    raise ValueError(NO_KERNELS_MESSAGE.format(platform=jax.default_backend()))
  out_tree = jax.eval_shape(functools.partial(run, "triton"), *operands)
  avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in jax.tree.leaves(out_tree))

  @jax.custom_vjp
  def fail(*xs):
    return _no_kernels_p.bind(*xs, avals=avals)

  fail.defvjp(lambda *xs: (fail(*xs), None), lambda _, cts: (None,) * len(leaves))
  return jax.tree.unflatten(jax.tree.structure(out_tree), fail(*leaves))


def per_platform(run, *operands):
  """`run(backend, *operands)` with backend "triton" when lowered for CUDA
  and "tpu" when lowered for TPU; other platforms raise (see module doc).

  Args:
    run: callable(backend, *operands) -> pytree of arrays.
    operands: pytrees of arrays (None leaves allowed).
  """
  return jax.lax.platform_dependent(
      *operands, cuda=functools.partial(run, "triton"), tpu=functools.partial(run, "tpu"),
      default=functools.partial(_no_kernels, run))
