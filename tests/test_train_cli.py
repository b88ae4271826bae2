"""`experiments/train.py` as a command: one `error:` paragraph and exit status 2 for each class of
configuration or input error."""
import os
import subprocess
import sys

import pytest

from k3jax.train import cli_errors
from k3jax.train.defaults import base_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "experiments", "train.py")
def _env(**extra):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, **extra}
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
    (["--config.model.g_min=-50"], ["model.g_min=-50.0", "safe limit 85.0", "--config.model.g_min=VALUE"]),
    # A misspelt section.
    (["--config.modle.d_model=64"], ["'modle'", "did you mean 'model'"]),
    # A real field at the wrong level.
    (["--config.model.batch_size=8"], ["'model.batch_size'", "lives at 'batch_size' (top level)",
                                       "--config.batch_size=VALUE"]),
    # A value of the wrong type, and a flag typo.
    (["--config.batch_size=abc"], ["--config.batch_size=abc", "invalid literal"]),
    (["--workdr=x"], ["workdr", "workdir"]),
    # Input data that does not exist.
    (["--config.data.paths=/no/such/corpus"], ["'/no/such/corpus' does not exist", "data.*"]),
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
