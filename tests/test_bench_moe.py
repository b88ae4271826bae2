"""experiments/bench/bench_moe.py runs end to end on the CPU and prints both tables."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_moe_smoke_prints_layer_parts_and_kernel_tables():
  # One process for every table (each start costs JAX's import and compiles).
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench", "bench_moe.py"), "--shapes=smoke",
         "--impls=buffered,ragged,ragged:pallas", "--iters=1", "--rounds=1", "--warmup=0",
         "--rate_matmul=128", "--backward=false", "--kernels",
         "--gmm_config=block_m=16,block_n=16,block_k=16"]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu")).stdout
  assert "## layer" in out and "## parts (buffered)" in out
  rows = [line for line in out.splitlines() if line.startswith("| smoke |")]
  labels = [row.split("|")[2].strip() for row in rows]
  assert labels[:4] == ["dense SwiGLU 48", "MoE buffered", "MoE ragged", "MoE ragged:pallas"]
  assert "## grouped matmuls (GmmConfig(block_m=16" in out
  kernels = [row.split("|") for row in rows if "gmm" in row.split("|")[2]]
  assert len(kernels) == 3
  for row in kernels:  # kernel ms, dense ms and their rate ratio are positive numbers
    assert float(row[3]) > 0 and float(row[5]) > 0 and float(row[7]) > 0, row
  for part in ("capacity pass alone (count)", "slot plan (sort)", "dispatch gather", "combine",
               "shared expert"):
    assert part in labels, part
  for row in rows:  # every forward time is a positive number
    assert float(row.split("|")[3]) > 0, row

