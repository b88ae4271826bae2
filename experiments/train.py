"""Trains a k3jax model: `python experiments/train.py --config=configs/tiny.py --workdir=runs/tiny`.

`--config=FILE.py[:ARG]` loads `get_config(ARG)`; `--config.a.b=value` overrides any
field. The run resumes from the newest checkpoint in `--workdir`, on whatever mesh
the config now names. Device mesh: `--config.parallel.{data,fsdp,expert,context}=N`
(docs/sharding.md), e.g. `--config.parallel.expert=2` on two GPUs. Multi-host:
`jax.distributed.initialize()` runs when `--coordinator_address` (with
`--num_processes`, `--process_id`) is given, or when the environment names a
coordinator (JAX_COORDINATOR_ADDRESS) or a multi-task SLURM / Open MPI job.

Exit status (`k3jax.train.cli_errors`): 0 finished (or nothing to do), 1 training
failed (non-finite loss) or an unexpected exception, 2 a configuration or input
error (one `error:` paragraph; `--traceback` or K3JAX_TRACEBACK=1 adds the
traceback), 74 a write failed (full disk, I/O error): the run stopped at once and
the same command resumes from the newest checkpoint, 75 preempted: a signal stopped
the run after a checkpoint was saved, or at once before the first step.
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

from k3jax.train import cli_errors  # noqa: E402
from k3jax.train import config_files  # noqa: E402
from k3jax.train import config_schema  # noqa: E402
from k3jax.train import report  # noqa: E402
from k3jax.train import trainer  # noqa: E402
from k3jax.train.checkpoint import CheckpointError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py[:arg]).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, config.json.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-host run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in a multi-host run.")
flags.DEFINE_bool("traceback", False, "Print the full traceback of a configuration or input error "
                  f"too (or set {cli_errors.TRACEBACK_ENV}=1).")
flags.mark_flags_as_required(["config", "workdir"])
_CONFIG_PREFIX = "--config."


def _fail(message: str, code: int = cli_errors.EXIT_INPUT_ERROR):
  cli_errors.exit_with(message, code, show_traceback=cli_errors.traceback_requested(sys.argv))


def _config_path(argv) -> str | None:
  """The --config file as given on the command line (without its `:arg`)."""
  for i, a in enumerate(argv):
    value = a.split("=", 1)[1] if a.startswith("--config=") else (
        argv[i + 1] if a == "--config" and i + 1 < len(argv) else None)
    if value is not None:
      return value.split(":", 1)[0]
  return None


def _config_load_message(argv, e: BaseException) -> str:
  path = _config_path(argv)
  if path and not os.path.isfile(path):
    return cli_errors.then(config_files.missing_file_message(path), "Give an existing file, e.g. "
                           "--config=configs/tiny.py.")
  last = str(e).strip().splitlines()[-1:] or [""]
  return (f"config file {path!r} failed to load: {type(e).__name__}: {last[0]}. Fix the file (--traceback "
          "shows where it failed).")


def _parse_flags(argv):
  """absl's flag parsing, with every failure as one `error:` paragraph and exit status 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(cli_errors.then(str(e).replace(" ?", "?"), "Pass --helpshort to list the flags."))
  except (KeyError, AttributeError, TypeError, ValueError) as e:  # a --config.a.b override
    for arg in argv:
      if arg.startswith(_CONFIG_PREFIX):
        problem = config_schema.unknown_field_message(arg[len(_CONFIG_PREFIX):].split("=", 1)[0])
        if problem:
          _fail(problem)
    overrides = " ".join(a for a in argv if a.startswith(_CONFIG_PREFIX)) or "(none)"
    _fail(f"the config overrides {overrides} could not be applied: {type(e).__name__}: {e}")
  except Exception as e:  # the config file raised while it was imported  # pylint: disable=broad-except
    _fail(_config_load_message(argv, e))


class _OneLineErrors(pylogging.Filter):
  """Drops the tracebacks of orbax's own error records (the failed save's background threads
  log one each); the trainer's `error:` paragraph names the same cause once."""

  def filter(self, record: pylogging.LogRecord) -> bool:
    if record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname:
      record.exc_info, record.exc_text = None, None
    return True


def _multi_task_env() -> bool:
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return True
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if int(os.environ.get(var, "1") or "1") > 1:
      return True
  return False


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]}: every setting is a flag, e.g. --config.num_steps=300")
  try:
    config = _CONFIG.value
    config.keys()  # a file that failed to load gives a stand-in that raises on first use
  except Exception as e:  # pylint: disable=broad-except
    _fail(_config_load_message(sys.argv, e))
  if not cli_errors.traceback_requested(sys.argv):
    logging.get_absl_handler().addFilter(_OneLineErrors())
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
    result = trainer.train_and_evaluate(config, _WORKDIR.value,
                                        exit_on_early_signal=cli_errors.EXIT_PREEMPTED)
  except (cli_errors.InputError, CheckpointError) as e:
    # These name the field or the run directory, the cause and the fix; a traceback adds nothing.
    _fail(cli_errors.with_fix(str(e)))
  except trainer.NonFiniteLossError as e:
    _fail(str(e), cli_errors.EXIT_FAILED)
  except cli_errors.SaveFailedError as e:
    _fail(str(e), cli_errors.EXIT_SAVE_FAILED)
  print(report.summary(result), flush=True)
  return cli_errors.EXIT_PREEMPTED if result["interrupted"] else cli_errors.EXIT_FINISHED


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
