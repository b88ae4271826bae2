"""The tree passes `ruff check` with the project's rules (ruff.toml)."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
  done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stdout + done.stderr
