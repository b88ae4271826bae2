"""Trains a byte-level BPE tokenizer offline and writes its tokenizer.json.

  python experiments/train_tokenizer.py --out=runs/tok/tokenizer.json

reads this Python's standard-library sources (`*.py`, found at run time) and
writes a vocabulary of 8192 (`--vocab_size`) with the special tokens <pad>,
<bos>, <eos>. Your own text: `--input=DIR_OR_FILE` (repeatable; directories are
walked for `--patterns`, files are read as they are). The same inputs give the
same file, byte for byte; an existing `--out` is replaced atomically. Next:
`experiments/prepare_data.py --tokenizer=runs/tok/tokenizer.json`.

Exit status: 0 written, 2 a bad argument or input (one `error:` paragraph).
"""
import os
import sys

from absl import app
from absl import flags

# Run from a checkout without installing: the repository root holds the k3jax package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3jax.data.corpus import list_documents, stdlib_source_dir  # noqa: E402
from k3jax.data.tokenizer import train_bpe  # noqa: E402
from k3jax.train import cli_errors  # noqa: E402

_INPUT = flags.DEFINE_multi_string("input", None, "Text files or directories (default: the stdlib sources).")
_PATTERNS = flags.DEFINE_list("patterns", ["*.py"], "File-name globs kept when walking --input directories.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 8192, "Vocabulary size, special tokens included.")
_MIN_FREQUENCY = flags.DEFINE_integer("min_frequency", 2, "Fewest occurrences for a merge.", lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "Path of the tokenizer.json to write.")
flags.mark_flag_as_required("out")


def main(argv):
  if len(argv) > 1:
    cli_errors.fail_input(f"unexpected arguments {argv[1:]}: every setting is a flag, e.g. --input=DIR")
  inputs = _INPUT.value or [stdlib_source_dir()]
  try:
    files = [path for path, _ in list_documents(inputs, tuple(_PATTERNS.value))]
    if not files:
      raise ValueError(f"no files matching {_PATTERNS.value} under {inputs}; give other --input or --patterns")
    tok = train_bpe(files, vocab_size=_VOCAB_SIZE.value, out_path=_OUT.value,
                    min_frequency=_MIN_FREQUENCY.value)
  except ValueError as e:
    cli_errors.fail_input(str(e))
  print(f"wrote {_OUT.value}: {tok.vocab_size} tokens from {len(files)} files, bos {tok.bos_id}, "
        f"eos {tok.eos_id}, pad {tok.pad_id}, sha256 {tok.sha256}", flush=True)


if __name__ == "__main__":
  app.run(main, flags_parser=cli_errors.parse_flags)
