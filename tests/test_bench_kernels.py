"""The kernel benchmark and tuning helpers: override parsing, grids, tables, the peer (no timing)."""
import dataclasses
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "bench"))
import bench_kernels  # pylint: disable=g-import-not-at-top,wrong-import-position

from pallas_kernels.tools import bench  # pylint: disable=wrong-import-position
from pallas_kernels.tools import bench_json  # pylint: disable=wrong-import-position
from pallas_kernels.kda import kernel_config  # pylint: disable=wrong-import-position


def test_overrides_parse_to_kernel_config_fields():
  got = bench.parse_overrides(
      ["inverse=blocked", "mm_dtype=bfloat16", "save_residuals=false", "block_v=32",
       "warps.intra_fwd=8"])
  assert got["inverse"] == "blocked"
  assert got["mm_dtype"] == jnp.dtype(jnp.bfloat16)
  assert got["save_residuals"] is False
  assert got["block_v"] == 32
  assert got["num_warps"] == (("intra_fwd", 8),)   # only the named stage
  cfg = kernel_config.make_config(backend="interpret", dtype=jnp.bfloat16, head_k=64, head_v=64,
                                  chunk_size=64, sub_chunk=16, overrides=got)
  assert cfg.inverse == "blocked" and dict(cfg.num_warps)["intra_fwd"] == 8


@pytest.mark.parametrize("item, match", [("inverse", "not name=value"),
                                         ("warps.nope=4", "stage must be one of")])
def test_bad_overrides_are_named(item, match):
  with pytest.raises(ValueError, match=match):
    bench.parse_overrides([item])


def test_peer_results_survive_its_timeout(capsys):
  """Lines the peer printed before --peer_timeout are echoed at once and kept."""
  import time  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["bench_kernels", "--peer_timeout=3"])
  try:
    line = '{"shape": "1x8x1x16", "safe": true, "fwd": 1.5, "fwdbwd": 4.0}'
    code = f"import time; print({line!r}, flush=True); time.sleep(60)"
    peer = bench_kernels.spawn_echoing([sys.executable, "-c", code])
    t0 = time.time()
    got = bench_kernels.collect_peer(peer, t0)
    assert time.time() - t0 < 20
  finally:
    flags.FLAGS.unparse_flags()
  assert got == {("1x8x1x16", True): {"do_bench": (1.5, 4.0)}}
  out = capsys.readouterr().out
  assert "peer: {" in out and "1 results kept" in out


def test_timers_return_per_call_times():
  """Both timers run a jitted function and return a per-call time (no speed asserted)."""
  fn = jax.jit(lambda x: x * 2.0 + 1.0)
  x = jnp.ones((8,))
  assert bench.time_ms(fn, x, iters=3, warmup=1) > 0
  assert bench.pipelined_ms(fn, x, iters=3, rounds=2, warmup=1) > 0


def test_shared_timer_loops_wait_as_documented():
  """`timing` (used by both sides): sync waits on every call, pipelined once per
  round on the round's list of results; warm-up calls are waited for too."""
  from pallas_kernels import timing  # pylint: disable=g-import-not-at-top
  calls, waits = [], []
  call = lambda: calls.append(1) or len(calls)
  assert timing.sync_ms(call, waits.append, iters=4, warmup=2) >= 0
  assert len(calls) == 6 and waits == [1, 2, 3, 4, 5, 6]
  calls.clear(), waits.clear()
  assert timing.pipelined_ms(call, waits.append, iters=3, rounds=2, warmup=1) >= 0
  assert len(calls) == 7 and waits == [1, [2, 3, 4], [5, 6, 7]]


def test_tuning_grid_and_table():
  assert bench.parse_grid("block_v=32,64; warps.state_fwd=4,8") == [
      ["block_v=32", "warps.state_fwd=4"], ["block_v=32", "warps.state_fwd=8"],
      ["block_v=64", "warps.state_fwd=4"], ["block_v=64", "warps.state_fwd=8"]]
  for bad in ("", "block_v", "block_v=", ";"):
    with pytest.raises(ValueError):
      bench.parse_grid(bad)
  times = lambda f, s: {"cumsum": 0.5, "intra_fwd": f, "state_fwd": 1.0, "state_bwd": 2.0,
                        "intra_bwd": s}
  split = dict(times(4.5, 14.0), intra_bwd_cc=3.0, intra_bwd_k=11.0)  # kernels of intra_bwd
  text = bench.stage_table([("a", times(4.0, 13.0)), ("b", times(5.0, 12.0)),
                            ("c", "ValueError: block_v must be a power of two"), ("d", split)])
  rows = {line.split(" | ")[0][2:]: line for line in text.splitlines()[2:]}
  assert text.splitlines()[0].endswith("| intra_bwd | intra_bwd_cc | intra_bwd_k | fwd sum "
                                       "| bwd sum |")
  assert "| 4.000* |" in rows["a"] and "| 5.500* |" in rows["a"]   # intra_fwd and fwd sum
  assert "| 12.000* |" in rows["b"] and "| 14.000* |" in rows["b"]  # intra_bwd and bwd sum
  assert "failed: ValueError" in rows["c"]
  # Stages a row did not run print as "-"; the split kernels are not added to bwd sum twice.
  assert "| 13.000 | - | - | 5.500* | 15.000 |" in rows["a"]
  assert "| 14.000 | 3.000* | 11.000* | 6.000 | 16.000 |" in rows["d"]
  # A row of stages outside both sums (tune_kda --stages=diag_fwd,diag_bwd) has no sums.
  only_diag = bench.stage_table([("e", {"diag_fwd": 0.2, "diag_bwd": 0.4})]).splitlines()[2]
  assert only_diag == "| e | 0.200* | 0.400* | - | - |"
  # tune_kda --json: the same table as rows, numbers without the stars.
  parsed = bench_json.parse_table(text.replace("*", ""))
  assert parsed["columns"][0] == "config" and "fwd sum" in parsed["columns"]
  assert parsed["rows"][0]["intra_fwd"] == 4.0 and parsed["rows"][0]["intra_bwd_cc"] == "-"
  assert parsed["rows"][2]["cumsum"].startswith("failed: ValueError")


@pytest.mark.parametrize("block_v", [12, 128, 0])
def test_block_v_override_is_validated(block_v):
  """An override meets the same tile rule as the argument (power of two dividing V)."""
  with pytest.raises(ValueError, match="block_v must be a power of two dividing V=64"):
    kernel_config.make_config(backend="interpret", dtype=jnp.float32, head_k=64, head_v=64,
                              chunk_size=64, sub_chunk=16, overrides={"block_v": block_v})
  with pytest.raises(ValueError, match="block_v must be"):
    kernel_config.make_config(backend="interpret", dtype=jnp.float32, head_k=64, head_v=64,
                              chunk_size=64, sub_chunk=16, block_v=block_v)


@pytest.mark.parametrize("backend,block_k", [("interpret", 24), ("interpret", 128),
                                             ("triton", 8)])
def test_block_k_override_is_validated(backend, block_k):
  """The intra kernels' K slice divides K and, on the GPU, is a legal dot dim."""
  with pytest.raises(ValueError, match="block_k must be a power of two dividing K=64"):
    kernel_config.make_config(backend=backend, dtype=jnp.float32, head_k=64, head_v=64,
                              chunk_size=64, sub_chunk=16, overrides={"block_k": block_k})


@pytest.mark.parametrize("overrides, match", [
    ({"rec_block_v": 24}, "rec_block_v must be None or a power of two dividing V=64"),
    ({"bwd_block_v": 128}, "bwd_block_v must be None or a power of two dividing V=64"),
    ({"num_warps": (("state_recc", 1),)}, "num_warps names unknown stages"),
    ({"out_block_v": 8}, "unknown KernelConfig fields in overrides: \\['out_block_v'\\]"),
])
def test_state_pass_tiles_are_validated(overrides, match):
  with pytest.raises(ValueError, match=match):
    kernel_config.make_config(backend="triton", dtype=jnp.float32, head_k=64, head_v=64,
                              chunk_size=64, sub_chunk=16, overrides=overrides)


def test_warps_override_one_stage():
  got = bench.parse_overrides(["warps.state_rec=2", "num_stages=3"])
  cfg = kernel_config.make_config(backend="triton", dtype=jnp.bfloat16, head_k=64, head_v=64,
                                  chunk_size=64, sub_chunk=16, overrides=got)
  rec, other = cfg.compiler_params("state_rec"), cfg.compiler_params("state_bwd")
  assert (rec.num_stages, rec.num_warps) == (3, 2)
  assert (other.num_stages, other.num_warps) == (3, 4)


def test_reverse_state_tile_default_and_partial_warps_overrides():
  """Triton at K = V = 128 with bf16 inputs and many (batch row, head) pairs:
  the reverse state kernel takes the whole V with 8 warps; elsewhere block_v
  and 4. Fewer pairs: the forward recurrence takes a V tile of 32, and with
  at most 16 pairs the reverse one too. A warps override of another stage
  keeps it."""
  make = lambda d, items=(): kernel_config.make_config(
      backend="triton", dtype=jnp.bfloat16, head_k=d, head_v=d, chunk_size=64, sub_chunk=16,
      overrides=bench.parse_overrides(list(items)))
  cfg = make(128)
  assert cfg.bwd_block_v == 128 and cfg.compiler_params("state_bwd").num_warps == 8
  assert cfg.block_v == 64 and cfg.compiler_params("state_rec").num_warps == 4
  assert make(64).bwd_block_v is None and make(64).compiler_params("state_bwd").num_warps == 4
  swept = make(128, ["warps.intra_bwd_k=4"])
  assert swept.compiler_params("intra_bwd_k").num_warps == 4
  assert swept.compiler_params("state_bwd").num_warps == 8
  assert make(128, ["warps.state_bwd=2"]).compiler_params("state_bwd").num_warps == 2
  pairs = lambda n, **kw: kernel_config.make_config(
      backend="triton", dtype=jnp.bfloat16, head_k=128, head_v=128, chunk_size=64,
      sub_chunk=16, state_programs=n, **kw)
  few = pairs(64)
  assert few.bwd_block_v is None and few.compiler_params("state_bwd").num_warps == 4
  assert few.rec_block_v == 32 and few.block_v == 64
  assert cfg.rec_block_v is None and pairs(128).rec_block_v is None
  fewest = pairs(16)
  assert fewest.bwd_block_v == 32 and fewest.rec_block_v == 32 and fewest.block_v == 64
  assert pairs(17).bwd_block_v is None
  # An explicit block_v keeps every state tile; explicit tiles win over the rule.
  assert pairs(16, block_v=64).rec_block_v is None and pairs(16, block_v=64).bwd_block_v is None
  assert pairs(16, overrides={"rec_block_v": 64}).rec_block_v == 64
  assert make(128, ["block_v=32"]).bwd_block_v is None   # an explicit tile is everyone's
  f32 = kernel_config.make_config(backend="triton", dtype=jnp.float32, head_k=128, head_v=128,
                                  chunk_size=64, sub_chunk=16)
  assert f32.bwd_block_v is None and f32.compiler_params("state_bwd").num_warps == 4
  tpu = kernel_config.make_config(backend="tpu_interpret", dtype=jnp.bfloat16, head_k=128,
                                  head_v=128, chunk_size=64, sub_chunk=16)
  assert tpu.bwd_block_v is None


def test_bwd_block_k_override_is_validated():
  with pytest.raises(ValueError, match="bwd_block_k must be a power of two dividing K=64"):
    kernel_config.make_config(backend="triton", dtype=jnp.float32, head_k=64, head_v=64,
                              chunk_size=64, sub_chunk=16, overrides={"bwd_block_k": 8})


def test_block_k_defaults():
  make = lambda backend, dk: kernel_config.make_config(
      backend=backend, dtype=jnp.bfloat16, head_k=dk, head_v=64, chunk_size=64, sub_chunk=16)
  assert make("triton", 128).block_k == 64
  assert make("interpret", 16).block_k == 16
  assert make("tpu_interpret", 128).block_k == 128
  # The split backward's slice (faster at 32 than 64 on the H200).
  assert make("triton", 128).bwd_block_k == 32
  assert make("interpret", 16).bwd_block_k == 16
  # The blocked inverse is the GPU default (and so interpret mode's); TPU keeps substitution.
  assert make("triton", 128).inverse == "blocked"
  assert make("interpret", 128).inverse == "blocked"
  assert make("tpu_interpret", 128).inverse == "substitution"
  small_tiles = kernel_config.make_config(backend="triton", dtype=jnp.bfloat16, head_k=64,
                                          head_v=64, chunk_size=64, sub_chunk=8)
  assert small_tiles.inverse == "substitution"  # blocked needs L >= 16 on the GPU


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_operand_dtypes_follow_the_inputs(dtype):
  """The matmuls take the input dtype (f32 stays f32); the intra backward's
  too at K * V >= 128 * 128 on the GPU (and in interpret mode), else f32."""
  make = lambda backend, d: kernel_config.make_config(
      backend=backend, dtype=dtype, head_k=d, head_v=d, chunk_size=64, sub_chunk=16)
  for backend in ("triton", "interpret"):
    assert make(backend, 128).mm_dtype == jnp.dtype(dtype)
    assert make(backend, 128).intra_bwd_mm_dtype == jnp.dtype(dtype)
    assert make(backend, 64).intra_bwd_mm_dtype == jnp.float32
  assert make("tpu", 128).intra_bwd_mm_dtype == jnp.float32
  assert make("triton", 128).backward().mm_dtype == jnp.dtype(dtype)


def test_heuristic_config_is_make_config_without_overrides():
  shape = kernel_config.KernelShape(head_k=128, head_v=128, chunk_size=64, sub_chunk=16,
                                    state_programs=256)
  for backend in kernel_config.BACKENDS:
    assert kernel_config.heuristic_config(shape, jnp.bfloat16, backend) == (
        kernel_config.make_config(backend=backend, dtype=jnp.bfloat16, head_k=128, head_v=128,
                                  chunk_size=64, sub_chunk=16, state_programs=256))
  gpu = kernel_config.heuristic_config(shape, jnp.bfloat16, "triton")
  cpu = kernel_config.heuristic_config(shape, jnp.bfloat16, "interpret")
  assert dataclasses.replace(cpu, backend="triton") == gpu   # interpret mode runs the GPU's


def test_stage_times_smoke_with_split_backward():
  """Every stage runs (interpret mode, tiny shape), the split kernels timed on their own."""
  args = bench.make_inputs(jax.random.PRNGKey(0), 1, 40, 1, 16, jnp.float32)
  times = bench.stage_times_ms(*args, diagonal="dense", chunk_size=16, sub_chunk=8, iters=1,
                               config_overrides={"intra_bwd": "split", "bwd_block_k": 8},
                               interpret=True)
  assert set(times) == {"cumsum", "cumsum_xla", "intra_fwd", "state_fwd", "intra_fwd+M",
                        "state_fwd+save", "state_rec", "output_fwd", "state_bwd", "intra_bwd",
                        "intra_bwd_cc", "intra_bwd_k", "dg_cumsum"}
  assert set(times) == set(bench.ALL_STAGES) - {"diag_fwd", "diag_bwd"} - set(bench.OPT_IN_STAGES)
  assert all(t > 0 for t in times.values())
  # The pairwise diagonal's own kernels are stages of their own.
  pairwise = bench.stage_times_ms(*args, diagonal="pairwise", chunk_size=32, sub_chunk=16,
                                  iters=1, interpret=True,
                                  stages=["diag_fwd", "diag_bwd", "intra_bwd_k"])
  assert set(pairwise) == {"diag_fwd", "diag_bwd", "intra_bwd_k"}
  only = bench.stage_times_ms(*args, diagonal="dense", chunk_size=16, sub_chunk=8, iters=1,
                              config_overrides={"intra_bwd": "split", "bwd_block_k": 8},
                              interpret=True,
                              stages=["state_rec", "intra_bwd_k"])
  assert set(only) == {"state_rec", "intra_bwd_k"}
  with pytest.raises(ValueError, match="unknown stages"):
    bench.stage_times_ms(*args, diagonal="dense", chunk_size=16, sub_chunk=8, iters=1,
                         interpret=True, stages=["state_recc"])


def test_peer_kernel_table_sums_cuda_kernels_per_call():
  """`fla_peer.cuda_kernel_table` keeps CUDA events only, averages per call,
  sorts by time and reads either torch attribute name for the device time."""
  import types  # pylint: disable=g-import-not-at-top
  import fla_peer  # pylint: disable=g-import-not-at-top

  def evt(name, device, us, attr="device_time"):
    return types.SimpleNamespace(name=name, device_type=f"DeviceType.{device}", **{attr: us})

  events = [evt("kernel_a", "CUDA", 300.0), evt("kernel_a", "CUDA", 100.0),
            evt("kernel_b", "CUDA", 600.0, attr="cuda_time"), evt("aten::mm", "CPU", 5000.0)]
  table, total = fla_peer.cuda_kernel_table(events, calls=2)
  assert total == pytest.approx(0.5)          # (300 + 100 + 600) us over 2 calls
  rows = table.splitlines()[2:]
  assert rows[0].startswith("| kernel_b | 0.300 | 0.5 | 60% |")
  assert rows[1].startswith("| kernel_a | 0.200 | 1 | 40% |")
  assert "aten::mm" not in table


def test_ab_forward_smoke():
  """The A/B script runs its variants interleaved (interpret mode, tiny shape) and
  prints one row per variant, with the output difference from the first."""
  import subprocess  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(
      [sys.executable, os.path.join(root, "experiments", "bench", "ab_forward.py"), "--interpret",
       "--rounds=1", "--variants=,inverse=blocked+block_k=16"],
      capture_output=True, text=True, check=True, cwd=root).stdout
  rows = [line for line in out.splitlines() if line.startswith("| ") and "variant" not in line]
  assert [row.split(" | ")[0] for row in rows] == ["| defaults", "| inverse=blocked+block_k=16"]
  assert rows[0].endswith("| 0.0e+00 |")
  # The blocked body computes the same outputs as the substitution one (bf16 rounding apart).
  assert float(rows[1].split("|")[-2]) < 1e-2


def test_json_rows_join_ours_and_the_peer_by_timer():
  rows = [("1x8x1x16", {"pallas:dense": {"pipelined": (1.0, 2.0)}}, 0.1, 0.2)]
  peer = {("1x8x1x16", True): {"do_bench": (1.5, 4.0), "pipelined": (1.4, 3.9)}}
  got, = bench_kernels.json_rows(rows, peer)
  assert got["B"] == 1 and got["T"] == 8 and got["impl"] == "pallas:dense" and got["timing"] == "pipelined"
  assert (got["fwd_ms"], got["fwdbwd_ms"], got["floor_fwd_ms"]) == (1.0, 2.0, 0.1)
  assert (got["fla_safe_fwd_ms"], got["fla_safe_fwdbwd_ms"], got["fla_safe_do_bench_ms"]) == (1.4, 3.9, [1.5, 4.0])
  assert got["fla_unsafe_fwd_ms"] is None and got["fla_unsafe_do_bench_ms"] is None


def test_bench_kernels_writes_its_rows_as_json(tmp_path):
  """A CPU shape through the xla path end to end: the JSON holds the printed rows and their context."""
  import json  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  path = tmp_path / "kda.json"
  subprocess.run(
      [sys.executable, os.path.join(root, "experiments", "bench", "bench_kernels.py"), "--shapes=1x64x1x16",
       "--impls=xla:dense", "--peer=false", "--stages=", "--iters=1", "--ceiling_bytes=4096",
       "--ceiling_matmul=64", "--chunk_size=16", f"--json={path}"],
      capture_output=True, text=True, check=True, cwd=root, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  data = json.loads(path.read_text())
  assert "--shapes=1x64x1x16" in data["command"] and data["platform"] == "cpu" and data["gpu"]
  assert "commit" in data and data["peer_or_base"].startswith("none")
  rows = data["tables"]["kda"]
  assert [(r["impl"], r["timing"]) for r in rows] == [("xla:dense", "sync"), ("xla:dense", "pipelined")]
  assert all(r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["floor_fwd_ms"] > 0 for r in rows)
