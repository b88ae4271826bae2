"""Continues text prompts with a trained HybridLM (or a randomly initialised one).

  python experiments/generate.py --workdir=runs/tiny --prompt="def main(" \
      --prompt="import os" --max_new_tokens=100 --temperature=0 --stop=$'\n\n'

Prompts: `--prompt` (repeatable) and `--prompt_file`, encoded with the run's
tokenizer (the byte tokenizer for byte-level runs, the tokenizer file the
trainer copied into the run directory for prepared data). A prompt file holds
one prompt per line; a `.jsonl` file holds one JSON string, or object with a
"prompt" field, per line (for prompts with newlines). `--prompt_ids=1,2,3`
(repeatable) gives raw ids instead, for runs without a tokenizer.

Output: each prompt (times `--num_samples`) and its continuation. One row
streams as it is generated, `--stream_steps` tokens per device call; several
rows print each when it finishes. A row ends at the eos token (`--eos`, the
tokenizer's by default), at a `--stop` string (looked for in the decoded text,
so it may span tokens; it is not printed), or after `--max_new_tokens`.
`--max_len` caps prompt + new tokens; without it the only limit is the memory
the decoding caches would take.

`--config` (a configs/*.py file) instead of `--workdir` builds a randomly
initialised model, to check the decoding path end to end.

Exit status: 0 done, 1 an unexpected exception (with its traceback), 2 a bad
argument or input (one `error:` paragraph; `--traceback` adds the traceback).
"""
import json
import math
import os
import sys

from absl import app
from absl import flags
from absl import logging

# Run from a checkout without installing: the repository root holds the k3jax package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax.models import generate as gen  # noqa: E402
from k3jax.models import lm  # noqa: E402
from k3jax.train import cli_errors  # noqa: E402
from k3jax.train.checkpoint import CheckpointError  # noqa: E402
from k3jax.train.config_files import load_config_file  # noqa: E402
from k3jax.train.config_schema import model_config_from  # noqa: E402
from k3jax.train.restore import restore_model, run_tokenizer  # noqa: E402
from k3jax.train.run_config import load_run_config  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Training run directory (config.json + checkpoints/).")
flags.DEFINE_string("config", None, "Config file for a randomly initialised model (no --workdir).")
flags.DEFINE_integer("step", None, "Checkpoint step to restore (default: the newest intact one).")
flags.DEFINE_multi_string("prompt", None, "Text prompt (repeatable); default one newline.")
flags.DEFINE_string("prompt_file", None, "File of prompts: one per line, or JSONL (.jsonl) strings "
                    "or {\"prompt\": ...} objects.")
flags.DEFINE_multi_string("prompt_ids", None, "Comma-separated token ids of one prompt (repeatable); "
                          "instead of text prompts.")
flags.DEFINE_integer("num_samples", 1, "Continuations per prompt.")
flags.DEFINE_integer("max_new_tokens", 128, "Most tokens to generate per row.")
flags.DEFINE_integer("max_len", None, "Most positions per row, prompt + new tokens "
                     "(default: as many as the decoding caches fit in memory).")
flags.DEFINE_float("temperature", 1.0, "Softmax temperature; 0 is greedy.")
flags.DEFINE_integer("top_k", None, "Keep only the k most likely tokens.")
flags.DEFINE_float("top_p", None, "Nucleus sampling: keep the most likely tokens up to this "
                   "probability mass, in (0, 1].")
flags.DEFINE_multi_string("stop", None, "Text that ends a row (repeatable; not printed).")
flags.DEFINE_integer("eos", None, "Token id that ends a row (default: the tokenizer's eos; "
                     "-1: none).")
flags.DEFINE_integer("stream_steps", 8, "Tokens per device call while streaming.")
flags.DEFINE_integer("seed", 0, "Sampling seed (and the random model's).")
flags.DEFINE_string("kda_decode", None, "KDA decode step: auto | pallas | fused | naive "
                    "(default: the model config's kda_decode).")
flags.DEFINE_bool("traceback", False, "Print the traceback of an argument or input error too "
                  f"(or set {cli_errors.TRACEBACK_ENV}=1).")

_REPLACEMENT = "\ufffd"  # what an id sequence cut inside a UTF-8 character decodes to


class UsageError(ValueError):
  """A bad flag value or input; printed as one `error:` paragraph, exit status 2."""


# -- checks before anything is loaded -----------------------------------------


def _check_numbers() -> None:
  """The numeric flags that need no model (top_k's upper bound waits for the vocabulary)."""
  t = FLAGS.temperature
  if not (math.isfinite(t) and t >= 0):
    raise UsageError(f"--temperature={t} must be a finite number >= 0 (0 is greedy)")
  if FLAGS.top_k is not None and FLAGS.top_k < 1:
    raise UsageError(f"--top_k={FLAGS.top_k} must be >= 1 (or left out: no top-k filter)")
  p = FLAGS.top_p
  if p is not None and not 0 < p <= 1:
    raise UsageError(f"--top_p={p} must be in (0, 1] (1 keeps every token)")
  for name in ("max_new_tokens", "num_samples", "stream_steps", "max_len"):
    value = FLAGS[name].value
    if value is not None and value < 1:
      raise UsageError(f"--{name}={value} must be >= 1")
  if bool(FLAGS.workdir) == bool(FLAGS.config):
    raise UsageError("give --workdir (a training run directory) or --config (a config file, for "
                     "a randomly initialised model), one of the two")
  if FLAGS.prompt_ids and (FLAGS.prompt or FLAGS.prompt_file):
    raise UsageError("--prompt_ids gives the prompts as ids: leave out --prompt and --prompt_file")


def _parse_ids(texts: list[str]) -> list[list[int]]:
  out = []
  for text in texts:
    try:
      ids = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
      raise UsageError(f"--prompt_ids={text!r} is not comma-separated integers, e.g. "
                       "--prompt_ids=12,7,301") from None
    if not ids:
      raise UsageError(f"--prompt_ids={text!r} holds no ids")
    out.append(ids)
  return out


def _read_prompt_file(path: str) -> list[str]:
  """One prompt per line, or per JSONL line (a string or an object with "prompt")."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise UsageError(f"--prompt_file={path!r} cannot be read ({e}); give a readable UTF-8 text "
                     "file, one prompt per line") from None
  if not path.endswith(".jsonl"):
    prompts = [line for line in lines if line]
  else:
    prompts = [_jsonl_prompt(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
  if not prompts:
    raise UsageError(f"--prompt_file={path!r} holds no prompts (empty lines are skipped)")
  return prompts


def _jsonl_prompt(path: str, number: int, line: str) -> str:
  try:
    value = json.loads(line)
  except json.JSONDecodeError as e:
    raise UsageError(f"{path}:{number} is not JSON ({e})") from None
  if isinstance(value, dict):
    value = value.get("prompt")
  if not isinstance(value, str):
    raise UsageError(f"{path}:{number} must be a JSON string or an object with a string "
                     "\"prompt\" field")
  return value


# -- the model's config, tokenizer and limits ----------------------------------


def _trainer_config():
  """The trainer config of --workdir's run or of --config's file (nothing restored)."""
  try:
    if FLAGS.workdir:
      return load_run_config(FLAGS.workdir)
    return load_config_file(FLAGS.config)
  except ValueError as e:
    raise UsageError(str(e)) from None


def _prompts(tokenizer, vocab: int) -> tuple[list[list[int]], list[str] | None]:
  """(ids of each prompt, its text or None for --prompt_ids)."""
  if FLAGS.prompt_ids:
    return _parse_ids(FLAGS.prompt_ids), None
  texts = list(FLAGS.prompt or [])
  if FLAGS.prompt_file:
    texts += _read_prompt_file(FLAGS.prompt_file)
  texts = texts or ["\n"]
  if tokenizer is None:
    raise UsageError(f"this model's data are ids without a tokenizer (vocabulary {vocab}); give "
                     "the prompts as --prompt_ids=1,2,3")
  ids = [[int(t) for t in tokenizer.encode(text)] for text in texts]
  for text, row in zip(texts, ids):
    if not row:
      raise UsageError(f"prompt {text!r} encodes to no tokens; give a non-empty prompt")
  return ids, texts


def _eos(tokenizer) -> int | None:
  if FLAGS.eos is None:
    return None if tokenizer is None else tokenizer.eos_id
  return None if FLAGS.eos == -1 else FLAGS.eos


def _memory_bytes() -> tuple[int, str]:
  """Bytes the caches may take on the first device, and where."""
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"free on {device}"
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "of host memory"


def _size(n: int) -> str:
  for unit, scale in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20)):
    if n >= scale:
      return f"{n / scale:,.3g} {unit}" if n < 1000 * scale else f"{n / scale:,.0f} {unit}"
  return f"{n / 2 ** 10:.3g} KiB"


def _check_length(model_cfg, ids: list[list[int]], rows: int) -> None:
  """The longest prompt + --max_new_tokens against --max_len and the memory the caches need."""
  longest = max(range(len(ids)), key=lambda i: len(ids[i]))
  positions = len(ids[longest]) + FLAGS.max_new_tokens
  need = gen.cache_bytes(model_cfg, rows, positions)
  sizes = (f"the decoding caches of {rows} row(s) of {positions} positions would take "
           f"{_size(need['total'])} (attention KV caches {_size(need['attention'])}, KDA states "
           f"{_size(need['kda'])})")
  what = (f"prompt {longest} has {len(ids[longest])} tokens; with --max_new_tokens="
          f"{FLAGS.max_new_tokens} a row needs {positions} positions")
  if FLAGS.max_len is not None and positions > FLAGS.max_len:
    raise UsageError(f"{what}, more than --max_len={FLAGS.max_len}; {sizes}. Shorten the prompt, "
                     "lower --max_new_tokens or raise --max_len.")
  free, where = _memory_bytes()
  if need["total"] > free:
    raise UsageError(f"{what}: {sizes}, more than the {_size(free)} {where}. Shorten the prompt, "
                     "lower --max_new_tokens or --num_samples.")


def _check_against_vocab(ids, stops, eos, vocab: int) -> None:
  if FLAGS.top_k is not None and FLAGS.top_k > vocab:
    raise UsageError(f"--top_k={FLAGS.top_k} is more than the vocabulary ({vocab} tokens)")
  if eos is not None and not 0 <= eos < vocab:
    raise UsageError(f"--eos={eos} is outside the vocabulary [0, {vocab}) (-1: no eos)")
  for i, row in enumerate(ids):
    bad = [t for t in row if not 0 <= t < vocab]
    if bad:
      raise UsageError(f"prompt {i} has id {bad[0]} outside the vocabulary [0, {vocab})")
  if stops and any(not s for s in stops):
    raise UsageError("--stop got an empty string; give the text that ends a row")


# -- output ---------------------------------------------------------------------


class _Row:
  """One row's output: text stops found in the decoded text, and what is printed so far."""

  def __init__(self, tokenizer, stops: list[str]):
    self.tokenizer, self.stops = tokenizer, stops
    self.ids: list[int] = []
    self.text = ""        # what `add` has released
    self.stopped = False  # a stop string ended the row

  def add(self, new_ids: list[int]) -> str:
    """Takes the newly visible ids; returns the text that may be printed now (ids as
    ",12,7" without a tokenizer; never a stop string or what follows it)."""
    self.ids += new_ids
    if self.tokenizer is None:
      out = "".join(f",{t}" for t in new_ids)
    else:
      out = self._release(self.tokenizer.decode(self.ids), final=False)
    self.text += out
    return out

  def flush(self) -> str:
    """The held-back tail once the row has finished."""
    if self.tokenizer is None or self.stopped:
      return ""
    out = self._release(self.tokenizer.decode(self.ids), final=True)
    self.text += out
    return out

  def _release(self, text: str, *, final: bool) -> str:
    hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
    if hits:
      self.stopped, end = True, min(hits)
    elif final:
      end = len(text)
    else:
      # A stop string may still begin in the tail, and a character may still be incomplete.
      end = len(text) - max([len(s) - 1 for s in self.stops] + [0])
      while end > 0 and text[end - 1] == _REPLACEMENT:
        end -= 1
    return text[len(self.text):max(end, len(self.text))]


def _header(row: int, prompt: str) -> str:
  n = FLAGS.num_samples
  return f"--- prompt {row // n}" + (f", sample {row % n}" if n > 1 else "") + f"\n{prompt}"


def _footer(completion: gen.Completion, row: _Row) -> str:
  if row.stopped:  # the row decoded a few tokens past its stop string before it was seen
    return "\n--- stop (a --stop string)"
  return f"\n--- {completion.finish_reason}, {len(completion.tokens)} new tokens"


def _run(generation: gen.Generation, rows: list[_Row], prompts: list[str]) -> None:
  """Decodes to the end, streaming a single row, else printing each row when it ends."""
  stream = len(rows) == 1
  if stream:
    print(_header(0, prompts[0]), end="", flush=True)
  printed = [False] * len(rows)
  while not generation.done:
    for i, new in enumerate(generation.advance(FLAGS.stream_steps)):
      text = rows[i].add(new)
      if rows[i].stopped:
        generation.stop(i)
      if stream:
        print(text, end="", flush=True)
    for i, row in enumerate(rows):
      if printed[i] or not generation.finished(i):
        continue
      printed[i] = True
      tail = row.flush()
      body = tail if stream else _header(i, prompts[i]) + row.text
      print(body + _footer(generation.results()[i], row), flush=True)


def _load_model(model_cfg):
  if FLAGS.workdir:
    try:
      model, _, step = restore_model(FLAGS.workdir, FLAGS.step)
    except (CheckpointError, ValueError) as e:  # a missing step lists the saved ones
      raise UsageError(str(e)) from None
    print(f"restored step {step} from {FLAGS.workdir}")
    return model
  print(f"random model from {FLAGS.config} (no checkpoint)")
  return lm.HybridLM(model_cfg, rngs=nnx.Rngs(FLAGS.seed))


def _setup():
  """Everything checked before the model is built: (model config, tokenizer, prompt ids,
  prompt texts, eos, stops)."""
  _check_numbers()
  config = _trainer_config()
  try:
    model_cfg = model_config_from(config.model)
    tokenizer = run_tokenizer(config, FLAGS.workdir or None)
  except ValueError as e:
    raise UsageError(str(e)) from None
  vocab = model_cfg.vocab_size
  ids, texts = _prompts(tokenizer, vocab)
  stops = list(FLAGS.stop or [])
  if stops and tokenizer is None:
    raise UsageError("--stop needs text, and this model's data have no tokenizer")
  eos = _eos(tokenizer)
  _check_against_vocab(ids, stops, eos, vocab)
  _check_length(model_cfg, ids, len(ids) * FLAGS.num_samples)
  if texts is None:
    texts = [",".join(str(t) for t in row) for row in ids]
  return model_cfg, tokenizer, ids, texts, eos, stops


def main(argv):
  if len(argv) > 1:
    cli_errors.fail_input(f"unexpected arguments {argv[1:]}: every setting is a flag, "
                          "e.g. --prompt=TEXT")
  if not FLAGS["verbosity"].present:
    # Library INFO lines (orbax's restore steps, backend probing) hide the samples.
    logging.set_verbosity(logging.WARNING)
  try:
    model_cfg, tokenizer, ids, texts, eos, stops = _setup()
    model = _load_model(model_cfg)
    if FLAGS.kda_decode:
      try:
        gen.set_kda_decode(model, FLAGS.kda_decode)
      except ValueError as e:
        raise UsageError(f"--kda_decode: {e}") from None
  except UsageError as e:
    cli_errors.fail_input(str(e))
  n = FLAGS.num_samples
  rows = [row for row in ids for _ in range(n)]
  generation = gen.Generation(
      model, rows, max_new_tokens=FLAGS.max_new_tokens, key=jax.random.key(FLAGS.seed),
      temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p, eos_id=eos)
  _run(generation, [_Row(tokenizer, stops) for _ in rows], [t for t in texts for _ in range(n)])


if __name__ == "__main__":
  app.run(main, flags_parser=cli_errors.parse_flags)
