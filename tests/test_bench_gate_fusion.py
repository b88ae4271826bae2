"""experiments/bench/bench_gate_fusion.py times equal computations: fused and unfused agree (xla, CPU)."""
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "bench"))
import bench_gate_fusion  # pylint: disable=g-import-not-at-top,wrong-import-position


def _close(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * max(np.abs(b).max(), 1e-30))


def test_op_fused_and_unfused_agree():
  fns = bench_gate_fusion.op_fns("xla", -5.0)
  args = bench_gate_fusion.op_inputs(1, 40, 2, 16, -5.0)
  (o_u, g_u), (o_f, g_f) = fns["unfused"](*args), fns["fused"](*args)
  _close(o_f, o_u)
  for a, b in zip(g_f, g_u):
    assert a.shape == b.shape and a.dtype == b.dtype
    _close(a, b)


def test_layer_fused_and_unfused_agree():
  fns, args = bench_gate_fusion.layer_fns(1, 24, 2, 16, "xla", -5.0)
  (l_u, g_u), (l_f, g_f) = fns["unfused"](*args), fns["fused"](*args)
  np.testing.assert_allclose(float(l_f), float(l_u), rtol=1e-2)
  for a, b in zip(jax.tree.leaves(g_f), jax.tree.leaves(g_u)):
    _close(a, b)
