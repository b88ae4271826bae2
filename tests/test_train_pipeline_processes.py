"""Two processes (two CPU devices each, gloo collectives) train one model: a pipeline with one
stage per process (the processes feed the same rows) matches the one-process pipeline's losses
and resumes through one device and back; data parallelism over both (each feeds its own
rows of sampled windows) matches one process. Packed documents are read per process, so their
global batch depends on how the processes split it (tests/test_documents_processes.py)."""
import numpy as np

from k3jax.train.trainer import train_and_evaluate
from tests.processes import run_two_processes
from tests.test_train import _stop_at
from tests.test_train_pipeline import RTOL, _config, _losses

# One process of the run: argv = port, process id, workdir, the step to stop after (0: none),
# stages (1: data parallelism over the four devices), data.packing.
WORKER = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, workdir, stop, stages, packing = (sys.argv[1], int(sys.argv[2]), sys.argv[3],
                                             int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                           process_id=pid)
from k3jax.train.trainer import train_and_evaluate
from tests.test_train import _stop_at
from tests.test_train_pipeline import _config
config = _config(stages=stages)
config.num_devices = 0  # all four: stage 2 x data 2 (a stage per process), or data 4
config.data.packing = packing
out = train_and_evaluate(config, workdir, hooks=[_stop_at(stop)] if stop else [])
print("RESULT " + json.dumps({k: out[k] for k in ("step", "mesh", "interrupted")}))
"""


def _two_processes(workdir: str, stop: int, stages: int = 2, packing: str = "documents") -> list[dict]:
  return run_two_processes(WORKER, workdir, str(stop), str(stages), packing, timeout=600)


def test_a_stage_per_process_matches_one_process_and_resumes(tmp_path):
  ref_dir = str(tmp_path / "one_process")
  train_and_evaluate(_config(stages=2), ref_dir)
  ref = _losses(ref_dir)

  run = str(tmp_path / "two_processes")
  first = _two_processes(run, stop=2)
  assert [r["step"] for r in first] == [2, 2] and all(r["interrupted"] for r in first)
  assert first[0]["mesh"] == {"stage": 2, "data": 2, "fsdp": 1, "expert": 1, "context": 1}
  # One device for step 3 (the stacked checkpoint read into the plain model), then the two
  # processes again for step 4 (the plain checkpoint read into each process's stage).
  assert train_and_evaluate(_config(stages=1), run, hooks=[_stop_at(3)])["step"] == 3
  assert [r["step"] for r in _two_processes(run, stop=0)] == [4, 4]

  got = _losses(run)
  assert [s for s, *_ in got] == [1, 2, 3, 4]
  for (s, loss, gn), (_, want_loss, want_gn) in zip(got, ref):
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL["loss"], err_msg=f"loss at step {s}")
    np.testing.assert_allclose(gn, want_gn, rtol=RTOL["grad_norm"], err_msg=f"grad norm at {s}")


def test_data_parallel_processes_feed_their_own_rows(tmp_path):
  ref_dir = str(tmp_path / "one_process")
  config = _config(stages=1)
  config.num_devices = 4
  config.data.packing = "windows"  # one global batch whatever the processes (sampled windows)
  train_and_evaluate(config, ref_dir)
  run = str(tmp_path / "two_processes")
  results = _two_processes(run, stop=0, stages=1, packing="windows")
  assert results[0]["mesh"] == {"stage": 1, "data": 4, "fsdp": 1, "expert": 1, "context": 1}
  for (s, loss, gn), (_, want_loss, want_gn) in zip(_losses(run), _losses(ref_dir), strict=True):
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL["loss"], err_msg=f"loss at step {s}")
    np.testing.assert_allclose(gn, want_gn, rtol=RTOL["grad_norm"], err_msg=f"grad norm at {s}")
