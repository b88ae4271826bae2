"""Text lines the trainer logs and the closing summary of `experiments/train.py`.

Every evaluation is named by the step it was made at, so a run stopped early
never presents an old evaluation as the final one.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence


def _metrics(record: Mapping[str, float]) -> str:
  return ", ".join(f"{k}={v:.4f}" for k, v in sorted(record.items()))


def step_line(step: int, num_steps: int, host: Mapping[str, float]) -> str:
  """One training step's line: step, loss, tokens/s and MFU when known, learning rate."""
  parts = [f"step {step}/{num_steps}", f"loss={host['loss']:.4f}"]
  if "tokens_per_s" in host:
    parts.append(f"tokens/s={host['tokens_per_s']:.0f}")
  else:
    parts.append("tokens/s=n/a (first interval holds compilation)")
  if "mfu" in host:
    parts.append(f"MFU={100 * host['mfu']:.2f}%")
  if "learning_rate" in host:
    parts.append(f"lr={host['learning_rate']:.3g}")
  return " ".join(parts)


def eval_line(step: int, record: Mapping[str, float]) -> str:
  """One evaluation's line, labelled by its step."""
  return f"eval at step {step}: {_metrics(record)}"


def summary(result: Mapping[str, Any]) -> str:
  """The closing line of a run from `train_and_evaluate`'s result.

  Names the step reached, then the evaluations this invocation made (the first
  and the last when there were more), each labelled by its step; a run stopped
  by a signal says that it was preempted, at which step, and when its last
  evaluation is older than its step.
  """
  if result.get("nothing_to_do"):
    return (f"run already at step {result['step']} of num_steps={result['num_steps']}: nothing to do "
            "(give a larger --config.num_steps to continue it)")
  evals: Sequence[tuple[int, Mapping[str, float]]] = result.get("evals") or []
  parts = [f"step {result['step']} of {result['num_steps']}"]
  if result.get("resumed_from") is not None:
    parts[0] += f" (resumed from step {result['resumed_from']})"
  shown = list(evals) if len(evals) <= 2 else [evals[0], evals[-1]]
  parts += [eval_line(step, record) for step, record in shown]
  if not evals:
    parts.append("no evaluation in this invocation")
  if result.get("interrupted"):
    by = result.get("signal") or "a signal"
    stop = (f"preempted by {by} at step {result['step']}: checkpoint saved, the same command "
            "resumes from it")
    if evals and evals[-1][0] != result["step"]:
      stop += f"; the latest evaluation is from step {evals[-1][0]}"
    parts.append(stop)
  return " | ".join(parts)
