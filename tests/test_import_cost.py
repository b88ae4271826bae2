"""What importing the trainer leaves out: the Mosaic GPU Pallas module, which only the
opt-in Hopper prototypes use (`pallas_kernels.mgpu_common.plgpu` imports it on first use)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_importing_the_trainer_does_not_import_mosaic_gpu():
  code = ("import sys, k3jax.train.trainer; "
          "print('jax.experimental.pallas.mosaic_gpu' in sys.modules)")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))))
  out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=120, check=True)
  assert out.stdout.strip() == "False"
