"""lm-eval (`lm_eval`, the `eval` extra) on a trained run, through the scoring API.

    lm = HarnessLM.from_run("runs/tiny")
    results = evaluate(lm, ["k3jax_python_next_line"])   # bundled tasks: k3jax/eval/tasks

`loglikelihood` and `loglikelihood_rolling` go to `k3jax.models.score` (requests packed
into rows of the run's seq_len, each its own document); `generate_until` to
`k3jax.models.generate.generate`, greedy unless the task asks for sampling, the text cut
at the first of the task's `until` strings. Text goes through the run's tokenizer.

Where the model needs a token before the text (an empty context, the first token of a
rolling text) it reads the tokenizer's eos, else its bos, else the token of a newline
(the byte tokenizer has neither): `prefix_id`.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import jax
from lm_eval import evaluator
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager

from k3jax.data.tokenizer import Tokenizer
from k3jax.eval.run import load_run
from k3jax.models import generate as gen
from k3jax.models import score

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")
# lm-eval's default length of generated text, where a task names none.
DEFAULT_GEN_TOKENS = 256


def prefix_id(tokenizer: Tokenizer) -> int:
  """The token read before a text that has no context: eos, else bos, else a newline's."""
  for special in (tokenizer.eos_id, tokenizer.bos_id):
    if special is not None:
      return int(special)
  return int(tokenizer.encode("\n")[-1])


def cut_at_stop(text: str, until: Sequence[str]) -> str:
  """`text` up to the first occurrence of any of the `until` strings."""
  ends = [text.find(s) for s in until if s]
  return text[:min([e for e in ends if e >= 0], default=len(text))]


class HarnessLM(TemplateLM):
  """A HybridLM and its tokenizer as an lm-eval model.

  Args:
    model: a HybridLM.
    tokenizer: the tokenizer it was trained with.
    seq_len: positions of the rows requests are packed into (a context that does not fit
      loses its first tokens).
    batch_rows, max_documents_per_row, share_rows: the packing (`score.continuation_logprobs`).
    overlap: context of the windows of rolling texts (`score.rolling_windows`).
    seed: key of sampled generation.
  """

  def __init__(self, model, tokenizer: Tokenizer, *, seq_len: int, batch_rows: int = 8,
               max_documents_per_row: int = 8, share_rows: bool | None = None,
               overlap: int | None = None, seed: int = 0):
    super().__init__()
    self.model, self.tokenizer, self.seq_len, self.overlap = model, tokenizer, seq_len, overlap
    self.layout = {"batch_rows": batch_rows, "max_documents_per_row": max_documents_per_row,
                   "share_rows": share_rows}
    self.key = jax.random.key(seed)
    self.step: int | None = None  # the checkpoint's, where `from_run` restored one

  @classmethod
  def from_run(cls, workdir: str, step: int | None = None, *, seq_len: int | None = None,
               **kwargs) -> "HarnessLM":
    """The model of a run directory at `step` (default: newest) with its tokenizer; rows of
    the run's seq_len unless `seq_len` is given, holding at most the run's
    data.max_documents_per_row requests. Sets `.step`."""
    run = load_run(workdir, step)
    kwargs.setdefault("max_documents_per_row", int(run.config.data.get("max_documents_per_row", 8)))
    lm = cls(run.model, run.tokenizer, seq_len=seq_len or int(run.config.seq_len), **kwargs)
    lm.step = run.step
    return lm

  @property
  def eot_token_id(self) -> int:
    return prefix_id(self.tokenizer)

  @property
  def max_length(self) -> int:
    return self.seq_len

  @property
  def tokenizer_name(self) -> str:
    return f"{self.tokenizer.kind}-{self.tokenizer.sha256[:12]}"

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    del add_special_tokens, kwargs  # the tokenizers add no special tokens
    return self.tokenizer.encode(string).tolist()

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    del disable_tqdm, kwargs
    results = score.continuation_logprobs(
        self.model, [(context, continuation) for _, context, continuation in requests],
        seq_len=self.seq_len, **self.layout)
    for (key, _, _), result in zip(requests, results):
      if key is not None:
        self.cache_hook.add_partial("loglikelihood", key, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    del disable_tqdm
    texts = [request.args[0] for request in requests]
    results = score.rolling_logprobs(
        self.model, [self.tok_encode(t) for t in texts], seq_len=self.seq_len,
        prefix_id=self.eot_token_id, overlap=self.overlap, **self.layout)
    for text, result in zip(texts, results):
      self.cache_hook.add_partial("loglikelihood_rolling", (text,), result)
    return results

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Each request's continuation, cut at the first of its `until` strings; requests of the
    same length and temperature go to `generate` together."""
    del disable_tqdm
    settings = [generation_settings(dict(request.args[1])) for request in requests]
    out = [""] * len(requests)
    for (max_new, temperature) in dict.fromkeys((m, t) for _, m, t in settings):
      group = [i for i, (_, m, t) in enumerate(settings) if (m, t) == (max_new, temperature)]
      keep = max(self.seq_len - max_new, 1)
      prompts = [(self.tok_encode(requests[i].args[0]) or [self.eot_token_id])[-keep:]
                 for i in group]
      self.key, key = jax.random.split(self.key)
      new = generate_ids(self.model, prompts, max_new_tokens=max_new, key=key,
                         temperature=temperature, eos_id=self.tokenizer.eos_id)
      for i, ids in zip(group, new):
        out[i] = cut_at_stop(self.tokenizer.decode(ids), settings[i][0])
        self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
    return out


def generation_settings(kwargs: dict[str, Any]) -> tuple[list[str], int, float]:
  """(until strings, max new tokens, temperature) of a task's generation kwargs: greedy
  unless `do_sample`."""
  until = kwargs.get("until") or []
  until = [until] if isinstance(until, str) else list(until)
  max_new = int(kwargs.get("max_gen_toks", DEFAULT_GEN_TOKENS))
  temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
  return until, max_new, temperature


def generate_ids(model, prompts: list[list[int]], *, max_new_tokens: int, key, temperature: float,
                 eos_id: int | None) -> list[list[int]]:
  """The new tokens `generate` gives each prompt (prompts of any lengths at once), without
  the eos that ended a row."""
  completions = gen.generate(model, prompts, max_new_tokens=max_new_tokens, key=key,
                             temperature=temperature, eos_id=eos_id)
  return [[int(t) for t in c.tokens] for c in completions]


def task_manager(tasks: Sequence[str], include_paths: Sequence[str] = ()) -> TaskManager:
  """A TaskManager that finds the bundled tasks (and `include_paths`'); lm-eval's own tasks
  are indexed only when `tasks` names one outside those."""
  paths = [TASKS_DIR, *include_paths]
  manager = TaskManager(include_path=paths, include_defaults=False)
  if set(tasks) <= set(manager.all_tasks):
    return manager
  return TaskManager(include_path=paths, include_defaults=True)


def evaluate(lm: HarnessLM, tasks: Sequence[str], *, include_paths: Sequence[str] = (),
             limit: int | None = None, num_fewshot: int | None = None) -> dict:
  """lm-eval's `simple_evaluate` of `lm` on `tasks` (names or groups); its results dict
  (without bootstrap standard errors or per-sample logs).

  Raises:
    ValueError: a task lm-eval cannot find.
  """
  manager = task_manager(tasks, include_paths)
  unknown = sorted(set(tasks) - set(manager.all_tasks))
  if unknown:
    raise ValueError(f"unknown tasks {unknown}: give lm-eval task names, the bundled "
                     f"{sorted(TaskManager(include_path=TASKS_DIR, include_defaults=False).all_tasks)} "
                     "or tasks of an --include_path directory")
  return evaluator.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                   num_fewshot=num_fewshot, log_samples=False,
                                   bootstrap_iters=0)
