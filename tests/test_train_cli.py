"""`experiments/train.py` as a command: one `error:` paragraph and exit status 2 for each class of
configuration or input error, the run directory's lock between real processes, and the exit
status of a run stopped by SIGTERM."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from k3jax.train import cli_errors
from k3jax.train import workdir_lock
from k3jax.train.defaults import base_config
from tests import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "experiments", "train.py")
# configs/tiny.py shrunk on the command line (2 layers, short sequences): compiles in seconds.
SHRUNK = ["--config.batch_size=8", "--config.seq_len=32", "--config.num_devices=1", "--config.log_every=1",
          "--config.eval_every=0", "--config.checkpoint_every=0", "--config.eval_batches=1",
          "--config.progress_bar=False", "--config.async_checkpoints=False", "--config.data.max_bytes=200000",
          "--config.optim.warmup_steps=1", "--config.model.num_layers=2", "--config.model.layer_pattern=KA",
          "--config.model.d_model=32", "--config.model.num_heads=2", "--config.model.head_dim=16",
          "--config.model.num_kv_heads=2", "--config.model.kda.chunk_size=16", "--config.model.num_experts=4",
          "--config.model.expert_hidden=32", "--config.model.dense_hidden=64",
          "--config.model.first_layer_dense=False"]


def _env(shared_cache: bool = True, **extra):
  """The trainer's environment: the CPU, this checkout, no traceback, and (unless turned off) the
  tests' shared compilation cache (tests/compile_cache.py)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT,
         **(compile_cache.env() if shared_cache else {})}
  env.pop(cli_errors.TRACEBACK_ENV, None)
  env.update(extra)
  return env


def _train(workdir, *args, env=None, timeout=120):
  return subprocess.run([sys.executable, TRAIN, "--config=" + os.path.join(ROOT, "configs", "tiny.py"),
                         f"--workdir={workdir}", *args], capture_output=True, text=True,
                        env=env or _env(), cwd=ROOT, timeout=timeout)


def _error_paragraph(stderr: str) -> str:
  """The `error:` paragraph that ends stderr: the only one, on lines of its own, with no traceback."""
  assert "Traceback" not in stderr, stderr
  assert stderr.count("error:") == 1, stderr
  start = stderr.index("error:")
  assert start == 0 or stderr[start - 1] == "\n", stderr
  paragraph = stderr[start:].strip()
  assert "\n\n" not in paragraph, paragraph
  return paragraph


def _resumable_run_dir(tmp_path):
  """A run directory as a resume sees it before reading any checkpoint: config.json + a step directory."""
  workdir = tmp_path / "run"
  (workdir / "checkpoints" / "3").mkdir(parents=True)
  (workdir / "config.json").write_text(base_config().to_json_best_effort(indent=2, sort_keys=True))
  return workdir


@pytest.mark.parametrize("args, needles", [
    # A bad value: the field, the value, the limit and where to change it.
    (["--config.batch_size=-4"], ["batch_size=-4", ">= 1", "--config.batch_size=VALUE"]),
    # The model's own checks, spelt as config fields.
    (["--config.model.kda.lower_bound=-50"], ["model.kda.lower_bound=-50.0", "safe limit 85.0",
                                               "--config.model.kda.lower_bound=VALUE"]),
    # A misspelt section, and a misspelt field inside one.
    (["--config.modle.d_model=64"], ["'modle'", "did you mean 'model'"]),
    (["--config.optim.lerning_rate=1e-3"], ["'optim.lerning_rate'", "did you mean 'optim.learning_rate'"]),
    # A real field at the wrong level.
    (["--config.model.batch_size=8"], ["'model.batch_size'", "lives at 'batch_size' (top level)",
                                       "--config.batch_size=VALUE"]),
    # A value of the wrong type, and a flag typo.
    (["--config.batch_size=abc"], ["--config.batch_size=abc", "invalid literal"]),
    (["--workdr=x"], ["workdr", "workdir"]),
    # Input data that does not exist.
    (["--config.data.paths=/no/such/corpus"], ["'/no/such/corpus' does not exist", "data.*"]),
    # Prepared data that was never made, or a packing it does not take.
    (["--config.data.kind=prepared", "--config.data.path=/no/such/data"],
     ["'/no/such/data' does not exist", "experiments/prepare_data.py"]),
    (["--config.data.kind=prepared", "--config.data.path=/x", "--config.data.packing=windows"],
     ["data.packing='windows'", "drop data.packing"]),
    # Packed documents cannot be split over a context axis.
    (["--config.parallel.context=2"], ["context parallelism does not carry document segments",
                                       "data.reset_at_boundaries=False"]),
])
def test_config_error_is_one_paragraph_with_exit_status_2(tmp_path, args, needles):
  result = _train(tmp_path / "run", *args)
  assert result.returncode == cli_errors.EXIT_INPUT_ERROR, result.stderr
  paragraph = _error_paragraph(result.stderr)
  for needle in needles:
    assert needle in paragraph, paragraph
  assert not (tmp_path / "run").exists()  # nothing was written


def test_config_file_typo_names_the_closest_file(tmp_path):
  result = subprocess.run([sys.executable, TRAIN, "--config=configs/tinny.py", f"--workdir={tmp_path}/run"],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
  assert result.returncode == cli_errors.EXIT_INPUT_ERROR, result.stderr
  paragraph = _error_paragraph(result.stderr)
  assert "'configs/tinny.py' does not exist" in paragraph and "did you mean 'configs/tiny.py'" in paragraph


def test_resume_mismatch_is_one_paragraph_and_traceback_on_request(tmp_path):
  workdir = _resumable_run_dir(tmp_path)
  saved = (workdir / "config.json").read_bytes()
  result = _train(workdir)  # configs/tiny.py differs from the defaults saved there
  assert result.returncode == cli_errors.EXIT_INPUT_ERROR, result.stderr
  paragraph = _error_paragraph(result.stderr)
  assert "cannot change when a run resumes" in paragraph and "model.d_model: 256 (saved) -> 128 (now)" in paragraph
  assert (workdir / "config.json").read_bytes() == saved
  # The environment variable brings the traceback back, before the same paragraph and status.
  verbose = _train(workdir, env=_env(**{cli_errors.TRACEBACK_ENV: "1"}))
  assert verbose.returncode == cli_errors.EXIT_INPUT_ERROR
  assert "Traceback (most recent call last)" in verbose.stderr and "ConfigMismatchError" in verbose.stderr
  assert verbose.stderr.strip().split("\n\n")[-1].count("error:") == 1


def test_a_second_trainer_is_refused_and_sigterm_exits_75_after_saving(tmp_path):
  workdir = tmp_path / "run"
  first = subprocess.Popen([sys.executable, TRAIN, "--config=configs/tiny.py", f"--workdir={workdir}",
                            "--config.num_steps=2000", *SHRUNK], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
  try:
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and '"split": "train"' in metrics.read_text()):
      assert first.poll() is None, first.communicate()
      assert time.monotonic() < deadline, "the first trainer never reached a training step"
      time.sleep(0.5)
    owner = json.loads((workdir / workdir_lock.LOCK_FILE).read_text())
    assert owner["pid"] == first.pid and owner["host"]

    second = _train(workdir, "--config.num_steps=2000", *SHRUNK)
    assert second.returncode == cli_errors.EXIT_INPUT_ERROR, second.stderr
    paragraph = _error_paragraph(second.stderr)
    assert f"in use by another trainer: pid {first.pid} on host {owner['host']}" in paragraph
    assert first.poll() is None  # the refusal left the owner running

    first.send_signal(signal.SIGTERM)
    stdout, stderr = first.communicate(timeout=120)
  finally:
    if first.poll() is None:
      first.kill()
      first.wait()
  assert first.returncode == cli_errors.EXIT_PREEMPTED, stderr
  summary = stdout.strip().splitlines()[-1]
  assert "preempted by SIGTERM at step" in summary, stdout
  step = int(summary.split("preempted by SIGTERM at step ")[1].split(":")[0])
  assert (workdir / "checkpoints" / str(step)).is_dir()
  assert not (workdir / workdir_lock.LOCK_FILE).exists()  # released on the way out


def test_stale_lock_of_a_killed_process_is_taken_over_with_a_warning(tmp_path, caplog):
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; from k3jax.train.workdir_lock import WorkdirLock; "
       "WorkdirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)", str(tmp_path)],
      stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(workdir_lock.WorkdirLockedError, match=rf"pid {holder.pid} on host"):
      workdir_lock.check_free(str(tmp_path))
    with pytest.raises(workdir_lock.WorkdirLockedError, match=rf"kill {holder.pid}"):
      workdir_lock.WorkdirLock(str(tmp_path)).acquire()
  finally:
    holder.kill()  # SIGKILL: the lock file stays behind, its flock does not
    holder.wait()
  assert (tmp_path / workdir_lock.LOCK_FILE).exists()
  workdir_lock.check_free(str(tmp_path))
  with caplog.at_level("WARNING", logger="k3jax.train.workdir_lock"):
    with workdir_lock.WorkdirLock(str(tmp_path)):
      assert json.loads((tmp_path / workdir_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
  assert f"took over the stale lock {tmp_path / workdir_lock.LOCK_FILE} of pid {holder.pid}" in caplog.text
  assert not (tmp_path / workdir_lock.LOCK_FILE).exists()
