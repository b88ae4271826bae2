"""experiments/bench/bench_kda_memory.py: its policy column and one interpreted row (CPU)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments", "bench"))

import bench_kda_memory  # noqa: E402


def test_default_column_names_the_segments_of_the_policy():
  assert bench_kda_memory.default_choice(1, 2 ** 20, 16, 128) == (4, 2 ** 20 * 16 * 1792)
  assert bench_kda_memory.default_choice(1, 2 ** 15, 16, 128) == (1, 2 ** 15 * 16 * 1792)


def test_one_row_runs_interpreted():
  for policy in ("default", "recompute"):
    row = bench_kda_memory.measure(1, 64, 2, 16, policy, iters=1, lower_bound=-5.0)
    assert "error" not in row, row
    assert row["finite"] and row["compiled"] > 0 and row["ms"] > 0
