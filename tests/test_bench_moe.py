"""experiments/bench/bench_moe.py runs end to end on the CPU, prints its tables and writes them as JSON."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_moe_smoke_prints_layer_parts_and_kernel_tables(tmp_path):
  # One process for every table (each start costs JAX's import and compiles).
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench", "bench_moe.py"), "--shapes=smoke",
         "--impls=buffered,ragged,ragged:pallas", "--iters=1", "--rounds=1", "--warmup=0",
         "--rate_matmul=128", "--backward=false", "--kernels",
         "--gmm_config=block_m=16,block_n=16,block_k=16", f"--json={tmp_path / 'moe.json'}"]
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
  # The JSON holds every printed row under its table, with the command line and the device.
  data = json.loads((tmp_path / "moe.json").read_text())
  assert "--shapes=smoke" in data["command"] and data["platform"] == "cpu" and "commit" in data
  assert data["peer_or_base"] and data["shapes"]["smoke"] == [2, 64, 32, 8, 2, 16]
  tables = data["tables"]
  assert sum(len(t["rows"]) for t in tables.values()) == len(rows)
  layer = tables["layer"]["rows"]
  assert [r["what"] for r in layer] == labels[:4] and all(r["fwd ms"] > 0 for r in layer)
