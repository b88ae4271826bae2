"""`train_and_evaluate(config, workdir)`: the training loop behind `experiments/train.py`."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import math
import os
import signal
import sys
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

try:
  from tqdm.auto import tqdm
except ImportError:  # optional: a bare accelerator image may lack tqdm; metrics still reach the log files
  tqdm = None

from k3jax.data import (Tokenizer, load_tokenizer, make_dataset, make_eval_batches, make_iterator,
                        model_segments)
from k3jax.layers import kda
from k3jax.models import lm
from k3jax.parallel.model_layout import ModelLayout
from k3jax.sharding import rules as rules_lib
from k3jax.train import data_state
from k3jax.train import report
from k3jax.train import run_config
from k3jax.train import sharded_state
from k3jax.train import workdir_lock
from k3jax.train.checkpoint import Checkpointer, SignalGuard, saved_steps
from k3jax.train.cli_errors import InputError, SaveFailedError, os_cause
from k3jax.train.config_schema import ConfigError, validate_for_devices
from k3jax.train.metrics import MetricWriter, drop_superseded
from k3jax.train.optimizer import make_optimizer
from k3jax.train.state import abstract_train_state, count_elements, create_train_state
from k3jax.train.step import make_eval_step, make_train_step

log = logging.getLogger(__name__)
# Dense bf16 peak per device (TFLOP/s), matched against `device.device_kind`, for MFU.
PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("A100", 312.0), ("TPU v6", 918.0),
                    ("TPU v5p", 459.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0), ("TPU v4", 275.0))

Hook = Callable[[int, dict[str, float]], None]


def peak_flops_per_device(config: Any) -> float | None:
  """Peak FLOP/s of one device: the config's value, else a lookup by device kind, else None."""
  if config.peak_tflops_per_device > 0:
    return config.peak_tflops_per_device * 1e12
  kind = jax.devices()[0].device_kind
  for name, tflops in PEAK_BF16_TFLOPS:
    if name.lower() in kind.lower():
      return tflops * 1e12
  return None


@functools.lru_cache(maxsize=4)
def _programs(graphdef: nnx.GraphDef, optim: ml_collections.FrozenConfigDict, num_steps: int,
              max_segments: int | None):
  """(tx, train_step, eval_step) for a model structure and optimizer, shared by runs in one process.

  Runs with the same model structure and optimizer settings (a resumed run, a
  sweep in a notebook) reuse the compiled steps instead of compiling again.
  `max_segments`: the model sees each batch's segment ids with this static bound (None: it does not).
  """
  tx, schedule = make_optimizer(optim, num_steps)
  return (tx, make_train_step(graphdef, tx, schedule, max_segments=max_segments),
          make_eval_step(graphdef, max_segments=max_segments))


def _default_model(model_cfg, seq_len: int, expert_parallel, layout: ModelLayout
                   ) -> tuple[Callable[[nnx.Rngs], nnx.Module], float]:
  fpt = lm.flops_per_token(model_cfg, seq_len)
  return (lambda rngs: layout.build_lm(model_cfg, rngs=rngs, expert_parallel=expert_parallel)), fpt


def _given_model(model_fn: Callable[[nnx.Rngs], nnx.Module], layout: ModelLayout
                 ) -> Callable[[nnx.Rngs], nnx.Module]:
  """A given `model_fn` built for `layout`: pipelined under stages; its KDA layers must be
  mesh-aware and its attention layers on the documents path where the layout needs them.
  A model that cannot be is a config error."""
  def build(rngs):
    try:
      model = layout.pipelined(model_fn(rngs))
      layout.check_built_for(model)
    except ValueError as e:
      raise ConfigError(f"config parallel: {e}") from None
    return model

  return build


class _NoBar:
  """Stands in for a tqdm bar when tqdm is missing."""

  def update(self, n):
    del n

  def set_postfix(self, **kwargs):
    del kwargs

  def close(self):
    pass


def _devices(config: Any, nproc: int) -> list:
  """The devices the mesh spans: the first `config.num_devices` (one process), or all."""
  devices = jax.devices()
  n = config.num_devices
  if isinstance(n, bool) or not isinstance(n, int) or n < 0:
    raise ConfigError(f"config num_devices={n!r} must be an int >= 0 (0 = all devices)")
  if n:
    if n > len(devices) or nproc > 1:
      raise ConfigError(f"config num_devices={n}: {len(devices)} devices in "
                        f"{nproc} process(es); use 0 (all) for multi-process runs")
    devices = devices[:n]
  return devices


def _needs_sharded_state(abstract_model: nnx.Module, mesh: Mesh, pconf, sizes: dict) -> bool:
  """False when the mesh only splits the batch: every parameter replicated, no expert,
  context or stage axis (a pipeline stores each stage's layers on that stage's devices).
  Such runs keep the plain model and its one-device initialisation."""
  if sizes["expert"] > 1 or sizes["context"] > 1 or sizes["stage"] > 1:
    return True
  shardings = rules_lib.tree_shardings(nnx.state(abstract_model), mesh, pconf.rules)
  return any(s.spec != P() for s in jax.tree.leaves(shardings))


class NonFiniteLossError(FloatingPointError):
  """The loss or gradient norm became NaN/inf; the last good checkpoint is kept."""


class PastNumStepsError(InputError):
  """The run directory's checkpoint is past the config's num_steps: nothing to do, nothing changed."""


def _log_above_bar(bar_enabled: bool, message: str) -> None:
  """Logs an INFO line; with a progress bar, clears the bar first and redraws it after."""
  if bar_enabled:
    with tqdm.external_write_mode(file=sys.stderr):
      log.info(message)
  else:
    log.info(message)


def _lock_all_processes(lock: workdir_lock.WorkdirLock | None, workdir: str, nproc: int) -> None:
  """Process 0 takes the run directory's lock; in a multi-process run every process learns
  whether it did, so that none is left waiting in a collective when it could not."""
  error = None
  if lock is not None:
    try:
      lock.acquire()
    except workdir_lock.WorkdirLockedError as e:
      error = e
  if nproc > 1:
    locked = bool(np.all(multihost_utils.process_allgather(np.array(error is None))))
    if not locked and error is None:
      raise workdir_lock.WorkdirLockedError(f"process 0 could not take the lock of {workdir}; its "
                                            "error message names the trainer that holds it")
  if error is not None:
    raise error


def _non_finite_message(step: int, host: dict, start: int, restored, last: int | None,
                        directory: str) -> str:
  if restored is None:
    origin = f"started from step {start} (fresh initialisation)"
  else:
    checked = "checksums and finite values" if restored.verified else "finite values"
    origin = f"resumed from the checkpoint of step {restored.step} ({checked} verified)"
  kept = (f"The newest checkpoint is step {last} in {directory}; running again resumes there"
          if last is not None else f"No checkpoint was saved in {directory}")
  return (f"non-finite training loss {host['loss']} / grad norm {host['grad_norm']} at step {step}; "
          f"stopped without saving. This run {origin}. {kept}. Lower optim.learning_rate or "
          "optim.grad_clip (both may change on resume), or check the data.")


def train_and_evaluate(config: Any, workdir: str, *,
                       model_fn: Callable[[nnx.Rngs], nnx.Module] | None = None,
                       flops_per_token: float | None = None,
                       hooks: Sequence[Hook] = (),
                       exit_on_early_signal: int | None = None) -> dict[str, Any]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint if there is one.

  Writes `config.json`, `metrics.jsonl`, TensorBoard events under `tb/` and orbax
  checkpoints under `checkpoints/`. SIGTERM/SIGINT save a checkpoint and return
  early (`interrupted`). A non-finite loss raises `NonFiniteLossError` without saving.

  Nothing is written to `workdir` before the config, the data and (when
  resuming) the saved `config.json` have been checked: see `run_config` for the
  fields that may change on resume. Resuming restores the newest checkpoint
  whose checksums match, still without writing: a checkpoint past `num_steps`
  is refused (`PastNumStepsError`); one at `num_steps` returns at once
  (`nothing_to_do`), neither changing anything, so both work on read-only
  media. Otherwise process 0 then holds `workdir`'s lock (`workdir_lock`)
  until it returns; a live trainer's lock is refused at once, a directory that
  cannot be written too (`WorkdirNotWritableError`). Newer damaged checkpoints
  are moved to `checkpoints.rejected/`. The metric records past the restored
  step are superseded (`metrics.drop_superseded`).

  A write that fails (a checkpoint, synchronous or asynchronous, a metric
  record, config.json) raises `SaveFailedError` at once: the loop checks the
  asynchronous save before every step, so no step begins once its failure is
  known. The committed checkpoints stay as they were.

  Args:
    config: the full ConfigDict (validated here before anything is computed).
    workdir: run directory.
    model_fn: optional `rngs -> nnx.Module` replacing `HybridLM(config.model)`; the
      module maps tokens [B, T] to (float32 logits [B, T, V], aux dict). Its MoE layers,
      if any, run expert-parallel only if it builds them so (`moe_path.ExpertParallel`);
      its KDA layers must be `ContextParallelKDA` on a mesh that needs them (else a
      ConfigError); under stages it must be a plain HybridLM, built into a `PipelinedLM`.
    flops_per_token: training FLOPs per token for MFU when `model_fn` is given.
    hooks: callables `hook(step, host_metrics)` run after every step (forces a
      host sync per step; meant for tests and notebooks).
    exit_on_early_signal: for a process of its own (the binary): a SIGTERM/SIGINT that
      arrives before the first step is under way (while the data load or the steps
      compile) ends the process within moments with this status, saving nothing
      (`SignalGuard`). None: such a signal stops the loop after the first step, which
      is saved.

  Raises:
    InputError: a configuration or input error (ConfigError, ConfigMismatchError,
      WorkdirLockedError, WorkdirNotWritableError, PastNumStepsError); nothing was
      trained or changed.
    SaveFailedError: a write to `workdir` failed; the message names the newest checkpoint.

  Returns:
    {"step", "num_steps", "interrupted", "signal": the stopping signal's name (or None),
     "nothing_to_do", "train": last train record, "eval": last eval
     record, "eval_step": its step, "evals": [(step, record)] of this invocation,
     "first_eval": eval record at step 0 of a fresh run (or None), "resumed_from": the
     restored step (or None), "skipped_checkpoints": [(step, reason)], "num_params",
     "mesh": {axis: size}}.
  """
  is_main = jax.process_index() == 0
  if is_main:  # a second trainer refuses before it spends time on data and compilation
    workdir_lock.check_free(workdir)
  lock = workdir_lock.WorkdirLock(workdir) if is_main else None
  guard = None
  if exit_on_early_signal is not None:
    guard = SignalGuard(exit_status=exit_on_early_signal, before_exit=lock.release if lock else None)
  try:
    with guard or contextlib.nullcontext():
      return _train_and_evaluate(config, workdir, lock, guard, model_fn, flops_per_token, hooks)
  finally:
    if lock is not None:
      lock.release()


@dataclasses.dataclass
class _Build:
  """The build stage's products: everything checked and compiled before `workdir` is touched."""
  config: Any
  workdir: str
  nproc: int
  ndev: int
  pconf: Any
  sizes: dict
  model_fn: Callable[[nnx.Rngs], nnx.Module]
  flops_per_token: float | None
  ckpt_dir: str
  resuming: bool
  dataset: Any
  tokenizer: Tokenizer | None
  data_it: Any
  eval_set: list
  mesh: Mesh
  sharded: bool
  tx: Any
  train_step: Callable
  eval_step: Callable
  abstract_state: Any
  shardings: Any

  def put(self, batch):
    """A host batch placed on the mesh by the run's rules."""
    return sharded_state.shard_batch(batch, self.mesh, self.pconf.rules)

  @contextlib.contextmanager
  def on_mesh(self):
    """The mesh and the run's rules, which layers read while the steps are traced."""
    with jax.set_mesh(self.mesh), rules_lib.use_rules(self.pconf.rules):
      yield


def _build(config: Any, workdir: str, model_fn: Callable[[nnx.Rngs], nnx.Module] | None,
           flops_per_token: float | None) -> _Build:
  """Checks the config (the mesh included), the saved config.json when resuming and the
  data, then builds the model template and the step programs; writes nothing."""
  nproc = jax.process_count()
  devices = _devices(config, nproc)
  # Every check, the mesh's included, runs before anything is computed.
  model_cfg, pconf, sizes = validate_for_devices(config, len(devices))
  # The model's layout is chosen here, once: the MoE layers' path (expert-parallel when the
  # mesh shards the experts), the KDA layers' (mesh-aware) and the pipeline stages.
  layout = ModelLayout.for_mesh(sizes, model_cfg.kda.implementation, pconf.microbatches)
  if model_fn is None:
    model_fn, flops_per_token = _default_model(model_cfg, config.seq_len,
                                               pconf.expert_parallel(sizes["expert"]), layout)
  else:
    model_fn = _given_model(model_fn, layout)
  if kda.interprets(model_cfg.kda.implementation):
    log.warning("model.kda.implementation='pallas' on CPU runs the kernel interpreted (slow); "
                "use --config.model.kda.implementation=xla for CPU runs")
  ckpt_dir = os.path.join(os.path.abspath(workdir), "checkpoints")
  dataset, tokenizer = _open_data(config, model_cfg)
  config = _with_tokenizer_digest(config, tokenizer)
  resuming = bool(saved_steps(ckpt_dir))
  if resuming:  # before anything is read from or written to the run directory
    run_config.check_resume(workdir, config)

  mesh = pconf.make_mesh(devices)
  try:
    # The rows this process's devices hold: its own block when processes split the batch,
    # the same rows as its peers on other pipeline stages (the batch is replicated there).
    row_block, row_blocks = sharded_state.process_rows(mesh, config.batch_size, pconf.rules)
  except ValueError as e:
    raise ConfigError(f"config parallel: {e}") from None
  with _data_errors(config):
    data_it = make_iterator(dataset, config.data, global_batch_size=config.batch_size,
                            seq_len=config.seq_len, seed=config.seed, process_index=row_block,
                            process_count=row_blocks)
    eval_set = [data_it.local_rows(b)
                for b in make_eval_batches(dataset, config.data, batch_size=config.batch_size,
                                           seq_len=config.seq_len, num_batches=config.eval_batches)]

  # Models are built outside `jax.set_mesh`: under a mesh, parameters would be
  # created with eager sharding constraints; placement is done explicitly here.
  abstract = nnx.eval_shape(lambda: model_fn(nnx.Rngs(config.seed)))
  if model_segments(config.data, config.seq_len) is not None:
    _check_takes_segments(abstract)
  sharded = _needs_sharded_state(abstract, mesh, pconf, sizes)
  graphdef = nnx.split(abstract, nnx.Param, ...)[0]
  tx, train_step, eval_step = _programs(graphdef, ml_collections.FrozenConfigDict(config.optim),
                                        config.num_steps, model_segments(config.data, config.seq_len))
  abstract_state = abstract_train_state(abstract, tx)
  return _Build(config=config, workdir=workdir, nproc=nproc, ndev=len(devices), pconf=pconf,
                sizes=sizes, model_fn=model_fn, flops_per_token=flops_per_token, ckpt_dir=ckpt_dir,
                resuming=resuming, dataset=dataset, tokenizer=tokenizer, data_it=data_it, eval_set=eval_set, mesh=mesh,
                sharded=sharded, tx=tx, train_step=train_step, eval_step=eval_step,
                abstract_state=abstract_state,
                shardings=rules_lib.tree_shardings(abstract_state, mesh, pconf.rules))


@contextlib.contextmanager
def _data_errors(config: Any):
  """Re-raises the data modules' ValueErrors (they name the file or the size) as a ConfigError
  that says which section to fix."""
  try:
    yield
  except ValueError as e:
    if isinstance(e, InputError):
      raise
    raise ConfigError(f"config data (data.kind={config.data.kind!r}): {e}. Fix the data.* fields, "
                      "or seq_len and batch_size.") from e


def _check_takes_segments(model: nnx.Module) -> None:
  """Packed documents with the reset hand the model `segment_ids`; a model that cannot take
  them is refused here, before anything is compiled."""
  params = inspect.signature(type(model).__call__).parameters
  if "segment_ids" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
    raise ConfigError(f"config data.reset_at_boundaries=True hands the model segment_ids, but "
                      f"{type(model).__name__}.__call__ takes no segment_ids argument; give it one "
                      "(and max_segments), or set data.reset_at_boundaries=False")


def _open_data(config: Any, model_cfg) -> tuple[Any, Tokenizer | None]:
  """The dataset and its tokenizer (None for token files and MQAR), checked against the config
  and the model: the tokenizer the config names, the vocabulary and the largest id."""
  with _data_errors(config):
    dataset = make_dataset(config.data, seed=config.seed)
    dataset.check_seq_len(config.seq_len)
    tokenizer = dataset.tokenizer() if hasattr(dataset, "tokenizer") else None
  if tokenizer is None:
    return dataset, None
  if config.data.tokenizer:
    if not os.path.isfile(config.data.tokenizer):
      raise ConfigError(f"config data.tokenizer={config.data.tokenizer!r} does not exist; give the "
                        "tokenizer the data was prepared with, or leave data.tokenizer empty to use "
                        f"the copy in {config.data.path}")
    named = load_tokenizer(config.data.tokenizer)
    if named.sha256 != tokenizer.sha256:
      raise ConfigError(f"config data.tokenizer={config.data.tokenizer!r} (sha256 {named.sha256[:12]}...) "
                        f"is not the tokenizer {config.data.path} was prepared with (sha256 "
                        f"{tokenizer.sha256[:12]}...); prepare the data again with it, or leave "
                        "data.tokenizer empty")
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ConfigError(f"config model.vocab_size={model_cfg.vocab_size} is smaller than the data's "
                      f"tokenizer vocabulary {tokenizer.vocab_size} (data.kind={config.data.kind!r}); "
                      f"set --config.model.vocab_size={tokenizer.vocab_size}")
  return dataset, tokenizer


def _with_tokenizer_digest(config: Any, tokenizer: Tokenizer | None) -> Any:
  """A copy of `config` whose data.tokenizer_sha256 names the run's tokenizer (config.json keeps it,
  so a resume on data made with another tokenizer is refused). A value given must match."""
  if tokenizer is None:
    return config
  given = config.data.tokenizer_sha256
  if given and given != tokenizer.sha256:
    raise ConfigError(f"config data.tokenizer_sha256={given[:12]}... is not the digest of the data's "
                      f"tokenizer ({tokenizer.sha256[:12]}...); leave it empty: the trainer fills it in")
  config = copy.deepcopy(config)
  config.data.tokenizer_sha256 = tokenizer.sha256
  return config


def _restore(run: _Build, ckpt: Checkpointer):
  """The restore stage: the newest intact checkpoint on this mesh's shardings (None for a
  fresh run). Closes `ckpt` when it raises."""
  if not run.resuming:
    return None
  config = run.config
  # Straight onto this mesh's shardings, whatever mesh wrote it; no initialisation.
  shardings = sharded_state.full_shardings(run.shardings, run.abstract_state)
  template = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          run.abstract_state, shardings)
  try:
    restored = ckpt.restore_intact(template)
    if restored is not None and restored.step > config.num_steps:
      raise PastNumStepsError(
          f"the run in {run.workdir} is already at step {restored.step}, past num_steps="
          f"{config.num_steps}: nothing to do; nothing in {run.workdir} was changed (config.json "
          f"included). To train it further, give --config.num_steps above {restored.step}; to start "
          "a shorter run, give a new run directory.")
  except BaseException:
    ckpt.close()
    raise
  return restored


def _initial_state(run: _Build, ckpt: Checkpointer, restored):
  """The restored train state (the data position with it), or a fresh one laid out for the mesh."""
  config = run.config
  if restored is not None:
    try:
      data_state.restore_state(run.data_it, restored.data_state,
                               f"of step {restored.step} in {ckpt.directory}")
    except ValueError as e:
      ckpt.close()
      raise ConfigError(str(e)) from None
    if restored.skipped:
      _set_aside(ckpt, [s for s, _ in restored.skipped], run.nproc)
    log.info("resumed from step %d in %s (%s)", restored.step, ckpt.directory,
             "checksums verified" if restored.verified else "saved without checksums")
    return restored.state
  if not run.sharded:  # batch-only mesh: the plain one-device initialisation, replicated
    replicated = NamedSharding(run.mesh, P())
    return create_train_state(run.model_fn, run.tx, config.seed, sharding=replicated)[1]
  if run.sizes["fsdp"] > 1 or run.sizes["stage"] > 1:
    # ZeRO-3 or stage-local layers: initialised in the sharded layout, never as a full replica.
    return sharded_state.create_sharded_train_state(run.model_fn, run.tx, config.seed, run.mesh,
                                                    run.pconf.rules, shardings=run.shardings)[1]
  # No fsdp: each device holds a full replica of all but the experts anyway, so the
  # eager one-device initialisation (no init program to compile) is placed instead.
  return sharded_state.place(create_train_state(run.model_fn, run.tx, config.seed)[1], run.shardings)


def _nothing_to_do(run: _Build, step: int) -> dict[str, Any]:
  return {"first_eval": None, "eval": None, "eval_step": None, "evals": [], "train": None,
          "interrupted": False, "signal": None, "nothing_to_do": True, "num_params": None,
          "mesh": dict(run.mesh.shape), "num_steps": run.config.num_steps, "resumed_from": step,
          "skipped_checkpoints": [], "step": step}


@contextlib.contextmanager
def _writing(what: str, workdir: str):
  """Re-raises an OSError of a write before training as a `SaveFailedError` naming the file."""
  try:
    yield
  except OSError as e:
    raise SaveFailedError(f"could not write {what} in {workdir} ({os_cause(e)}); nothing was trained. "
                          f"Free space where {workdir} lives (df -h {workdir}) and run the same "
                          "command again.") from e


def _checkpointer(run: _Build) -> Checkpointer:
  with _writing("the checkpoint directory", run.workdir):  # orbax creates it
    return Checkpointer(run.ckpt_dir, max_to_keep=run.config.keep_checkpoints,
                        async_save=run.config.async_checkpoints)


def _restore_before_lock(run: _Build) -> tuple[Checkpointer | None, Any, list[int]]:
  """(checkpointer, restored, the steps it saw) of a resumed run, read before the lock is
  taken, so that a finished run answers `nothing to do` even on read-only media."""
  if not run.resuming:
    return None, None, []
  ckpt = _checkpointer(run)
  seen = ckpt.all_steps()
  return ckpt, _restore(run, ckpt), seen


def _prepare_workdir(run: _Build, start: int, restored) -> None:
  """Process 0's writes before the loop: config.json, the tokenizer's copy, superseded records."""
  workdir = run.workdir
  with _writing("config.json and the tokenizer's copy", workdir):
    run_config.write_config(workdir, run.config)
    if run.tokenizer is not None:  # generation and evaluation read the run's own copy
      run.tokenizer.save_to(workdir)
  with _writing("metrics.jsonl", workdir):
    dropped = drop_superseded(workdir, start if restored is not None else -1)
  if dropped:
    log.info("metrics.jsonl: moved %d record(s) past step %d, which this run redoes, to %s", dropped,
             start, os.path.join(workdir, "metrics.superseded.jsonl"))


def _train_and_evaluate(config: Any, workdir: str, lock: workdir_lock.WorkdirLock | None,
                        guard: SignalGuard | None, model_fn: Callable[[nnx.Rngs], nnx.Module] | None,
                        flops_per_token: float | None, hooks: Sequence[Hook]) -> dict[str, Any]:
  """`train_and_evaluate` once `lock` (process 0's, not yet taken) is known: build, restore,
  loop (with its evaluations and saves)."""
  run = _build(config, workdir, model_fn, flops_per_token)
  ckpt, restored, seen = _restore_before_lock(run)
  if restored is not None and restored.step == config.num_steps and not restored.skipped:
    ckpt.close()
    log.info("the run in %s is already at step %d = num_steps: nothing to do", workdir, restored.step)
    return _nothing_to_do(run, restored.step)
  # Every check has passed: from here on the run directory is written, under its lock.
  try:
    _lock_all_processes(lock, workdir, run.nproc)
  except BaseException:
    if ckpt is not None:
      ckpt.close()
    raise
  if ckpt is None:
    ckpt = _checkpointer(run)
  else:
    ckpt.reload()
    changed = ckpt.all_steps() != seen  # another trainer saved between the restore and the lock
    if run.nproc > 1:  # every process restores again, or none: the restore has collectives
      changed = bool(np.any(multihost_utils.process_allgather(np.array(changed))))
    if changed:
      restored = _restore(run, ckpt)
  state = _initial_state(run, ckpt, restored)
  start = int(state.step)
  if int(run.data_it.position) != start:
    ckpt.close()
    raise ValueError(f"checkpoint mismatch: state step {start}, data position {run.data_it.position}")
  if jax.process_index() == 0:
    try:
      _prepare_workdir(run, start, restored)
    except SaveFailedError:
      ckpt.close()
      raise
  return _TrainLoop(run, ckpt, restored, state, hooks, guard).run()


class _TrainLoop:
  """The loop stage: steps, metric records, evaluations and checkpoint saves of one invocation."""

  def __init__(self, run: _Build, ckpt: Checkpointer, restored, state, hooks: Sequence[Hook],
               guard: SignalGuard | None):
    config = run.config
    self.built, self.ckpt, self.restored, self.state, self.hooks = run, ckpt, restored, state, hooks
    self.guard = guard
    self.start = int(state.step)
    self.is_main = jax.process_index() == 0
    try:
      with self._writes("the metric records (metrics.jsonl, tb/)"):
        self.writer = MetricWriter(run.workdir, enabled=self.is_main,
                                   purge_step=self.start + 1 if restored is not None else 0)
    except SaveFailedError as e:
      ckpt.close()
      raise SaveFailedError(self._stopped(e, self.start)) from e.__cause__
    self.bar_enabled = self.is_main and config.progress_bar and tqdm is not None
    self.log_lines = self.is_main and not self.bar_enabled  # without a bar, step lines go to the log
    self.peak = peak_flops_per_device(config)
    self.tokens_per_step = config.batch_size * config.seq_len
    self.bar = _NoBar()
    # Start of the interval that tokens/s is measured over; the first one holds compilation.
    self.interval_step, self.interval_start, self.warm = self.start, 0.0, False
    num_params = count_elements(state.params)
    log.info("model: %d parameters; %d devices, %d processes, mesh %s%s; start step %d of %d",
             num_params, run.ndev, run.nproc, dict(run.mesh.shape),
             " (sharded state)" if run.sharded else "", self.start, config.num_steps)
    self.result: dict[str, Any] = {
        "first_eval": None, "eval": None, "eval_step": None, "evals": [], "train": None,
        "interrupted": False, "signal": None, "nothing_to_do": False, "num_params": num_params,
        "mesh": dict(run.mesh.shape),
        "num_steps": config.num_steps, "resumed_from": restored.step if restored else None,
        "skipped_checkpoints": restored.skipped if restored else []}

  @contextlib.contextmanager
  def _writes(self, what: str):
    """Re-raises an OSError of a write in the run directory as a `SaveFailedError` naming the file."""
    try:
      yield
    except OSError as e:
      raise SaveFailedError(f"could not write {what} in {self.built.workdir}: {os_cause(e)}") from e

  def _stopped(self, e: SaveFailedError, step: int) -> str:
    """A failed write's message, completed with where the run stopped and how to go on."""
    steps = saved_steps(self.ckpt.directory)
    kept = (f"The newest checkpoint kept is step {steps[-1]} in {self.ckpt.directory}; running the same "
            "command again resumes from it" if steps else
            f"No checkpoint was saved in {self.ckpt.directory}; running the same command again starts over")
    return (f"{e}. The run stopped after step {step}: writes are checked before every step, so no step "
            f"began once the failure was known. {kept}, once there is room: free space where "
            f"{self.built.workdir} lives (df -h {self.built.workdir}) or give the run a larger disk.")

  def evaluate(self, step: int) -> dict[str, float]:
    """The evaluate stage: held-out metrics of the current state, written and logged."""
    run = self.built
    sums = None
    for b in run.eval_set:
      with run.on_mesh():
        out = run.eval_step(self.state, run.put(b))
      sums = out if sums is None else jax.tree.map(lambda a, c: a + c, sums, out)
    host = jax.device_get(sums)
    count = max(float(host["count"]), 1.0)
    nats = float(host["nll_sum"]) / count
    record = {"loss": nats, "accuracy": float(host["correct_sum"]) / count,
              **run.dataset.metrics_from_loss(nats)}
    with self._writes("the metric records (metrics.jsonl, tb/)"):
      self.writer.write(step, "eval", record)
    self.result["evals"].append((step, record))
    self.result["eval"], self.result["eval_step"] = record, step
    if self.is_main:
      _log_above_bar(self.bar_enabled and step > self.start, report.eval_line(step, record))
    return record

  def save(self, step: int) -> None:
    """The save stage: a checkpoint of the state and the data position (each data shard's)."""
    self.ckpt.save(step, self.state, data_state.saved_state(self.built.data_it, self.built.nproc))

  def flush(self, step: int, metrics: dict, write: bool) -> dict[str, float]:
    """Fetches one step's metrics, stops on a non-finite loss, writes a record if asked."""
    host = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if host.pop("finite") < 1.0 or not math.isfinite(host["loss"]):
      self.ckpt.wait()
      raise NonFiniteLossError(_non_finite_message(
          step, host, self.start, self.restored, self.ckpt.latest_step(), self.ckpt.directory))
    if write:
      now = time.perf_counter()
      if self.warm and step > self.interval_step:
        tps = (step - self.interval_step) * self.tokens_per_step / (now - self.interval_start)
        host["tokens_per_s"] = tps
        if self.built.flops_per_token and self.peak:
          host["mfu"] = self.built.flops_per_token * tps / (self.peak * self.built.ndev)
      self.interval_step, self.interval_start, self.warm = step, now, True
      with self._writes("the metric records (metrics.jsonl, tb/)"):
        self.writer.write(step, "train", host)
      self.bar.set_postfix(loss=f"{host['loss']:.3f}", refresh=False)
      if self.log_lines:
        log.info(report.step_line(step, self.built.config.num_steps, host))
    return host

  def _open_bar(self, step: int):
    if not self.bar_enabled:
      return _NoBar()
    return tqdm(total=self.built.config.num_steps, initial=step, dynamic_ncols=True, desc="train")

  def _stop_requested(self, guard: SignalGuard) -> bool:
    flag = guard.received is not None
    if self.built.nproc > 1:
      flag = bool(np.any(multihost_utils.process_allgather(np.array(flag))))
    return flag

  def _close(self, failing: bool) -> None:
    """Closes the bar, the metric writer, the checkpointer (finishing a pending save) and the
    data iterator, each even when one before it fails. The first failure is raised, unless
    the loop is failing already: the error under way says more, and these are logged."""
    first = None
    for name, close in (("progress bar", self.bar.close), ("metric writer", self._close_writer),
                        ("checkpointer", self.ckpt.close), ("data iterator", self.built.data_it.close)):
      try:
        close()
      except Exception as e:  # pylint: disable=broad-except
        if failing:
          log.warning("closing the %s failed too (%s)", name, e)
        elif first is None:
          first = e
    if first is not None:
      raise first

  def _close_writer(self) -> None:
    with self._writes("the metric records (metrics.jsonl, tb/)"):
      self.writer.close()

  def run(self) -> dict[str, Any]:
    """Evaluates step 0 of a fresh run, then trains to num_steps or to a stopping signal."""
    step = self.start
    try:
      step = self._loop()
    except SaveFailedError as e:
      self._close(failing=True)
      raise SaveFailedError(self._stopped(e, self.result["step"])) from e.__cause__
    except BaseException:
      self._close(failing=True)
      raise
    try:
      self._close(failing=False)
    except SaveFailedError as e:  # the last save, finished here
      raise SaveFailedError(self._stopped(e, step)) from e.__cause__
    self.result["step"] = step
    return self.result

  def _loop(self) -> int:
    """The steps, with their evaluations and saves; returns the last step run. `result["step"]`
    follows the last step that finished."""
    built, config, result = self.built, self.built.config, self.result
    result["step"] = self.start
    if self.start == 0:
      result["first_eval"] = self.evaluate(0)
    if tqdm is None and self.is_main and config.progress_bar:
      log.warning("tqdm is not installed: no progress bar; step lines go to the log")
    if self.is_main and self.start < config.num_steps:
      log.info("compiling the training step (the first step takes longer than the rest)")
    self.interval_start = time.perf_counter()
    step, pending = self.start, None
    with contextlib.nullcontext(self.guard) if self.guard else SignalGuard() as guard:
      while step < config.num_steps:
        self.ckpt.check()  # an asynchronous save that failed stops the run before another step
        batch = built.put(next(built.data_it))
        with built.on_mesh():
          self.state, metrics = built.train_step(self.state, batch)
        guard.ready()  # compiled and dispatched: a signal now stops after saving this step
        step += 1
        result["step"] = step
        if step == self.start + 1:
          # The bar starts once the first step is compiled, so its first estimate is the step time's.
          self.bar = self._open_bar(step)
        else:
          self.bar.update(1)
        if pending is not None:  # check the previous step while this one runs
          self.flush(*pending, write=False)
          pending = None
        last = step == config.num_steps
        do_eval = last or (config.eval_every and step % config.eval_every == 0)
        do_ckpt = last or (config.checkpoint_every and step % config.checkpoint_every == 0)
        do_log = last or step % config.log_every == 0
        if do_eval or do_ckpt or do_log or self.hooks or guard.received is not None:
          result["train"] = host = self.flush(step, metrics, write=do_log)
          for hook in self.hooks:
            hook(step, host)
          stopping = self._stop_requested(guard) if (built.nproc == 1 or do_log) else False
          paused = time.perf_counter()
          if do_eval:
            self.evaluate(step)
            metric = built.dataset.eval_metric
            self.bar.set_postfix(loss=f"{host['loss']:.3f}",
                                 **{"eval_" + metric: f"{result['eval'][metric]:.3f}"})
          if do_ckpt or stopping:
            self.save(step)
          self.interval_start += time.perf_counter() - paused  # tokens/s counts training time only
          if stopping:
            result["interrupted"] = True
            if guard.received is not None:
              result["signal"] = signal.Signals(guard.received).name
            log.warning("stopping at step %d after a signal; checkpoint saved", step)
            break
        else:
          pending = (step, metrics)
      if pending is not None:
        result["train"] = self.flush(*pending, write=False)
    return step


def _set_aside(ckpt: Checkpointer, steps: list[int], nproc: int) -> None:
  """Moves damaged checkpoints newer than the restored one out of the way, so the run can
  save those steps again and a later resume does not try them first."""
  moved = ckpt.set_aside(steps)
  if nproc > 1:
    multihost_utils.sync_global_devices("k3jax_set_aside_checkpoints")
  ckpt.reload()
  for path in moved:
    log.warning("moved the damaged checkpoint to %s", path)
