"""experiments/bench/bench_kda_memory.py: its policy column and one interpreted row (CPU)."""
import json
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments", "bench"))

import bench_kda_memory  # noqa: E402


def test_default_column_names_the_segments_of_the_policy():
  assert bench_kda_memory.default_choice(1, 2 ** 20, 16, 128) == (4, 2 ** 20 * 16 * 1792)
  assert bench_kda_memory.default_choice(1, 2 ** 15, 16, 128) == (1, 2 ** 15 * 16 * 1792)


def test_one_row_runs_interpreted(tmp_path):
  rows = []
  for policy in ("default", "recompute"):
    row = bench_kda_memory.measure(1, 64, 2, 16, policy, iters=1, lower_bound=-5.0)
    assert "error" not in row, row
    assert row["finite"] and row["compiled"] > 0 and row["ms"] > 0
    rows.append((64, 2 ** 20, 1, policy, row))
  bench_kda_memory.table(rows, str(tmp_path / "memory.json"))
  record = json.loads((tmp_path / "memory.json").read_text())
  assert record["command"].startswith("python ") and record["peer_or_base"].startswith("none")
  (table,) = record["tables"].values()
  assert [r["policy"] for r in table["rows"]] == ["default", "recompute"]
  assert "fwd+bwd ms" in table["columns"] and table["rows"][0]["outputs finite"] == "True"


def test_calls_in_flight_fit_beside_the_arguments():
  """Each call in flight holds its outputs and temporaries: the million-token
  program (24 GiB of arguments, 24 of outputs, 19 of temporaries, 104 GiB
  usable) gets one, a small one the whole round; no statistics, no cap."""
  gib = 2 ** 30

  def program(args, outs, temp):
    stats = types.SimpleNamespace(argument_size_in_bytes=args * gib,
                                  output_size_in_bytes=outs * gib,
                                  temp_size_in_bytes=temp * gib, alias_size_in_bytes=0)
    return types.SimpleNamespace(memory_analysis=lambda: stats)

  assert bench_kda_memory.calls_in_flight(program(24, 24, 19), 5, limit=104 * gib) == 1
  assert bench_kda_memory.calls_in_flight(program(6, 6, 10), 5, limit=104 * gib) == 3
  assert bench_kda_memory.calls_in_flight(program(1, 1, 1), 5, limit=104 * gib) == 5
  assert bench_kda_memory.calls_in_flight(types.SimpleNamespace(memory_analysis=lambda: None),
                                          5, limit=104 * gib) == 5
