"""Decode tokens/s of the KDA decode step, per layer and for a whole model.

  python experiments/bench/bench_decode.py                       # B = 1, 8, 64; H16 K=V=128
  python experiments/bench/bench_decode.py --tokens=1,4 --pallas=16:4,32:4,64:4,128:8 --model=none
  python experiments/bench/bench_decode.py --nolayer                 # the model table only
  python experiments/bench/bench_decode.py --preset=tiny --batches=1,2 --steps=4 --pallas=8:4   # CPU smoke
  python experiments/bench/bench_decode.py ... --json=/tmp/decode.json   # the rows as JSON too

Layer table: one KDA layer's state step (`kda_decode_step`) for each
implementation, B and T_new, timed as a jitted `lax.scan` of `--steps` steps
that carries the state (as generate's loop does; the state buffer donated),
so the per-step time holds no host dispatch. Columns: microseconds per step,
decode tokens/s (B * T_new per step), the state's bytes read + written per
step over the time (GB/s), the state-bytes roofline time at
`--bandwidth_tb_s`, time / roofline, and the ratio against the first
implementation ("naive": the `lax.scan` of einsums the model decoded with
before the decode step existed).

Model table (`--model=` preset, "none" to skip): a HybridLM prefilled with a
`--prompt`-token prompt, then `--steps` greedy decode steps in one jitted
scan, per `ModelConfig.kda_decode` implementation: ms per step and decode
tokens/s (B per step), the "pallas" rows with the kernel's default tiling.
On the CPU the "pallas" rows run interpreted (slow, a smoke test only).
"""
from __future__ import annotations

import dataclasses
import os
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax.models import lm  # noqa: E402
from k3jax.models.config import ModelConfig  # noqa: E402
from pallas_kernels import platform  # noqa: E402
from pallas_kernels import timing  # noqa: E402
from pallas_kernels.kda import decode  # noqa: E402
from pallas_kernels.tools import bench_json  # noqa: E402

# Layer shapes (heads, head_dim) and models per preset.
PRESETS = {
    "h16": dict(heads=16, head_dim=128, model=dict(
        vocab_size=256, d_model=2048, num_layers=4, layer_pattern="KKKA", num_heads=16,
        head_dim=128, num_kv_heads=4, num_experts=0, dense_hidden=4096, dtype="bfloat16")),
    "tiny": dict(heads=2, head_dim=16, model=dict(
        vocab_size=64, d_model=32, num_layers=2, layer_pattern="KA", num_heads=2, head_dim=16,
        num_kv_heads=1, num_experts=0, dense_hidden=64, kda=dict(chunk_size=16, sub_chunk=8))),
}


def _define_flags():
  """The command line. Defined only when this file runs as a script, so that
  tests (and other benchmarks) can import its functions in one process."""
  flags.DEFINE_enum("preset", "h16", list(PRESETS), "Layer shape and model size.")
  flags.DEFINE_list("batches", ["1", "8", "64"], "Batch sizes B.")
  flags.DEFINE_list("tokens", ["1"], "New tokens per step T_new (layer table).")
  flags.DEFINE_list("implementations", ["naive", "fused", "pallas"],
      f"Decode implementations ({', '.join(decode.DECODE_IMPLEMENTATIONS)}).")
  flags.DEFINE_list("pallas", [f"{decode.DEFAULT_BLOCK_V}:{decode.DEFAULT_NUM_WARPS}",
      "32:4"],
      "Tilings of the pallas rows, one row each: BV:num_warps (V tile "
      "and warps per program) or BV (default warps).")
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "q/k/v/beta dtype.")
  flags.DEFINE_integer("steps", 64, "Decode steps per timed scan.")
  flags.DEFINE_integer("iters", 10, "Timed scans (median).")
  flags.DEFINE_float("bandwidth_tb_s", 3.5, "Memory bandwidth of the roofline, TB/s "
      "(read + write).")
  flags.DEFINE_string("model", "preset", "'preset' (the --preset model) or 'none'.")
  flags.DEFINE_bool("layer", True, "Print the layer table (--nolayer: the model only).")
  flags.DEFINE_integer("prompt", 16, "Prompt tokens of the model table.")
  flags.DEFINE_string("json", "", "Also write the printed tables' rows, the command line, "
                      "device and commit to this JSON file (pallas_kernels/tools/bench_json.py).")


FLAGS = flags.FLAGS

# The printed tables ("layer", "model"), kept for --json.
_TABLES = bench_json.Tables()


def _interpret() -> bool:
  return platform.interprets("kda_decode")


def parse_tilings(items) -> list[tuple[int, int]]:
  """["32:4", "128"] -> [(32, 4), (128, DEFAULT_NUM_WARPS)]."""
  out = []
  for item in items:
    bv, _, warps = item.partition(":")
    try:
      out.append((int(bv), int(warps) if warps else decode.DEFAULT_NUM_WARPS))
    except ValueError:
      raise ValueError(f"--pallas entry {item!r} is not BV or BV:num_warps (e.g. 32:4)") from None
  return out


def _layer_loop(impl: str, block_v: int | None, num_warps: int | None):
  """Jitted scan of decode steps: (state, xs) -> state, the state donated."""
  kw = {}
  if impl == "pallas":
    kw = dict(block_v=block_v, num_warps=num_warps, interpret=_interpret())

  def run(state, xs):
    def body(s, x):
      o, s = decode.kda_decode_step(*x, s, implementation=impl, **kw)
      return s, o[:, -1, 0, 0]  # keeps o live without storing it all
    return jax.lax.scan(body, state, xs)

  return jax.jit(run, donate_argnums=0)


def _layer_inputs(b, t_new, h, d, steps, dtype):
  ks = jax.random.split(jax.random.key(0), 5)
  shape = (steps, b, t_new, h, d)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], shape)).astype(dtype)
  k = unit(jax.random.normal(ks[1], shape)).astype(dtype)
  v = jax.random.normal(ks[2], shape, dtype)
  g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], shape))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], shape[:-1])).astype(dtype)
  return q, k, v, g, beta


def _time_loop(loop, state, xs, iters):
  """Median ms of one scan; each call consumes the state the previous one returned."""
  carry = [state]

  def call():
    carry[0], out = loop(carry[0], xs)
    return out

  return timing.sync_ms(call, jax.block_until_ready, iters=iters, warmup=2)


def _rows(impls, tilings):
  for impl in impls:
    for tiling in (tilings if impl == "pallas" else [(None, None)]):
      yield impl, tiling


def layer_table(batches, tokens, impls, tilings, *, heads, head_dim, dtype, steps, iters,
                bandwidth) -> list[dict]:
  """Times one layer's decode step; prints and returns one dict per row.

  tilings: (block_v, num_warps) pairs, one "pallas" row each (`parse_tilings`).
  """
  header = ("impl", "B", "T_new", "us/step", "tok/s", "state GB/s", "roofline us", "x roofline",
            "ratio vs first")
  _TABLES.start("layer", header)
  rows = []
  for b in batches:
    for t_new in tokens:
      xs = _layer_inputs(b, t_new, heads, head_dim, steps, dtype)
      floor_s = decode.state_roofline_s(b, heads, head_dim, head_dim, bandwidth * 1e12)
      first = None
      for impl, (bv, warps) in _rows(impls, tilings):
        name = impl if bv is None else f"{impl}:bv{bv}w{warps}"
        state = jnp.zeros((b, heads, head_dim, head_dim), jnp.float32)
        ms = _time_loop(_layer_loop(impl, bv, warps), state, xs, iters)
        step_s = ms / 1e3 / steps
        first = first or step_s
        row = dict(impl=name, batch=b, t_new=t_new, us=step_s * 1e6, tok_s=b * t_new / step_s,
                   gb_s=decode.state_bytes(b, heads, head_dim, head_dim) / step_s / 1e9,
                   roofline_us=floor_s * 1e6, x_roofline=step_s / floor_s, ratio=step_s / first)
        rows.append(row)
        _TABLES.row([name, b, t_new, f"{row['us']:.3g}", f"{row['tok_s']:.4g}",
                     f"{row['gb_s']:.4g}", f"{row['roofline_us']:.3g}",
                     f"{row['x_roofline']:.3g}", f"{row['ratio']:.2f}"])
  return rows


def _model_loop(cfg: ModelConfig, b: int, prompt: int, steps: int):
  """(jitted scan of greedy decode steps over (state, cache, token), its inputs)."""
  model = lm.HybridLM(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, prompt)),
                       jnp.int32)
  logits, cache = jax.jit(lambda p, t: nnx.merge(graphdef, p).prefill(t, prompt + steps))(
      params, tokens)
  first = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)

  @jax.jit
  def run(params, cache, token_b):
    model = nnx.merge(graphdef, params)

    def body(carry, _):
      tok, cache = carry
      step_logits, cache = model.decode(tok[:, None], cache)
      return (jnp.argmax(step_logits[:, 0], -1).astype(jnp.int32), cache), tok
    return jax.lax.scan(body, (token_b, cache), None, length=steps)[1]

  return run, (params, cache, first)


def model_table(batches, impls, *, model_cfg: dict, dtype, prompt, steps, iters) -> list[dict]:
  """Times whole-model greedy decode steps; prints and returns one dict per row."""
  base = ModelConfig.from_dict(dict(model_cfg, dtype=dtype))
  print(f"\n# model: {base.num_layers} layers '{base.layer_pattern}', d={base.d_model}, "
        f"H={base.num_heads}, head_dim={base.head_dim}, dtype={base.dtype}; prompt {prompt}, "
        f"{steps} steps per scan")
  header = ("kda_decode", "B", "ms/step", "tok/s", "ratio vs first")
  _TABLES.start("model", header)
  rows = []
  for b in batches:
    first = None
    for impl in impls:
      run, args = _model_loop(dataclasses.replace(base, kda_decode=impl), b, prompt, steps)
      ms = timing.sync_ms(lambda: run(*args), jax.block_until_ready, iters=iters, warmup=2)
      step_s = ms / 1e3 / steps
      first = first or step_s
      row = dict(impl=impl, batch=b, ms=step_s * 1e3, tok_s=b / step_s, ratio=step_s / first)
      rows.append(row)
      _TABLES.row([impl, b, f"{row['ms']:.3f}", f"{row['tok_s']:.4g}", f"{row['ratio']:.2f}"])
  return rows


def main(argv):
  del argv
  preset = PRESETS[FLAGS.preset]
  batches = [int(x) for x in FLAGS.batches]
  tokens = [int(x) for x in FLAGS.tokens]
  tilings = parse_tilings(FLAGS.pallas)
  for impl in FLAGS.implementations:
    decode.resolve_decode(impl)
  dtype = jnp.dtype(FLAGS.dtype)
  print(f"# device: {jax.devices()[0].device_kind}; KDA decode, H={preset['heads']} "
        f"K=V={preset['head_dim']}, {dtype.name} q/k/v, f32 state; {FLAGS.steps} steps per "
        f"scan, median of {FLAGS.iters}; roofline at {FLAGS.bandwidth_tb_s} TB/s")
  if FLAGS.layer:
    layer_table(batches, tokens, FLAGS.implementations, tilings, heads=preset["heads"],
                head_dim=preset["head_dim"], dtype=dtype, steps=FLAGS.steps,
                iters=FLAGS.iters, bandwidth=FLAGS.bandwidth_tb_s)
  if FLAGS.model == "preset":
    model_table(batches, FLAGS.implementations, model_cfg=preset["model"], dtype=dtype.name,
                prompt=FLAGS.prompt, steps=FLAGS.steps, iters=FLAGS.iters)
  elif FLAGS.model != "none":
    raise ValueError(f"--model must be 'preset' or 'none', got {FLAGS.model!r}")
  if FLAGS.json:
    write_json(FLAGS.json)


def write_json(path: str) -> None:
  """Writes the tables printed so far to `path` (bench_json's record)."""
  bench_json.write(path, _TABLES.tables, peer_or_base=(
      "base: the first implementation of each B (and T_new) in the same call"))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
