"""bench_json.write: the record a benchmark's --json leaves for docs/data."""
import json
import math

import jax

from pallas_kernels.tools import bench_json


def test_write_makes_directories_records_the_run_and_says_where(tmp_path, capsys):
  path = tmp_path / "new" / "dir" / "bench.json"
  tables = {"speed": {"columns": ["shape", "ms"], "rows": [["16x2048", 1.5], ["4x8192", math.nan]]}}
  bench_json.write(str(path), tables, peer_or_base="base: none", shapes=2)
  assert capsys.readouterr().out == f"wrote {path}\n"
  written = json.loads(path.read_text())
  assert written["peer_or_base"] == "base: none" and written["shapes"] == 2
  assert written["platform"] == jax.devices()[0].platform and written["command"].startswith("python ")
  # A NaN cell (a failed timing) is stored as null: the file stays strict JSON.
  assert written["tables"]["speed"]["rows"] == [["16x2048", 1.5], ["4x8192", None]]
