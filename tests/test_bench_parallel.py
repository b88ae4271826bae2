"""experiments/bench/bench_parallel.py runs a data-parallel and a pipelined mesh end to end on
four CPU devices and prints a row for each."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_parallel_prints_a_pipelined_row_beside_data_parallel(tmp_path):
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench", "bench_parallel.py"),
         "--meshes=2,1,1:1,1,1,2", "--microbatches=2", "--first_layer_dense=false",
         "--batch_per_device=2", "--seq_per_device=32", "--d_model=32", "--num_layers=2",
         "--layer_pattern=K", "--num_heads=2", "--head_dim=16", "--num_experts=4",
         "--expert_hidden=32", "--vocab_size=256", "--dtype=float32", "--steps=1", "--warmup=0",
         f"--json={tmp_path / 'parallel.json'}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True,
                       env=env).stdout
  cells = [line.strip("| ").split(" | ") for line in out.splitlines() if line[2:3].isdigit()]
  rows = {row[0]: row for row in cells}
  assert sorted(rows) == ["1,1,1,2", "2,1,1,1"], out
  data, pipe = rows["2,1,1,1"], rows["1,1,1,2"]
  # Same devices, same global batch; the pipeline's bubble (S - 1) / (M + S - 1) = 1 / 3.
  assert data[1] == pipe[1] == "2" and data[2] == pipe[2] == "4x32"
  assert data[7] == "-" and pipe[7] == "0.33"
  for row in (data, pipe):
    assert float(row[3]) > 0 and float(row[8]) > 0, row  # step ms, loss
  record = json.loads((tmp_path / "parallel.json").read_text())
  assert record["command"].startswith("python ") and record["peer_or_base"].startswith("base:")
  (table,) = record["tables"].values()
  assert "eff vs base" in table["columns"]
  assert [r["mesh d,e,c,s"] for r in table["rows"]] == ["2,1,1,1", "1,1,1,2"]
  assert table["rows"][1]["bubble"] == 0.33
