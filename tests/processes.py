"""Runs one worker script as two local processes (jax.distributed on a free localhost port) and
collects the JSON each prints on its last `RESULT ` line."""
import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MARK = "RESULT "


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_two_processes(worker: str, *args: str, timeout: float) -> list[dict]:
  """Runs `python -c worker PORT PID *args` for PID 0 and 1 from the repository root; returns
  each process's result in PID order. A process that fails or prints no result fails the test
  with the tail of its output."""
  port = free_port()
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  procs = [subprocess.Popen([sys.executable, "-c", worker, str(port), str(pid), *args], cwd=ROOT,
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for pid in (0, 1)]
  results = []
  try:
    for proc in procs:
      out, _ = proc.communicate(timeout=timeout)
      lines = [line for line in out.splitlines() if line.startswith(_MARK)]
      assert proc.returncode == 0 and lines, out[-4000:]
      results.append(json.loads(lines[-1][len(_MARK):]))
  finally:
    for proc in procs:
      proc.kill()
  return results
