"""Post-training evaluations of a run directory through the model API.

* `eval_at_length`: held-out loss/accuracy at a multiple of the training
  length (decay sweep; MQAR asks the same recall after a longer gap), with
  finiteness and the largest logit;
* `routing_leak`: how many earlier-position outputs change when one sequence's
  future changes (router sweep), measured on the trained model;
* `depth_profile`: per-layer RMS norm of the residual stream, cosine
  similarity between consecutive layers, and forward memory (residual sweep);

`k3jax.ablations.record.summarize_run` gathers them into a run's record.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.ablations import runs as runs_lib
from k3jax.data import ByteCorpus, make_batch, make_dataset, mqar_examples
from k3jax.train.restore import restore_model
from k3jax.train.run_config import load_run_config
from k3jax.train.step import masked_cross_entropy


def restore(workdir: str):
  """(model, model_config, trainer config, step) of a finished run directory."""
  model, model_cfg, step = restore_model(workdir)
  return model, model_cfg, load_run_config(workdir), step


# -- held-out evaluation at other lengths ------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _loss_stats(graphdef, state, inputs_bt, targets_bt, mask_bt):
  model = nnx.merge(graphdef, state)
  logits_btv, _ = model(inputs_bt, deterministic=True)
  nll, correct, count = masked_cross_entropy(logits_btv, targets_bt, mask_bt)
  return {"nll_sum": nll, "correct_sum": correct, "count": count,
          "max_abs_logit": jnp.max(jnp.abs(logits_btv)),
          "finite": jnp.all(jnp.isfinite(logits_btv))}


def mqar_with_gap(rng: np.random.Generator, batch_size: int, train_len: int, seq_len: int, *,
                  vocab_size: int, num_kv_pairs: int) -> dict[str, np.ndarray]:
  """MQAR batch of the training layout with `seq_len - train_len` pad tokens (id 0) between the
  key-value pairs and the queries: the same recall problem, asked from further away.

  Returns inputs/targets/mask [batch_size, seq_len] (mask: query positions only).
  """
  if seq_len < train_len:
    raise ValueError(f"seq_len={seq_len} must be >= train_len={train_len}")
  base = mqar_examples(rng, batch_size, train_len, vocab_size=vocab_size, num_kv_pairs=num_kv_pairs)
  full = np.concatenate([base["inputs"], base["targets"][:, -1:]], axis=1)  # [B, train_len + 1]
  start, gap = 2 * num_kv_pairs, seq_len - train_len  # first query key sits at `start`
  full = np.concatenate([full[:, :start], np.zeros((batch_size, gap), full.dtype), full[:, start:]], axis=1)
  mask = np.concatenate([base["mask"][:, :start], np.zeros((batch_size, gap), np.float32),
                         base["mask"][:, start:]], axis=1)
  return make_batch(full[:, :-1], full[:, 1:], mask)


def length_eval_batches(config, multiplier: int) -> list[dict[str, np.ndarray]]:
  """Held-out batches at `multiplier` x the training length.

  Byte text: longer held-out windows. MQAR: the training layout with a pad gap
  before the queries (`mqar_with_gap`), from a seed stream the trainer never uses.
  `config.eval_batches` batches of max(1, batch_size // multiplier) sequences
  (about the same number of tokens at every length).
  """
  if multiplier < 1:
    raise ValueError(f"multiplier must be >= 1, got {multiplier}")
  seq_len = config.seq_len * multiplier
  batch = max(1, config.batch_size // multiplier)
  data = config.data
  if data.kind == "mqar":
    return [mqar_with_gap(np.random.default_rng([config.seed, _LENGTH_STREAM, multiplier, i]), batch,
                          config.seq_len, seq_len, vocab_size=data.vocab_size,
                          num_kv_pairs=data.mqar_num_kv_pairs)
            for i in range(config.eval_batches)]
  dataset = make_dataset(data, seed=config.seed)
  dataset.check_seq_len(seq_len)
  return dataset.eval_batches(batch, seq_len, config.eval_batches)


_LENGTH_STREAM = 7  # MQAR seed stream of the length evaluations (training uses BatchIterator's, held-out 1)


def eval_at_length(model, config, multiplier: int) -> dict[str, float]:
  """Held-out metrics at `multiplier` x the training length (batches from `length_eval_batches`).

  Returns:
    {"seq_len", "loss" (nats per scored token), "accuracy", "bpb" (bytes only),
     "max_abs_logit", "finite" (1.0 if every logit was finite)}.
  """
  batches = length_eval_batches(config, multiplier)
  graphdef, state = nnx.split(model)
  sums = {"nll_sum": 0.0, "correct_sum": 0.0, "count": 0.0}
  max_logit, finite = 0.0, True
  for b in batches:
    out = jax.device_get(_loss_stats(graphdef, state, b["inputs"], b["targets"], b["mask"]))
    for k in sums:
      sums[k] += float(out[k])
    max_logit = max(max_logit, float(out["max_abs_logit"]))
    finite = finite and bool(out["finite"])
  count = max(sums["count"], 1.0)
  nats = sums["nll_sum"] / count
  record = {"seq_len": config.seq_len * multiplier, "loss": nats, "accuracy": sums["correct_sum"] / count,
            "max_abs_logit": max_logit, "finite": float(finite)}
  if config.data.kind == "bytes":
    record.update(ByteCorpus.metrics_from_loss(nats))
  return record


# -- causality leak of the trained routers -----------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, inputs_bt):
  model = nnx.merge(graphdef, state)
  return model(inputs_bt, deterministic=True)[0]


def routing_leak(model, inputs_bt: np.ndarray, *, position: int, seed: int = 0) -> dict[str, float]:
  """Changes tokens after `position` in sequence 0 and measures which earlier outputs move.

  Every mixer is causal, so any change of a logit at positions <= `position`
  comes from routing that depends on other tokens of the batch (a shared
  threshold or capacity). The batch is run twice unchanged first: any
  difference there (`noise`) would make the comparison meaningless.

  Args:
    model: trained HybridLM.
    inputs_bt: [B, T] int token batch (B >= 2 to see cross-sequence leaks).
    position: last position whose outputs must not change, in [0, T - 2].
    seed: draws the replacement tokens.

  Returns:
    {"changed_fraction": share of (sequence, position <= `position`) whose logits
     changed, "changed_fraction_own": the same within sequence 0,
     "changed_fraction_others": within the other sequences, "max_logit_change",
     "noise": max |logit difference| between two identical runs}.
  """
  b, t = inputs_bt.shape
  if not 0 <= position < t - 1:
    raise ValueError(f"position={position} must lie in [0, T-2={t - 2}]")
  vocab = model.config.vocab_size
  rng = np.random.default_rng(seed)
  changed = np.array(inputs_bt, copy=True)
  changed[0, position + 1:] = rng.integers(0, vocab, size=t - position - 1)
  graphdef, state = nnx.split(model)
  base = np.asarray(_logits(graphdef, state, jnp.asarray(inputs_bt)))
  again = np.asarray(_logits(graphdef, state, jnp.asarray(inputs_bt)))
  moved = np.asarray(_logits(graphdef, state, jnp.asarray(changed)))
  noise = float(np.max(np.abs(base - again)))
  diff_bs = np.max(np.abs(base - moved), axis=-1)[:, : position + 1]
  flag = diff_bs > noise
  return {"changed_fraction": float(flag.mean()),
          "changed_fraction_own": float(flag[0].mean()),
          "changed_fraction_others": float(flag[1:].mean()) if b > 1 else 0.0,
          "max_logit_change": float(diff_bs.max()), "noise": noise}


# -- per-layer representation statistics ---------------------------------------------


def trace_layers(model, tokens_bt: jax.Array) -> dict[str, Any]:
  """The residual stream per layer (`HybridLM.trace`), with the logits in the same dict.

  Args:
    model: HybridLM.
    tokens_bt: [B, T] int.

  Returns:
    {"stream": list of L + 1 [B, T, D] float32 tensors, the stream read by layer l's
      mixer (stream[0] is the embedding) and the final read, "sublayer_out": list of
      2L [B, T, D] float32 sublayer outputs, "max_stored": most [B, T, D] tensors the
      residual state held, "max_keys": most float32 key tensors it held,
      "logits": [B, T, V] float32}.
  """
  logits, trace = model.trace(tokens_bt)
  return {**trace, "logits": logits}


def _rms(x):
  return jnp.sqrt(jnp.mean(jnp.square(x)))


def _mean_cosine(a_btd, b_btd):
  num = jnp.sum(a_btd * b_btd, axis=-1)
  den = jnp.linalg.norm(a_btd, axis=-1) * jnp.linalg.norm(b_btd, axis=-1)
  return jnp.mean(num / jnp.maximum(den, 1e-30))


def _profile(graphdef, state, tokens_bt):
  model = nnx.merge(graphdef, state)
  tr = trace_layers(model, tokens_bt)
  s = tr["stream"]
  return {"stream_rms": jnp.stack([_rms(h) for h in s]),
          "cos_next": jnp.stack([_mean_cosine(a, b) for a, b in zip(s[:-1], s[1:])]),
          "cos_to_embedding": jnp.stack([_mean_cosine(s[0], h) for h in s[1:]]),
          "sublayer_out_rms": jnp.stack([_rms(o) for o in tr["sublayer_out"]]),
          "max_stored": jnp.int32(tr["max_stored"]), "max_keys": jnp.int32(tr["max_keys"])}


def depth_profile(model, tokens_bt: np.ndarray) -> dict[str, Any]:
  """Per-layer statistics and forward memory of `model` on a token batch.

  Returns:
    {"stream_rms": [L + 1] RMS of the stream read by each layer (0: embedding,
     L: final), "cos_next": [L] mean cosine similarity between the streams of
     layers l and l + 1 (near 1 means a layer changes little: degradation),
     "cos_to_embedding": [L], "sublayer_out_rms": [2L],
     "param_bytes": float32 parameter bytes,
     "residual_bytes_per_token": bytes the residual state holds per token at its peak,
     "forward_temp_bytes": XLA's temporary buffer size of the jitted forward
     for this batch (None where the backend does not report it)}.
  """
  graphdef, state = nnx.split(model)
  tokens = jnp.asarray(tokens_bt)
  compiled = jax.jit(_profile, static_argnums=0).lower(graphdef, state, tokens).compile()
  out = jax.device_get(compiled(state, tokens))
  mem = compiled.memory_analysis()
  cfg = model.config
  itemsize = jnp.dtype(cfg.compute_dtype).itemsize
  params = nnx.state(model, nnx.Param)
  param_bytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
  return {"stream_rms": [float(v) for v in out["stream_rms"]],
          "cos_next": [float(v) for v in out["cos_next"]],
          "cos_to_embedding": [float(v) for v in out["cos_to_embedding"]],
          "sublayer_out_rms": [float(v) for v in out["sublayer_out_rms"]],
          "max_stored": int(out["max_stored"]), "max_keys": int(out["max_keys"]),
          "param_bytes": param_bytes,
          "residual_bytes_per_token": cfg.d_model * (int(out["max_stored"]) * itemsize
                                                     + int(out["max_keys"]) * 4),
          "forward_temp_bytes": None if mem is None else int(mem.temp_size_in_bytes)}


# -- per-run summary record ------------------------------------------------------------


def router_stats(metrics) -> dict[str, Any]:
  out = {}
  for stat in ("max_vio", "max_vio_routed", "drop_fraction"):
    layers = runs_lib.per_layer(metrics, stat)
    out[stat] = {str(layer): runs_lib.tail_mean(s) for layer, s in layers.items()}
    vals = [v for v in out[stat].values() if math.isfinite(v)]
    out[stat + "_mean"] = float(np.mean(vals)) if vals else float("nan")
  return out


def heldout_batch(config) -> np.ndarray:
  dataset = make_dataset(config.data, seed=config.seed)
  return dataset.eval_batches(config.batch_size, config.seq_len, 1)[0]["inputs"]
