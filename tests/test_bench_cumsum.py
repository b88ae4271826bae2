"""The passes experiments/bench/bench_cumsum.py times compute what they are named (interpret, CPU)."""
import numpy as np

from pallas_kernels.tools import bench
from pallas_kernels.kda import kernel_config


def test_passes_compute_the_cumsums_they_name():
  cfg = kernel_config.make_config(backend="interpret", dtype="bfloat16", head_k=32, head_v=32,
                                  chunk_size=16, sub_chunk=16)
  table = bench.cumsum_passes(1, 64, 64, chunk_size=16, lower_bound=-5.0, cfg=cfg, block_f=None)
  run = {name: fn(*args) for name, (fn, args, _) in table.items()}
  g = np.asarray(table["cumsum"][1][0], np.float64).reshape(1, 4, 16, 64)
  prefix = np.cumsum(g, axis=2).reshape(1, 64, 64)
  suffix = np.cumsum(g[:, :, ::-1], axis=2)[:, :, ::-1].reshape(1, 64, 64)
  tol = dict(rtol=0, atol=1e-5)
  for name in ("cumsum", "clamped", "cumsum_xla"):
    np.testing.assert_allclose(run[name], prefix, **tol, err_msg=name)
  np.testing.assert_allclose(run["clamped+record"][0], prefix, **tol)
  assert int(np.asarray(run["clamped+record"][1][0]).sum()) == 0   # in range: nothing flagged
  # The backward passes read g as their cotangent dG.
  for name in ("reverse", "clamped_bwd"):
    np.testing.assert_allclose(run[name], suffix, **tol, err_msg=name)
  assert run["gate"].shape == (1, 64, 64) and run["gate_bwd"][0].shape == (1, 64, 64)
  assert set(table) >= {"xla_copy"} and all(nbytes > 0 for _, _, nbytes in table.values())
