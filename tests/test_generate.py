"""Prefill + token-by-token decoding (k3jax.models.generate) against the full forward."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.models import generate as gen
from k3jax.models import lm
from k3jax.models.config import ModelConfig
from k3jax.routing import RouterConfig
from k3jax.train.restore import restore_model
from pallas_kernels.kda.spec import KdaSpec

VOCAB = 32


@pytest.fixture(scope="module", params=["auto", "pallas"], ids=lambda d: f"kda_decode={d}")
def model(request):
  # K, A, K layers; MoE with a per-token (dropless top-k) router; full AttnRes.
  # kda_decode: "auto" is the fused jnp step on the CPU; "pallas" runs the
  # decode kernel interpreted.
  cfg = ModelConfig(vocab_size=VOCAB, d_model=16, num_layers=3, layer_pattern="KA", num_heads=2,
                    head_dim=8, num_kv_heads=1, conv_size=3,
                    kda=KdaSpec(chunk_size=8, sub_chunk=4, lower_bound=-5.0),
                    num_experts=4, top_k=2, expert_hidden=16, num_shared_experts=1,
                    dense_hidden=32, router=RouterConfig(name="topk", capacity_factor=None),
                    residual="full_attnres", kda_decode=request.param)
  m = lm.HybridLM(cfg, rngs=nnx.Rngs(0))
  # Non-zero pseudo-queries so that the depth mixing is exercised too.
  q = np.random.default_rng(1).standard_normal(m.residual.queries.shape).astype(np.float32)
  m.residual.queries[...] = q
  return m


@pytest.fixture(scope="module")
def forward():
  return nnx.jit(lambda m, t: m(t, deterministic=True)[0])


def _tokens(b, t, seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (b, t), dtype=np.int32)


def test_decode_equals_full_forward_position_by_position(model, forward):
  tokens = _tokens(2, 14)
  full = np.asarray(forward(model, tokens))
  prompt = 10  # longer than one KDA chunk (8)
  logits, cache = gen.prefill(model, tokens[:, :prompt], 14)
  chex.assert_shape(logits, (2, prompt, VOCAB))
  np.testing.assert_allclose(logits, full[:, :prompt], rtol=1e-5, atol=1e-5)
  assert len(cache) == 3
  chex.assert_shape(cache[0]["state"], (2, 2, 8, 8))   # KDA: [B, H, K, V]
  chex.assert_shape(cache[1]["k"], (2, 14, 1, 8))      # attention: [B, max_len, KVH, hd]
  for t in range(prompt, 14):
    step_logits, cache = gen.decode_step(model, tokens[:, t:t + 1], cache)
    chex.assert_shape(step_logits, (2, 1, VOCAB))
    assert step_logits.dtype == jnp.float32
    np.testing.assert_allclose(step_logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5,
                               err_msg=f"position {t}")
  assert int(cache[1]["pos"]) == 14


def test_greedy_generation_is_self_consistent(model, forward):
  prompt = _tokens(2, 9, seed=3)
  out = gen.generate(model, prompt, max_new_tokens=5, temperature=0.0)
  assert [c.finish_reason for c in out] == ["length", "length"]
  new = np.asarray([c.tokens for c in out])
  chex.assert_shape(new, (2, 5))
  # Each generated token is the argmax of the full forward over its prefix.
  full = np.asarray(forward(model, np.concatenate([prompt, new], axis=1)))
  np.testing.assert_array_equal(new, full[:, 8:-1].argmax(-1))


def test_sampling_respects_top_k_and_temperature():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((64, VOCAB)), jnp.float32)
  draw = jax.jit(lambda k: gen.sample_logits(logits, k, temperature=1.0, top_k=3))
  top3 = np.argsort(np.asarray(logits), -1)[:, -3:]
  samples = np.stack([np.asarray(draw(jax.random.key(i))) for i in range(4)], 1)
  assert all(np.isin(samples[r], top3[r]).all() for r in range(64))
  assert len(np.unique(samples)) > 3  # not collapsed onto the argmax
  np.testing.assert_array_equal(gen.sample_logits(logits, jax.random.key(0), temperature=0.0),
                                np.asarray(logits).argmax(-1))
  with pytest.raises(ValueError, match="temperature"):
    gen.sample_logits(logits, jax.random.key(0), temperature=-1.0)


def test_set_kda_decode_switches_every_kda_layer(model):
  from k3jax.layers.kda import KDA
  before = {m.decode_implementation for _, m in nnx.iter_modules(model) if isinstance(m, KDA)}
  try:
    assert gen.set_kda_decode(model, "naive") == 2   # layers K, A, K
    kinds = {m.decode_implementation for _, m in nnx.iter_modules(model) if isinstance(m, KDA)}
    assert kinds == {"naive"}
    with pytest.raises(ValueError, match="got 'scan'"):
      gen.set_kda_decode(model, "scan")
  finally:
    (impl,) = before
    gen.set_kda_decode(model, impl)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=VOCAB + 1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(eos_id=VOCAB), "eos_id"),
    (dict(stop_sequences=[[]]), "stop sequence"),
    (dict(prompts=[[1, 2], []]), "prompt 1 must be a non-empty"),
    (dict(prompts=[[1, VOCAB]]), f"prompt 0 has id {VOCAB} outside"),
    (dict(prompts=[]), "no prompts"),
    (dict(prompts=np.zeros((3,), np.int32)), r"\[B, T\]"),
], ids=lambda x: str(x) if isinstance(x, str) else None)
def test_generate_rejects_bad_arguments(model, kwargs, match):
  args = {"prompts": [[1, 2, 3]], "max_new_tokens": 2, **kwargs}
  with pytest.raises(ValueError, match=match):
    gen.generate(model, args.pop("prompts"), **args)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A run directory as the trainer leaves it (config.json + a step-3 checkpoint), made without training."""
  from k3jax.train import checkpoint as ckpt_lib
  from k3jax.train.config_schema import model_config_from
  from k3jax.train.optimizer import make_optimizer
  from k3jax.train.run_config import write_config
  from k3jax.train.state import create_train_state
  from tests.test_train import _shrunk_tiny
  workdir = tmp_path_factory.mktemp("run")
  c = _shrunk_tiny()
  cfg = model_config_from(c.model)
  tx, _ = make_optimizer(c.optim, c.num_steps)
  _, state = create_train_state(lambda rngs: lm.HybridLM(cfg, rngs=rngs), tx, c.seed)
  mgr = ckpt_lib.Checkpointer(str(workdir / "checkpoints"), async_save=False)
  mgr.save(3, state.replace(step=jnp.asarray(3, jnp.int32)), {"iterator": {"position": 3}})
  mgr.close()
  write_config(str(workdir), c)
  return workdir


def _generate_cli(*args):
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, os.path.join(root, "experiments", "generate.py"), *args],
                        capture_output=True, text=True, env=env, timeout=300, check=False)


def test_restoring_a_missing_step_lists_the_saved_ones(run_dir):
  from k3jax.train.checkpoint import CheckpointError
  with pytest.raises(CheckpointError, match=r"no checkpoint of step 100 .*saved steps: 3"):
    restore_model(str(run_dir), 100)


def test_generate_cli_is_quiet(run_dir):
  ok = _generate_cli(f"--workdir={run_dir}", "--prompt=ab", "--max_new_tokens=3", "--temperature=0",
                     "--kda_decode=fused")
  assert ok.returncode == 0, ok.stderr
  assert f"restored step 3 from {run_dir}" in ok.stdout and "--- prompt 0\nab" in ok.stdout
  # No library INFO lines (absl's "I<month><day>" prefix) by default.
  info = [line for line in ok.stderr.splitlines() if line.startswith(("I0", "I1"))]
  assert info == [], info
