"""Benchmarks the KDA kernels against fla's `chunk_kda` and the roofline floor.

Prints one table: forward and forward+backward times (ms, median) of our
`pallas` (dense / pairwise) and `xla` paths, of fla `chunk_kda` with
safe_gate True/False run in a separate process in the same command, the
roofline floor from bandwidth and bf16 matmul rate measured in this run, and
the ratios. Optionally per-stage times of the Pallas kernels.

  python experiments/bench/bench_kernels.py --shapes=16x2048x16x128,4x8192x16x128
  python experiments/bench/bench_kernels.py --impls=pallas:dense,pallas:pairwise --sub_chunk=32 \
      --lower_bound=-2.5 --peer=false        # the tile 32 / 64 ablation pairs (-1.3 at 64)
  python experiments/bench/bench_kernels.py --mode=fla --shapes=...   # peer only (torch)
  CUDA_VISIBLE_DEVICES=0 python experiments/bench/bench_kernels.py --peer_gpu=1   # peer on GPU 1, concurrently
  python experiments/bench/bench_kernels.py --shapes=4x8192x16x96,4x8192x16x128 --peer=false --stages=
  python experiments/bench/bench_kernels.py ... --json=/tmp/kda.json   # the rows as JSON too

D need not be a power of two: the pallas path pads it inside the op (the
per-stage times call the kernels directly and take powers of two only).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app
from absl import flags

_MODE = flags.DEFINE_enum("mode", "jax", ["jax", "fla"], "jax: our kernels (+ peer "
                          "subprocess); fla: only the PyTorch peer, JSON lines out.")
_SHAPES = flags.DEFINE_list("shapes", ["16x2048x16x128", "1x8192x16x128", "4x8192x16x128",
                                       "1x32768x16x128"], "BxTxHxD shapes (K = V = D).")
_IMPLS = flags.DEFINE_list("impls", ["pallas:dense", "pallas:pairwise", "xla:dense"],
                           "implementation:diagonal pairs to time.")
_PEER = flags.DEFINE_bool("peer", True, "Also time fla chunk_kda in a subprocess.")
_PEER_TIMEOUT = flags.DEFINE_integer("peer_timeout", 900, "Seconds allowed to the fla "
                                     "subprocess (its first calls autotune).")
_PEER_GPU = flags.DEFINE_integer("peer_gpu", -1, "Run the peer concurrently on this other GPU "
                                 "(CUDA_VISIBLE_DEVICES of the subprocess; start this process "
                                 "with CUDA_VISIBLE_DEVICES set to a different one). -1: run it "
                                 "on the same GPU after our timings.")
_STAGES = flags.DEFINE_list("stages", ["dense", "pairwise"], "Diagonal strategies whose "
                            "per-kernel pallas times are printed (empty: none).")
_PEER_MODES = flags.DEFINE_list("peer_modes", ["safe", "unsafe"], "fla safe_gate modes to time.")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls per measurement (median).")
_LOWER_BOUND = flags.DEFINE_float("lower_bound", -5.0, "Gate lower bound g_min.")
_CHUNK = flags.DEFINE_integer("chunk_size", 64, "Chunk length C.")
_SUB = flags.DEFINE_integer("sub_chunk", 16, "Diagonal tile length L.")
_OVERRIDES = flags.DEFINE_list("overrides", [], "KernelConfig fields of the pallas path "
                               "(see pallas_kernels.tools.bench.parse_overrides), e.g. "
                               "mm_dtype=float32,inverse=blocked,warps.intra_fwd=8.")
_CEIL_BYTES = flags.DEFINE_integer("ceiling_bytes", 2 ** 32, "Array size of the bandwidth "
                                   "measurement.")
_CEIL_MM = flags.DEFINE_integer("ceiling_matmul", 8192, "Size of the square bf16 matmul.")
_XLA_MAX_TOKENS = flags.DEFINE_integer("xla_max_tokens", 2 ** 16, "Skip the xla path above "
                                       "B*T tokens (memory).")
_JSON = flags.DEFINE_string("json", "", "Also write the table's rows, the ceilings, the command "
                            "line, device and commit to this JSON file (see "
                            "pallas_kernels/tools/bench_json.py).")


def _parse(shape):
  b, t, h, d = (int(x) for x in shape.split("x"))
  return b, t, h, d


def _run_fla(shapes, iters, lower_bound):
  """Times fla chunk_kda (bf16) and prints one JSON line per shape and mode."""
  import torch  # pylint: disable=g-import-not-at-top
  from fla.ops.kda import chunk_kda  # pylint: disable=g-import-not-at-top
  from triton.testing import do_bench  # pylint: disable=g-import-not-at-top
  import fla_peer  # pylint: disable=g-import-not-at-top
  # Imports no jax: the peer process keeps to torch.
  from pallas_kernels import timing  # pylint: disable=g-import-not-at-top

  def timed(fn):
    """(sync, pipelined) ms of `fn` with the loops our side uses (`bench.time_ms`,
    `bench.pipelined_ms`), waiting on a device synchronise."""
    wait = lambda _: torch.cuda.synchronize()
    return (timing.sync_ms(fn, wait, iters=iters, warmup=1),
            timing.pipelined_ms(fn, wait, iters=iters, rounds=5, warmup=1))

  for shape in shapes:
    q, k, v, g, beta, do = fla_peer.inputs(*_parse(shape), lower_bound)
    for safe in [m == "safe" for m in _PEER_MODES.value]:
      kw = fla_peer.gate_kwargs(safe, lower_bound)
      fwd = lambda: chunk_kda(q, k, v, g, beta, **kw)[0]
      with torch.no_grad():
        t_fwd = do_bench(fwd, return_mode="median", rep=max(iters * 5, 50))
        f_sync, f_pipe = timed(fwd)
      print(f"fla {shape} safe={safe} fwd {t_fwd:.3f} ms", flush=True)
      xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]

      def fwd_bwd():
        for x in xs:
          x.grad = None
        o = chunk_kda(*xs, **kw)[0]
        o.backward(do)

      t_fb = do_bench(fwd_bwd, return_mode="median", rep=max(iters * 5, 50),
                      grad_to_none=xs)
      fb_sync, fb_pipe = timed(fwd_bwd)
      print(json.dumps(dict(shape=shape, safe=safe, fwd=t_fwd, fwdbwd=t_fb, fwd_sync=f_sync,
                            fwdbwd_sync=fb_sync, fwd_pipe=f_pipe, fwdbwd_pipe=fb_pipe)),
            flush=True)


def _start_peer(shapes):
  """Starts this script with --mode=fla as a subprocess (on --peer_gpu if set).

  Its result lines are echoed as they arrive (prefixed "peer:"), so a command
  cut off by an outer time limit still shows the shapes the peer finished.
  Returns (process, stdout lines, stderr lines, reader threads).
  """
  cmd = [sys.executable, os.path.abspath(__file__), "--mode=fla",
         "--shapes=" + ",".join(shapes), f"--iters={_ITERS.value}",
         f"--lower_bound={_LOWER_BOUND.value}", "--peer_modes=" + ",".join(_PEER_MODES.value)]
  env = dict(os.environ)
  if _PEER_GPU.value >= 0:
    env["CUDA_VISIBLE_DEVICES"] = str(_PEER_GPU.value)
  return spawn_echoing(cmd, env)


def spawn_echoing(cmd, env=None):
  """Popen of `cmd` whose stdout lines are echoed ("peer: ...") and kept, stderr only kept."""
  import threading  # pylint: disable=g-import-not-at-top
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  out_lines, err_lines = [], []

  def pump(stream, sink, echo):
    for line in stream:
      sink.append(line)
      if echo:
        print("peer: " + line.rstrip(), flush=True)

  threads = [threading.Thread(target=pump, args=(proc.stdout, out_lines, True), daemon=True),
             threading.Thread(target=pump, args=(proc.stderr, err_lines, False), daemon=True)]
  for t in threads:
    t.start()
  return proc, out_lines, err_lines, threads


def collect_peer(peer, started):
  """Waits for the peer (up to --peer_timeout after its start); {(shape, safe): (fwd, fb)}."""
  import time  # pylint: disable=g-import-not-at-top
  proc, out_lines, err_lines, threads = peer
  try:
    rc = proc.wait(timeout=max(1.0, _PEER_TIMEOUT.value - (time.time() - started)))
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    rc = None
  for t in threads:
    t.join(timeout=10)
  out = {}
  for line in out_lines:
    if line.startswith("{"):
      r = json.loads(line)
      entry = {"do_bench": (r["fwd"], r["fwdbwd"])}
      if "fwd_sync" in r:   # the same two timers as ours
        entry.update(sync=(r["fwd_sync"], r["fwdbwd_sync"]),
                     pipelined=(r["fwd_pipe"], r["fwdbwd_pipe"]))
      out[(r["shape"], r["safe"])] = entry
  if rc is None:
    print(f"fla peer stopped after --peer_timeout={_PEER_TIMEOUT.value} s; "
          f"{len(out)} results kept", flush=True)
  elif rc != 0:
    print("fla peer failed:\n" + "".join(err_lines)[-3000:], flush=True)
  return out


def _run_jax(shapes):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pallas_kernels.tools import bench  # pylint: disable=g-import-not-at-top

  import time  # pylint: disable=g-import-not-at-top
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  # On another GPU the peer's autotuning cannot disturb our timings, so it starts now.
  early_peer = (_start_peer(shapes), time.time()) if _PEER.value and _PEER_GPU.value >= 0 else None
  overrides = bench.parse_overrides(_OVERRIDES.value)
  if overrides:
    print(f"pallas KernelConfig overrides: {overrides}", flush=True)
  ceil = bench.measure_ceilings(_CEIL_BYTES.value, _CEIL_MM.value)
  print(f"measured: copy bandwidth {ceil.bandwidth / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceil.matmul / 1e12:.0f} TFLOP/s", flush=True)
  rows = []
  for shape in shapes:
    b, t, h, d = _parse(shape)
    args = bench.make_inputs(jax.random.PRNGKey(0), b, t, h, d, jnp.bfloat16,
                             _LOWER_BOUND.value)
    do = jax.random.normal(jax.random.PRNGKey(1), args[2].shape, jnp.bfloat16)
    floor_f, floor_fb = bench.roofline_ms(bench.kda_cost(b, t, h, d, chunk_size=_CHUNK.value),
                                          ceil)
    res = {}
    for spec in _IMPLS.value:
      impl, diag = spec.split(":")
      if impl == "xla" and b * t > _XLA_MAX_TOKENS.value:
        continue
      kw = dict(chunk_size=_CHUNK.value, sub_chunk=_SUB.value, lower_bound=_LOWER_BOUND.value,
                config_overrides=overrides or None)
      try:
        fwd_fn = bench.kda_fn(impl, diag, **kw)
        fb_fn = bench.kda_fn(impl, diag, backward=True, **kw)
        timed = {}
        for timing, timer in (("sync", bench.time_ms), ("pipelined", bench.pipelined_ms)):
          timed[timing] = (timer(fwd_fn, *args, iters=_ITERS.value),
                           timer(fb_fn, *args, do, iters=_ITERS.value))
      except Exception as e:  # pylint: disable=broad-except
        print(f"{shape} {spec} failed: {type(e).__name__}: {str(e)[:500]}", flush=True)
        continue
      res[spec] = timed
      print(f"{shape} {spec}: " + "; ".join(
          f"{timing} fwd {f:.3f} ms, fwd+bwd {fb:.3f} ms" for timing, (f, fb) in timed.items()),
            flush=True)
    rows.append((shape, res, floor_f, floor_fb))
    if _STAGES.value:
      for diag in _STAGES.value:
        try:
          st = bench.stage_times_ms(*args, diagonal=diag, chunk_size=_CHUNK.value,
                                    sub_chunk=_SUB.value, config_overrides=overrides or None,
                                    lower_bound=_LOWER_BOUND.value)
          print(f"{shape} stages pallas:{diag}: " +
                ", ".join(f"{k} {v:.3f}" for k, v in st.items()), flush=True)
        except Exception as e:  # pylint: disable=broad-except
          print(f"{shape} stages {diag} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)

  # On the same GPU the peer runs after our timings so that its autotuning cannot eat them.
  if early_peer is not None:
    peer = collect_peer(*early_peer)
  elif _PEER.value:
    peer = collect_peer(_start_peer(shapes), time.time())
  else:
    peer = {}
  # "sync": every call waited for (host dispatch included); "pipelined":
  # calls back to back, the GPU's time per call. fla's do_bench (CUDA events,
  # L2 flushed between calls) is shown next to its pipelined time.
  print("\n| shape (B,T,H,D) | impl | timing | fwd ms | fwd+bwd ms | fla safe fwd / fwd+bwd | "
        "fla unsafe fwd / fwd+bwd | ratio vs fla safe (fwd, fwd+bwd; <1 = faster) | "
        "roofline floor fwd / fwd+bwd | x floor (fwd, fwd+bwd) |")
  print("|---|---|---|---|---|---|---|---|---|---|")

  def peer_cell(p, timing):
    if not p or timing not in p:
      return "n/a"
    cell = f"{p[timing][0]:.3f} / {p[timing][1]:.3f}"
    if timing == "pipelined":
      cell += f" (do_bench {p['do_bench'][0]:.3f} / {p['do_bench'][1]:.3f})"
    return cell

  for shape, res, ff, ffb in rows:
    ps = peer.get((shape, True))
    pu = peer.get((shape, False))
    for spec, timed in res.items():
      for timing, (f, fb) in timed.items():
        ratio = (f"{f / ps[timing][0]:.2f}, {fb / ps[timing][1]:.2f}" if ps and timing in ps
                 else "n/a")
        print(f"| {shape} | {spec} | {timing} | {f:.3f} | {fb:.3f} | {peer_cell(ps, timing)} | "
              f"{peer_cell(pu, timing)} | {ratio} | "
              f"{ff:.3f} / {ffb:.3f} | {f / ff:.1f}, {fb / ffb:.1f} |")
    if "pallas:dense" in res and "pallas:pairwise" in res:
      for timing in res["pallas:dense"]:
        (fd, fbd), (fp, fbp) = res["pallas:dense"][timing], res["pallas:pairwise"][timing]
        print(f"| {shape} | pairwise/dense | {timing} | {fp / fd:.2f}x | {fbp / fbd:.2f}x "
              f"| | | | | |")
  sys.stdout.flush()
  if _JSON.value:
    _write_json(_JSON.value, rows, peer, ceil)


def json_rows(rows, peer):
  """One dict per (shape, impl, timing) of the printed table; times in ms, None where absent."""
  out = []
  for shape, res, floor_f, floor_fb in rows:
    b, t, h, d = _parse(shape)
    for spec, timed in res.items():
      for timing, (f, fb) in timed.items():
        row = dict(shape=shape, B=b, T=t, H=h, D=d, impl=spec, timing=timing, fwd_ms=f,
                   fwdbwd_ms=fb, floor_fwd_ms=floor_f, floor_fwdbwd_ms=floor_fb)
        for mode, safe in (("fla_safe", True), ("fla_unsafe", False)):
          p = peer.get((shape, safe)) or {}
          row[f"{mode}_fwd_ms"], row[f"{mode}_fwdbwd_ms"] = p.get(timing, (None, None))
          row[f"{mode}_do_bench_ms"] = list(p["do_bench"]) if "do_bench" in p else None
        out.append(row)
  return out


def _write_json(path, rows, peer, ceil):
  from pallas_kernels.tools import bench_json  # pylint: disable=g-import-not-at-top
  bench_json.write(
      path, {"kda": json_rows(rows, peer)},
      peer_or_base=("fla chunk_kda in its own process, safe_gate=True (fla_safe) and False "
                    "(fla_unsafe)" if peer else "none (--peer=false)"),
      dtype="bfloat16", iters=_ITERS.value, lower_bound=_LOWER_BOUND.value, chunk_size=_CHUNK.value,
      sub_chunk=_SUB.value, overrides=_OVERRIDES.value,
      ceilings={"copy_bandwidth_tb_s": ceil.bandwidth / 1e12, "bf16_matmul_tflop_s": ceil.matmul / 1e12})


def main(argv):
  del argv
  if _MODE.value == "fla":
    _run_fla(_SHAPES.value, _ITERS.value, _LOWER_BOUND.value)
  else:
    _run_jax(_SHAPES.value)


if __name__ == "__main__":
  app.run(main)
