"""experiments/bench/bench_documents.py: its arms run end to end on the CPU, each ablation reaches
its layers, the KDA view withholds exactly its part, and the kernel table sums and sorts."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments", "bench"))
import bench_documents  # noqa: E402

from k3jax.layers.kda import KDA  # noqa: E402
from k3jax.layers.segments import Segments  # noqa: E402
from pallas_kernels.kda.spec import KdaSpec  # noqa: E402
from pallas_kernels.tools import bench  # noqa: E402


def test_smoke_prints_every_arm_and_each_ablation_changes_the_loss(tmp_path):
  # Two layers "KA" (a KDA, an attention, a MoE FFN) and the top-k router keep the six
  # compiles short.
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench", "bench_documents.py"),
         "--config=configs/tiny.py", "--config.model.num_layers=2", "--config.model.layer_pattern=KA",
         "--config.model.router.name=topk", "--batch=2", "--seq_len=32", "--iters=1", "--rounds=1",
         "--profile", f"--json={tmp_path / 'documents.json'}"]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True, cwd=ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)).stdout
  assert "arm packed skipped" in out and "no kernel table for mask" in out
  rows = json.loads((tmp_path / "documents.json").read_text())["tables"]["documents"]["rows"]
  assert [r["arm"] for r in rows] == ["none", "mask", "kda_state", "conv", "moe", "attention"]
  assert all(r["ms fwd+bwd"] > 0 for r in rows) and rows[0]["ratio vs none"] == 1.0
  assert all(r["temp GiB"] > 0 for r in rows)  # the CPU's compiled programs report their temporaries
  loss = {r["arm"]: r["loss"] for r in rows}
  for arm in ("mask", *bench_documents.USES):  # the padding tail makes the MoE mask matter
    assert loss[arm] != loss["none"], arm


def test_document_ids_rows_hold_the_documents_then_a_bounded_tail():
  for padding in (0.0, 0.25):
    ids_bt = bench.document_ids(6, 40, 3, padding, seed=1)
    assert ids_bt.dtype == np.int32 and ids_bt.shape == (6, 40)
    for row in ids_bt:
      used = int(np.sum(row > 0))
      assert np.all(row[used:] == 0) and 40 - used <= int(padding * 40)
      # ids 1, 2, 3 in order, each a nonempty run
      assert list(np.unique(row[:used])) == [1, 2, 3] and np.all(np.diff(row[:used]) >= 0)
  tails = [int(np.sum(row == 0)) for row in bench.document_ids(16, 40, 3, 0.25, seed=2)]
  assert max(tails) > 0  # the tail is drawn, not always empty
  np.testing.assert_array_equal(bench.document_ids(4, 40, 3, seed=5), bench.document_ids(4, 40, 3, seed=5))


def test_kda_view_withholds_only_its_part():
  layer = KDA(16, 2, 8, spec=KdaSpec(chunk_size=8, sub_chunk=4, implementation="naive"),
              rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 16, 16))
  segments = Segments.from_ids(bench.document_ids(2, 16, 3, 0.2), 4)
  view = lambda **kw: bench_documents.KdaSegments(segments, **kw)
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), atol=1e-6)
  close(layer(x, view(state=True, conv=True)), layer(x, segments))
  close(layer(x, view(state=False, conv=False)), layer(x, None))
  parts = [layer(x, view(state=True, conv=False))[0], layer(x, view(state=False, conv=True))[0]]
  for part in parts:  # each part changes the output on its own
    assert not np.allclose(np.asarray(part), np.asarray(layer(x, None)[0]), atol=1e-6)


def test_kernel_deltas_sum_kinds_and_sort_by_change():
  base = [("loop_add_fusion.1", 1.0, 2.0), ("loop_add_fusion.2", 1.0, 1.0), ("gemm", 5.0, 1.0)]
  other = [("loop_add_fusion.7", 4.0, 3.0), ("gemm", 5.5, 1.0), ("kda_state_fwd", 0.25, 1.0)]
  rows = bench_documents.kernel_deltas(base, other, by_kind=True)
  assert rows[0] == ("all kernels", 7.0, 9.75, 2.75, 4.0, 5.0)
  assert [r[0] for r in rows[1:]] == ["loop_add_fusion", "gemm", "kda_state_fwd"]
  assert rows[1][1:4] == (2.0, 4.0, 2.0)
  raw = bench_documents.kernel_deltas(base, other, by_kind=False)
  assert {r[0] for r in raw} >= {"loop_add_fusion.1", "loop_add_fusion.7"}
