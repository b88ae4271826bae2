"""Exit codes of `experiments/train.py` and the one-paragraph form of its errors.

A configuration or input error is a mistake the user can fix without reading
code: a bad value, an unknown or misplaced field, a missing file, a run
directory that is in use or was written under another config. Such errors are
`InputError`s; the binary prints their message as one `error:` paragraph and
exits with `EXIT_INPUT_ERROR`, without a traceback unless `--traceback` or
`K3JAX_TRACEBACK=1` asks for it. A write that fails while the run trains (a
full disk, an I/O error) is a `SaveFailedError`: one paragraph too, with
`EXIT_SAVE_FAILED`. Nothing here imports JAX.
"""
from __future__ import annotations

import errno
import os
import re
import sys
import traceback
from typing import Mapping, NoReturn, Sequence

from absl import flags

EXIT_FINISHED = 0     # the run reached num_steps (or already had: nothing to do)
EXIT_FAILED = 1       # training failed (non-finite loss) or an unexpected exception (with its traceback)
EXIT_INPUT_ERROR = 2  # configuration or input error: nothing was trained, the run directory is unchanged
EXIT_SAVE_FAILED = 74  # a checkpoint, metrics or run-directory write failed (disk full, I/O error): the run
#                        stopped at once; the newest intact checkpoint is kept and the same command resumes (EX_IOERR)
EXIT_PREEMPTED = 75   # stopped by SIGTERM/SIGINT (after saving a checkpoint, or before the first step, when
#                      there is nothing new to save); the same command resumes (EX_TEMPFAIL)

TRACEBACK_FLAG = "--traceback"
TRACEBACK_ENV = "K3JAX_TRACEBACK"
# "config model.kda.lower_bound=-50.0 ..." names the field that a fix sentence points at.
_FIELD = re.compile(r"^config ([A-Za-z_][\w.]*)=")
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


class InputError(ValueError):
  """A configuration or input error; the message names the field, the value, the limit and the fix."""


class SaveFailedError(RuntimeError):
  """A write to the run directory failed while the run trained; the message names the file, the
  cause, the newest checkpoint kept and the fix."""


def os_cause(e: BaseException) -> str:
  """The operating system's reason in an exception, e.g. `No space left on device (ENOSPC)`.

  Reads `OSError.errno`, or the `os_error_code='28'` that tensorstore (orbax's writer) puts in
  its messages; falls back to the exception's type and first line.
  """
  code = e.errno if isinstance(e, OSError) and e.errno else None
  if code is None:
    match = _OS_ERROR_CODE.search(str(e))
    code = int(match.group(1)) if match else None
  if code is not None:
    return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def traceback_requested(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> bool:
  """Whether the full traceback was asked for: `--traceback` on the command line or K3JAX_TRACEBACK set.

  Read from the raw arguments, so that it works when the flags themselves fail to parse.
  """
  flag = any(a in (TRACEBACK_FLAG, TRACEBACK_FLAG + "=true", TRACEBACK_FLAG + "=1") for a in argv)
  return flag or environ.get(TRACEBACK_ENV, "").lower() not in ("", "0", "false", "no")


def then(first: str, second: str) -> str:
  """Two sentences joined, `first` closed with a period unless it ends in one already (or in ?/!)."""
  first = first.rstrip()
  return f"{first}{'' if first.endswith(('.', '?', '!')) else '.'} {second}"


def with_fix(message: str) -> str:
  """`message`, with a closing sentence on how to change the field it names when it names one."""
  match = _FIELD.match(message)
  if not match or "--config." in message:
    return message
  field = match.group(1)
  return then(message, f"Change it with --config.{field}=VALUE, or in the config file.")


def paragraph(message: str) -> str:
  """`error: <message>` as one paragraph: the message's lines kept, blank lines dropped."""
  lines = [line.rstrip() for line in str(message).strip().splitlines() if line.strip()]
  return "error: " + "\n".join(lines or ["(no message)"])


def exit_with(message: str, code: int, *, show_traceback: bool) -> NoReturn:
  """Prints the error paragraph (after the current exception's traceback if asked) and exits."""
  sys.stdout.flush()
  if show_traceback and sys.exc_info()[0] is not None:
    traceback.print_exc()
  print(paragraph(message), file=sys.stderr, flush=True)
  sys.exit(code)


def fail_input(message: str) -> NoReturn:
  """Exits with EXIT_INPUT_ERROR after one `error:` paragraph (and the traceback when
  `--traceback` or the environment asks for it)."""
  exit_with(message, EXIT_INPUT_ERROR, show_traceback=traceback_requested(sys.argv))


def parse_flags(argv: Sequence[str]):
  """absl's flag parsing for `app.run(..., flags_parser=parse_flags)`: a bad flag ends in one
  `error:` paragraph and exit status 2, not absl's help text."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail_input(then(str(e).replace(" ?", "?"), "Pass --helpshort to list the flags."))
