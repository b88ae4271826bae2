"""Long-context evaluation of a trained model far past its training length.

* `position_buckets` / `bucket_stats`: loss by position, in buckets that are
  multiples of the training length: [0, 1x), [1x, 2x), [2x, 4x), ...;
* `token_stats`: per-position loss, argmax hit, non-finite logit count and
  largest finite |logit| of one batch; the output head runs on slices of
  `head_chunk` positions, so no [B, T, V] float32 array exists at 128k tokens;
* `heldout_at_length`: held-out text at one length, batch 1, bucketed;
* `mqar_far_recall`: MQAR recall with the key-value pairs `gap` tokens before
  the queries (`evaluate.mqar_with_gap`);
* `decode_consistency`: prefill P tokens, decode N more, and compare logits and
  caches with the full forward of the whole sequence;
* `decode_accuracy`: the same decode and full forward of a reduced-precision
  model, each measured against its float32 twin (`float32_twin`);
* `evaluate_run`: all of the above for one run directory (its data kind
  decides text or MQAR);
* `render_long_tables`: the results-page tables of a "long" sweep summary.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from k3jax.ablations import summary as summary_lib
from k3jax.ablations.evaluate import mqar_with_gap, restore
from k3jax.data import make_dataset

# Held-out seed streams of the far-gap MQAR batches and of the MQAR decode check
# (training uses 0, held-out 1, `eval_at_length` 7).
_FAR_MQAR_STREAM, _DECODE_MQAR_STREAM = 11, 12


# -- bucketing ------------------------------------------------------------------


def position_buckets(train_len: int, seq_len: int) -> list[tuple[int, int]]:
  """Half-open position ranges [lo, hi) covering [0, seq_len): [0, 1x), [1x, 2x), [2x, 4x), ...

  x is `train_len`; each bucket past the first doubles, and the last one is cut
  at `seq_len`.
  """
  if train_len < 1:
    raise ValueError(f"train_len must be >= 1, got {train_len}")
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}")
  edges = [0]
  hi = train_len
  while edges[-1] < seq_len:
    edges.append(min(hi, seq_len))
    hi *= 2
  return list(zip(edges[:-1], edges[1:]))


def bucket_stats(nll_t: np.ndarray, correct_t: np.ndarray, mask_t: np.ndarray,
                 buckets: Sequence[tuple[int, int]], train_len: int) -> list[dict[str, Any]]:
  """Mean loss and accuracy of the masked positions in each bucket.

  Args:
    nll_t, correct_t, mask_t: [N, T] (or [T]) per-position nats, argmax hit (0/1) and weight.
    buckets: from `position_buckets`.
    train_len: to express the bounds as multiples ("lo_x", "hi_x").

  Returns:
    one dict per bucket: lo, hi, lo_x, hi_x, count (scored positions), loss, accuracy
    (NaN where the bucket scored nothing; loss NaN if any scored nll was not finite).
  """
  nll, correct, mask = (np.atleast_2d(np.asarray(a, np.float64)) for a in (nll_t, correct_t, mask_t))
  if not nll.shape == correct.shape == mask.shape:
    raise ValueError(f"nll {nll.shape}, correct {correct.shape} and mask {mask.shape} must match")
  out = []
  for lo, hi in buckets:
    if not 0 <= lo < hi <= nll.shape[1]:
      raise ValueError(f"bucket [{lo}, {hi}) outside the {nll.shape[1]} positions")
    m = mask[:, lo:hi]
    count = float(m.sum())
    with np.errstate(invalid="ignore"):
      loss = float(np.sum(np.where(m > 0, nll[:, lo:hi], 0.0)) / count) if count else math.nan
      acc = float(np.sum(correct[:, lo:hi] * m) / count) if count else math.nan
    out.append({"lo": lo, "hi": hi, "lo_x": lo / train_len, "hi_x": hi / train_len,
                "count": count, "loss": loss, "accuracy": acc})
  return out


# -- per-position statistics of one batch ------------------------------------------


def logit_stats(logits_btv: jax.Array, targets_bt: jax.Array) -> dict[str, jax.Array]:
  """Per-position statistics of a logits slice [B, T, V] against targets [B, T].

  Returns {"nll": [B, T] float32 nats, "correct": [B, T] float32 argmax hit,
  "nonfinite": [B, T] int32 number of NaN/inf logits, "max_abs": [B, T] float32
  largest finite |logit| (0 where none is finite)}.
  """
  logits = logits_btv.astype(jnp.float32)
  finite = jnp.isfinite(logits)
  return {"nll": optax.softmax_cross_entropy_with_integer_labels(logits, targets_bt),
          "correct": (jnp.argmax(logits, axis=-1) == targets_bt).astype(jnp.float32),
          "nonfinite": jnp.sum(~finite, axis=-1, dtype=jnp.int32),
          "max_abs": jnp.max(jnp.where(finite, jnp.abs(logits), 0.0), axis=-1)}


@functools.partial(jax.jit, static_argnames=("graphdef", "head_chunk"))
def _token_stats(graphdef, state, inputs_bt, targets_bt, *, head_chunk):
  model = nnx.merge(graphdef, state)
  final_btd = model.features(inputs_bt)
  b, t, d = final_btd.shape
  n = -(-t // head_chunk)
  pad = n * head_chunk - t
  h = jnp.pad(final_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, head_chunk, d).swapaxes(0, 1)
  y = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, n, head_chunk).swapaxes(0, 1)
  stats = jax.lax.map(lambda hy: logit_stats(model.head_logits(hy[0]), hy[1]), (h, y))
  return {k: v.swapaxes(0, 1).reshape(b, n * head_chunk)[:, :t] for k, v in stats.items()}


def token_stats(model, inputs_bt, targets_bt, *, head_chunk: int = 2048) -> dict[str, np.ndarray]:
  """`logit_stats` of the model's forward on one batch, the head applied `head_chunk` positions at a time.

  Args:
    model: HybridLM.
    inputs_bt, targets_bt: [B, T] int.
    head_chunk: positions per output-head slice (memory: B x head_chunk x V float32).

  Returns:
    the `logit_stats` dict as numpy [B, T] arrays.
  """
  if head_chunk < 1:
    raise ValueError(f"head_chunk must be >= 1, got {head_chunk}")
  inputs, targets = jnp.asarray(inputs_bt), jnp.asarray(targets_bt)
  if inputs.shape != targets.shape or inputs.ndim != 2:
    raise ValueError(f"inputs {inputs.shape} and targets {targets.shape} must be the same [B, T]")
  graphdef, state = nnx.split(model)
  out = _token_stats(graphdef, state, inputs, targets, head_chunk=min(int(head_chunk), inputs.shape[1]))
  return {k: np.asarray(v) for k, v in jax.device_get(out).items()}


def _summarize(stats: list[dict[str, np.ndarray]], masks: list[np.ndarray], train_len: int,
               seq_len: int) -> dict[str, Any]:
  nll = np.concatenate([s["nll"] for s in stats])
  correct = np.concatenate([s["correct"] for s in stats])
  mask = np.concatenate(masks).astype(np.float64)
  whole = bucket_stats(nll, correct, mask, [(0, seq_len)], train_len)[0]
  return {"seq_len": seq_len, "multiplier": seq_len / train_len, "num_sequences": int(nll.shape[0]),
          "loss": whole["loss"], "accuracy": whole["accuracy"], "count": whole["count"],
          "buckets": bucket_stats(nll, correct, mask, position_buckets(train_len, seq_len), train_len),
          "nonfinite_logits": int(sum(int(s["nonfinite"].sum()) for s in stats)),
          "max_abs_logit": float(max(float(s["max_abs"].max()) for s in stats))}


# -- the evaluations ----------------------------------------------------------------


def heldout_at_length(model, dataset, *, train_len: int, seq_len: int, num_sequences: int = 1,
                      head_chunk: int = 2048) -> dict[str, Any]:
  """Held-out text windows of `seq_len` tokens, one sequence per forward.

  Args:
    model: HybridLM.
    dataset: a dataset with `eval_batches(batch, seq_len, n)` and `check_seq_len` (e.g. ByteCorpus).
    train_len: the training length (bucket unit).
    seq_len: evaluation length.
    num_sequences: windows evenly spaced over the held-out split.
    head_chunk: see `token_stats`.

  Returns:
    {"seq_len", "multiplier", "num_sequences", "loss", "accuracy", "count",
     "buckets" (`bucket_stats`), "nonfinite_logits" (total NaN/inf logits),
     "max_abs_logit" (largest finite |logit|)}.
  """
  if num_sequences < 1:
    raise ValueError(f"num_sequences must be >= 1, got {num_sequences}")
  dataset.check_seq_len(seq_len)
  batches = dataset.eval_batches(1, seq_len, num_sequences)
  stats = [token_stats(model, b["inputs"], b["targets"], head_chunk=head_chunk) for b in batches]
  return _summarize(stats, [b["mask"] for b in batches], train_len, seq_len)


def mqar_far_recall(model, *, train_len: int, gap: int, vocab_size: int, num_kv_pairs: int,
                    num_sequences: int = 8, seed: int = 0, head_chunk: int = 2048) -> dict[str, Any]:
  """MQAR recall with `gap` pad tokens between the key-value pairs and the queries.

  Each sequence is the training layout of `train_len` tokens with the gap
  inserted (`evaluate.mqar_with_gap`), so its length is train_len + gap; one
  sequence per forward, from a seed stream the trainer never uses.

  Returns:
    {"gap", "gap_x" (gap / train_len), "seq_len", "accuracy" (recall over the
     query positions), "loss", "count" (queries), "nonfinite_logits", "max_abs_logit"}.
  """
  if gap < 0:
    raise ValueError(f"gap must be >= 0, got {gap}")
  if num_sequences < 1:
    raise ValueError(f"num_sequences must be >= 1, got {num_sequences}")
  seq_len = train_len + gap
  stats, masks = [], []
  for i in range(num_sequences):
    b = mqar_with_gap(np.random.default_rng([seed, _FAR_MQAR_STREAM, gap, i]), 1, train_len, seq_len,
                      vocab_size=vocab_size, num_kv_pairs=num_kv_pairs)
    stats.append(token_stats(model, b["inputs"], b["targets"], head_chunk=head_chunk))
    masks.append(b["mask"])
  s = _summarize(stats, masks, train_len, seq_len)
  return {"gap": gap, "gap_x": gap / train_len, "seq_len": seq_len, "accuracy": s["accuracy"],
          "loss": s["loss"], "count": s["count"], "nonfinite_logits": s["nonfinite_logits"],
          "max_abs_logit": s["max_abs_logit"]}


# -- decoding after a long prefill ----------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "prefill_len"))
def _decode_vs_full(graphdef, state, tokens_bt, *, prefill_len):
  model = nnx.merge(graphdef, state)
  t = tokens_bt.shape[1]
  full = model.head_logits(model.features(tokens_bt)[:, prefill_len - 1:])  # [B, N + 1, V]
  logits, cache = model.prefill(tokens_bt[:, :prefill_len], t)

  def step(cache, token_b):
    out, cache = model.decode(token_b[:, None], cache)
    return cache, out[:, 0]

  decoded_cache, decoded = jax.lax.scan(step, cache, tokens_bt[:, prefill_len:].T)
  _, ref_cache = model.prefill(tokens_bt, t)
  return {"full": full, "prefill_last": logits[:, -1], "decoded": decoded.swapaxes(0, 1),
          "cache": decoded_cache, "ref_cache": ref_cache}


def _decode_tokens(tokens_bt, prefill_len: int):
  """(tokens [B, T] array, T), checked for a prefill of `prefill_len` and decoding the rest."""
  tokens = jnp.asarray(tokens_bt)
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
  t = tokens.shape[1]
  if not 1 <= prefill_len < t:
    raise ValueError(f"prefill_len={prefill_len} must lie in [1, T - 1 = {t - 1}]; "
                     "T - prefill_len tokens are decoded")
  return tokens, t


def _cache_kind(name: str) -> str | None:
  return ("kda_state" if name == "state" else "kda_conv" if name.startswith("conv")
          else "attn_kv" if name in ("k", "v") else None)


def _cache_rel_max(caches, ref_caches) -> dict[str, float]:
  """{kind: max over layers of `_rel_max`} of two per-layer cache lists (kinds as `_cache_kind`)."""
  diff: dict[str, float] = {}
  for layer, ref in zip(caches, ref_caches):
    for name, value in layer.items():
      kind = _cache_kind(name)
      if kind is not None:
        diff[kind] = max(diff.get(kind, 0.0), _rel_max(value, ref[name]))
  return diff


def _rel_max(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def decode_consistency(model, tokens_bt, prefill_len: int) -> dict[str, Any]:
  """Prefill `prefill_len` tokens, decode the rest of `tokens_bt` one by one (teacher-forced),
  and compare with the full forward of the whole sequence.

  Exact agreement needs every layer to be causal per token: an MoE router with a
  batch capacity (e.g. quantile, capacity_factor > 0) routes a lone decoded token
  differently from the same token inside the full forward, and the difference
  reaches the caches of the later layers.

  Args:
    model: HybridLM.
    tokens_bt: [B, P + N] int; the first P are the prompt, the next N are fed to `decode`.
    prefill_len: P in [1, T - 1].

  Returns:
    {"prefill_len", "num_new", "logits_rel_max" (max |decoded - full| over the N
     decoded positions / max |full|), "prefill_rel_max" (the prompt's last logits),
     "argmax_agreement" (share of decoded positions with the full forward's argmax),
     "max_abs_logit", "cache_rel_max": {"kda_state", "kda_conv", "attn_kv"}: max
     relative difference between the caches after decoding and those of a prefill
     of all P + N tokens (absent kinds are left out)}.
  """
  tokens, t = _decode_tokens(tokens_bt, prefill_len)
  graphdef, state = nnx.split(model)
  out = jax.device_get(_decode_vs_full(graphdef, state, tokens, prefill_len=int(prefill_len)))
  full = out["full"]
  cache_diff = _cache_rel_max(out["cache"], out["ref_cache"])
  return {"prefill_len": int(prefill_len), "num_new": int(t - prefill_len),
          "logits_rel_max": _rel_max(out["decoded"], full[:, 1:]),
          "prefill_rel_max": _rel_max(out["prefill_last"], full[:, 0]),
          "argmax_agreement": float(np.mean(out["decoded"].argmax(-1) == full[:, 1:].argmax(-1))),
          "max_abs_logit": float(np.max(np.abs(full))), "cache_rel_max": cache_diff}


def float32_twin(model):
  """A float32 copy of `model` whose KDA layers run the naive token loop (same variables).

  The reference `decode_accuracy` measures a bf16 model against; evaluate it under
  `jax.default_matmul_precision("highest")` (decode_accuracy does), so no matmul takes TF32.
  """
  config = dataclasses.replace(model.config, dtype="float32",
                               kda=dataclasses.replace(model.config.kda, implementation="naive"))
  twin = type(model)(config, rngs=nnx.Rngs(0))
  nnx.update(twin, nnx.state(model))
  return twin


@functools.partial(jax.jit, static_argnames=("graphdef", "prefill_len"))
def _full_and_cache(graphdef, state, tokens_bt, *, prefill_len):
  model = nnx.merge(graphdef, state)
  full = model.head_logits(model.features(tokens_bt)[:, prefill_len - 1:])  # [B, N + 1, V]
  return full, model.prefill(tokens_bt, tokens_bt.shape[1])[1]


def decode_accuracy(model, reference, tokens_bt, prefill_len: int, *,
                    window: int = 64) -> dict[str, Any]:
  """How far `model`'s decode and its full forward each lie from `reference`'s full forward.

  `decode_consistency` compares two evaluations of one model. In bf16 each
  carries the model's own rounding error, 0.03-0.04 of the largest logit for
  a random 4-layer model at 32k tokens (docs/benchmarks.md, "GPU tier"), so
  their difference can exceed either error and bounds neither. Measured
  against a float32 evaluation of the same variables (`float32_twin`),
  decoding adds no error of its own when its error is the full pass's, and
  does not drift when its error does not grow over the decoded tokens.

  Args:
    model: HybridLM (e.g. bf16 compute, the Pallas KDA kernels).
    reference: the same variables evaluated exactly enough (`float32_twin(model)`);
      run here under `jax.default_matmul_precision("highest")`.
    tokens_bt: [B, P + N] int; the first P are the prompt, the next N are decoded.
    prefill_len: P in [1, T - 1].
    window: positions in each of the first and last windows of the decode.

  Returns:
    {"prefill_len", "num_new", "max_abs_logit" (of the reference),
     "full_rel_max" / "decoded_rel_max": max |x - ref| over the N decoded
     positions / max |ref|, for the model's full forward and its decode;
     "decoded_first" / "decoded_last": the decode's over its first and last
     `window` positions; "full_argmax" / "decoded_argmax": share of the N
     positions whose argmax is the reference's; "cache": {kind: {"decoded",
     "prefill"}}: the max relative difference from the reference's prefill of
     all P + N tokens, of the caches after decoding and of the model's own
     prefill of all P + N tokens (kinds as in `decode_consistency`)}.
  """
  tokens, t = _decode_tokens(tokens_bt, prefill_len)
  if not 1 <= window <= t - prefill_len:
    raise ValueError(f"window={window} must lie in [1, N = {t - prefill_len}] (N decoded tokens)")
  out = jax.device_get(_decode_vs_full(*nnx.split(model), tokens, prefill_len=int(prefill_len)))
  with jax.default_matmul_precision("highest"):
    ref, ref_cache = jax.device_get(_full_and_cache(*nnx.split(reference), tokens,
                                                    prefill_len=int(prefill_len)))
  ref, full, decoded = ref[:, 1:], out["full"][:, 1:], out["decoded"]
  scale = max(float(np.max(np.abs(ref))), 1e-30)
  err = lambda x, part=slice(None): float(np.max(np.abs(
      np.asarray(x[:, part], np.float64) - np.asarray(ref[:, part], np.float64)))) / scale
  argmax = lambda x: float(np.mean(np.asarray(x).argmax(-1) == np.asarray(ref).argmax(-1)))
  decoded_caches = _cache_rel_max(out["cache"], ref_cache)
  prefill_caches = _cache_rel_max(out["ref_cache"], ref_cache)
  return {"prefill_len": int(prefill_len), "num_new": int(t - prefill_len), "max_abs_logit": scale,
          "full_rel_max": err(full), "decoded_rel_max": err(decoded),
          "decoded_first": err(decoded, slice(0, window)),
          "decoded_last": err(decoded, slice(-window, None)),
          "full_argmax": argmax(full), "decoded_argmax": argmax(decoded),
          "cache": {kind: {"decoded": decoded_caches[kind], "prefill": prefill_caches[kind]}
                    for kind in decoded_caches}}


# -- one run directory -----------------------------------------------------------------


def evaluate_run(workdir: str, *, multipliers: Sequence[int] = (1, 4, 16, 64),
                 gap_multipliers: Sequence[int] = (8, 16, 32, 64), num_sequences: int = 1,
                 mqar_sequences: int = 8, decode_prefill_x: int = 0, decode_new: int = 256,
                 head_chunk: int = 2048) -> dict[str, Any]:
  """The long-context record of a finished training run directory.

  Byte/token text runs get `heldout_at_length` at each multiplier of the training
  length; MQAR runs get `mqar_far_recall` at each gap multiplier (0, the training
  layout, always included). `decode_prefill_x` > 0 also runs `decode_consistency`
  on held-out text (MQAR: a far-gap sequence) of decode_prefill_x x the training
  length followed by `decode_new` tokens.

  Returns:
    {"workdir", "step", "data", "train_len", "gate", "g_min", "layer_pattern", "ffn" (dense, or
     the MoE router and its capacity factor),
     "lengths": [heldout records] or "mqar": [recall records], optionally "decode"}.
  """
  for name, values in (("multipliers", multipliers), ("gap_multipliers", gap_multipliers)):
    if any(int(m) != m or m < 0 for m in values):
      raise ValueError(f"{name} must be non-negative ints, got {list(values)}")
  model, model_cfg, config, step = restore(workdir)
  train_len = int(config.seq_len)
  record: dict[str, Any] = {"workdir": workdir, "step": step, "data": config.data.kind,
                            "train_len": train_len, "gate": model_cfg.gate, "g_min": model_cfg.kda.lower_bound,
                            "layer_pattern": model_cfg.layer_pattern,
                            "ffn": (f"moe {model_cfg.router.name} cf={model_cfg.router.capacity_factor}"
                                    if model_cfg.num_experts else "dense")}
  data = config.data
  decode_tokens = None
  if data.kind == "mqar":
    gaps = sorted({0, *(int(m) * train_len for m in gap_multipliers)})
    record["mqar"] = [mqar_far_recall(model, train_len=train_len, gap=g, vocab_size=data.vocab_size,
                                      num_kv_pairs=data.mqar_num_kv_pairs, num_sequences=mqar_sequences,
                                      seed=int(config.seed), head_chunk=head_chunk) for g in gaps]
    if decode_prefill_x:
      total = decode_prefill_x * train_len + decode_new
      decode_tokens = mqar_with_gap(np.random.default_rng([config.seed, _DECODE_MQAR_STREAM]), 1,
                                    train_len, total, vocab_size=data.vocab_size,
                                    num_kv_pairs=data.mqar_num_kv_pairs)["inputs"]
  else:
    dataset = make_dataset(data, seed=config.seed)
    record["lengths"] = [heldout_at_length(model, dataset, train_len=train_len, seq_len=int(m) * train_len,
                                           num_sequences=num_sequences, head_chunk=head_chunk)
                         for m in multipliers if m >= 1]
    if decode_prefill_x:
      total = decode_prefill_x * train_len + decode_new
      dataset.check_seq_len(total)
      decode_tokens = dataset.eval_batches(1, total, 1)[0]["inputs"]
  if decode_tokens is not None:
    record["decode"] = decode_consistency(model, decode_tokens, decode_prefill_x * train_len)
  return record


# -- tables of a "long" sweep summary ---------------------------------------------------

BUCKET_LABELS = ("[0,1x)", "[1x,2x)", "[2x,4x)", "[4x,8x)", "[8x,16x)", "[16x,32x)", "[32x,64x)")


def _bucket_label(b: dict) -> str:
  return f"[{b['lo_x']:g}x,{b['hi_x']:g}x)".replace("[0x", "[0")


def text_table(records: list[dict]) -> str:
  """Per (variant, evaluation length): held-out loss (nats) by position bucket, mean ± std over seeds,
  with the total non-finite logit count and the largest |logit| over seeds."""
  rows = []
  for (variant, _), rs in summary_lib.group([r for r in records if r["task"] != "mqar"]).items():
    lengths = sorted({e["seq_len"] for r in rs for e in r["long"].get("lengths", ())})
    for t in lengths:
      evals = [e for r in rs for e in r["long"]["lengths"] if e["seq_len"] == t]
      by_bucket = {}
      for e in evals:
        for b in e["buckets"]:
          by_bucket.setdefault(_bucket_label(b), []).append(b["loss"])
      row = [variant, f"{t} ({evals[0]['multiplier']:g}x)", str(len(evals)),
             summary_lib.fmt(e["loss"] for e in evals)]
      row += [summary_lib.fmt(by_bucket[label]) if label in by_bucket else "" for label in BUCKET_LABELS]
      row += [str(sum(e["nonfinite_logits"] for e in evals)),
              f"{max(e['max_abs_logit'] for e in evals):.1f}"]
      rows.append(row)
  return summary_lib.table(["variant", "eval tokens", "seeds", "loss"] + list(BUCKET_LABELS)
                  + ["non-finite logits", "max abs logit"], rows)


def length_table(records: list[dict]) -> str:
  """Per variant: held-out loss (nats) over all positions at each evaluation length, mean ± std over
  seeds, with the non-finite logit count and the largest |logit| over all lengths (text_table's
  buckets, one row per variant)."""
  rows, header = [], []
  for (variant, _), rs in summary_lib.group([r for r in records if r["task"] != "mqar"]).items():
    evals = [e for r in rs for e in r["long"].get("lengths", ())]
    lengths = sorted({e["seq_len"] for e in evals})
    header = header or [f"loss @{t} ({next(e['multiplier'] for e in evals if e['seq_len'] == t):g}x)"
                        for t in lengths]
    rows.append([variant, str(len(rs))]
                + [summary_lib.fmt(e["loss"] for e in evals if e["seq_len"] == t) for t in lengths]
                + [str(sum(e["nonfinite_logits"] for e in evals)),
                   f"{max(e['max_abs_logit'] for e in evals):.1f}"])
  return summary_lib.table(["variant", "seeds"] + header + ["non-finite logits", "max abs logit"], rows)


def mqar_table(records: list[dict]) -> str:
  """Per variant: MQAR recall (query accuracy) at each gap, mean ± std over seeds."""
  rows, gaps_all = [], set()
  groups = summary_lib.group([r for r in records if r["task"] == "mqar"])
  for rs in groups.values():
    gaps_all |= {e["gap_x"] for r in rs for e in r["long"].get("mqar", ())}
  gaps = sorted(gaps_all)
  for (variant, _), rs in groups.items():
    row = [variant, str(len(rs))]
    for g in gaps:
      row.append(summary_lib.fmt(e["accuracy"] for r in rs for e in r["long"]["mqar"] if e["gap_x"] == g))
    evals = [e for r in rs for e in r["long"]["mqar"]]
    row += [str(sum(e["nonfinite_logits"] for e in evals)), f"{max(e['max_abs_logit'] for e in evals):.1f}"]
    rows.append(row)
  return summary_lib.table(["variant", "seeds"] + [f"recall, gap {g:g}x" for g in gaps]
                  + ["non-finite logits", "max abs logit"], rows)


def decode_table(records: list[dict]) -> str:
  """Per (variant, task): decode after a long prefill against the full forward (worst seed)."""
  rows = []
  for (variant, task), rs in summary_lib.group(records).items():
    ds = [r["long"]["decode"] for r in rs if r["long"].get("decode")]
    if not ds:
      continue
    worst = lambda key: f"{max(d[key] for d in ds):.1e}"
    cache = lambda kind: (f"{max(d['cache_rel_max'][kind] for d in ds):.1e}"
                          if all(kind in d["cache_rel_max"] for d in ds) else "-")
    rows.append([variant, task, str(len(ds)), str(ds[0]["prefill_len"]), str(ds[0]["num_new"]),
                 worst("logits_rel_max"), f"{min(d['argmax_agreement'] for d in ds):.3f}",
                 cache("kda_state"), cache("attn_kv")])
  return summary_lib.table(["variant", "task", "seeds", "prefill tokens", "decoded tokens",
                   "logits rel. max diff", "argmax agreement", "KDA state rel. diff", "KV cache rel. diff"],
                  rows)


LONG_TABLES = {"lengths": length_table, "text": text_table, "mqar": mqar_table, "decode": decode_table}
_LONG_MARK = re.compile(r"(<!-- long:(?P<name>[a-z_]+) -->\n)(.*?)(<!-- /long -->)", re.S)


def render_long_tables(markdown: str, summary: dict) -> str:
  """Replaces each `<!-- long:NAME -->...<!-- /long -->` block with the table NAME (a key of
  LONG_TABLES, or "meta") of the "long" records in `summary`."""
  records = [r for r in summary["runs"] if r.get("sweep") == "long" and r.get("long")]

  def table_for(name: str) -> str:
    if name == "meta":
      seeds = sorted({r["seed"] for r in records})
      return (f"Setting `{summary['setting']}`, {len(records)} runs, seeds {seeds}, "
              f"summary created {summary['created']}.")
    if name not in LONG_TABLES:
      raise ValueError(f"unknown long-context table {name!r}; allowed: {sorted(LONG_TABLES) + ['meta']}")
    return LONG_TABLES[name](records) if records else "_No long-context runs in the summary._"

  return _LONG_MARK.sub(lambda m: m.group(1) + table_for(m.group("name")) + "\n" + m.group(4), markdown)


def records_from_runs(records: list[dict], out_dir: str, **evaluate_args) -> list[dict]:
  """Sweep run records (any sweep) with a "long" entry: `evaluate_run` of each run directory.

  Args:
    records: summary records with "workdir" relative to `out_dir`.
    out_dir: the sweep output directory.
    **evaluate_args: passed to `evaluate_run` (e.g. multipliers=(1, 4, 16)).
  """
  return [{**r, "long": evaluate_run(os.path.join(out_dir, r["workdir"]), **evaluate_args)}
          for r in records]
