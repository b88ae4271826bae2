"""experiments/bench/bench_decode.py on tiny shapes (a smoke test; CPU times mean nothing)."""
import json
import math
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "bench"))
import bench_decode  # pylint: disable=g-import-not-at-top,wrong-import-position
from pallas_kernels.kda import decode  # pylint: disable=g-import-not-at-top,wrong-import-position


def _finite_positive(row, keys):
  return all(math.isfinite(row[k]) and row[k] > 0 for k in keys)


def test_tilings_parse():
  assert bench_decode.parse_tilings(["32:4", "128"]) == [(32, 4), (128, decode.DEFAULT_NUM_WARPS)]
  with pytest.raises(ValueError, match="'32x4' is not BV or BV:num_warps"):
    bench_decode.parse_tilings(["32x4"])


def test_layer_and_model_tables(capsys, tmp_path):
  tiny = bench_decode.PRESETS["tiny"]
  rows = bench_decode.layer_table([2], [1, 3], ["naive", "fused", "pallas"], [(8, 2)],
                                  heads=tiny["heads"], head_dim=tiny["head_dim"],
                                  dtype=jnp.bfloat16, steps=2, iters=1, bandwidth=3.5)
  assert [(r["impl"], r["t_new"]) for r in rows] == [
      (name, t) for t in (1, 3) for name in ("naive", "fused", "pallas:bv8w2")]
  for r in rows:
    assert _finite_positive(r, ("us", "tok_s", "gb_s", "roofline_us", "x_roofline", "ratio"))
    tokens_per_step = r["tok_s"] * r["us"] / 1e6
    assert math.isclose(tokens_per_step, 2 * r["t_new"], rel_tol=1e-9)  # B * T_new tokens per step
  assert rows[0]["ratio"] == 1.0
  model_rows = bench_decode.model_table([1], ["naive", "pallas"], model_cfg=tiny["model"],
                                        dtype="float32", prompt=3, steps=2, iters=1)
  assert [r["impl"] for r in model_rows] == ["naive", "pallas"]
  assert all(_finite_positive(r, ("ms", "tok_s", "ratio")) for r in model_rows)
  out = capsys.readouterr().out
  assert "| impl | B | T_new | us/step |" in out and "| kda_decode | B | ms/step |" in out
  bench_decode.write_json(str(tmp_path / "decode.json"))
  record = json.loads((tmp_path / "decode.json").read_text())
  assert record["command"].startswith("python ") and record["peer_or_base"].startswith("base:")
  tables = record["tables"]
  assert len(tables["layer"]["rows"]) == len(rows) and len(tables["model"]["rows"]) == 2
  assert "tok/s" in tables["layer"]["columns"] and tables["model"]["rows"][0]["ratio vs first"] == 1.0
