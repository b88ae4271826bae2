"""Trains a k3jax model: `python experiments/train.py --config=configs/tiny.py --workdir=runs/tiny`.

`--config=FILE.py[:ARG]` loads `get_config(ARG)`; `--config.a.b=value` overrides any
field. The run resumes from the newest checkpoint in `--workdir`, on whatever mesh
the config now names. Device mesh: `--config.parallel.{data,fsdp,expert,context}=N`
(docs/sharding.md), e.g. `--config.parallel.expert=2` on two GPUs. Multi-host:
`jax.distributed.initialize()` runs when `--coordinator_address` (with
`--num_processes`, `--process_id`) is given, or when the environment names a
coordinator (JAX_COORDINATOR_ADDRESS) or a multi-task SLURM / Open MPI job.
"""
import logging as pylogging
import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

# Run from a checkout without installing: the repository root holds the k3jax package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from k3jax.train import report  # noqa: E402
from k3jax.train import trainer  # noqa: E402
from k3jax.train.checkpoint import CheckpointError  # noqa: E402
from k3jax.train.run_config import ConfigMismatchError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:arg]).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, config.json.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-host run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in a multi-host run.")
flags.mark_flags_as_required(["config", "workdir"])


def _multi_task_env() -> bool:
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return True
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if int(os.environ.get(var, "1") or "1") > 1:
      return True
  return False


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # Library INFO (orbax's per-save lines) drowns the progress bar; keep k3jax's own INFO lines.
    logging.set_verbosity(logging.WARNING)
    pylogging.getLogger("k3jax").setLevel(pylogging.INFO)
  if _COORDINATOR.value:
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  elif _multi_task_env():
    jax.distributed.initialize()  # JAX reads the coordinator from the environment / cluster
  pylogging.getLogger("k3jax").info("JAX process %d of %d, devices: %s", jax.process_index(),
                                    jax.process_count(), jax.devices())
  try:
    result = trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (CheckpointError, ConfigMismatchError, trainer.NonFiniteLossError) as e:
    # These name the run directory, the cause and the fix; a traceback adds nothing.
    sys.exit(f"error: {e}")
  print(report.summary(result), flush=True)


if __name__ == "__main__":
  app.run(main)
