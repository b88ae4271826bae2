"""Tokenizes documents once into a prepared-data directory for the trainer.

The stdlib sources with a trained BPE (`--input` defaults to this Python's
standard-library source tree, `*.py`):

  python experiments/train_tokenizer.py --out=runs/tok/tokenizer.json
  python experiments/prepare_data.py --input=<dir> --tokenizer=runs/tok/tokenizer.json \
      --out=runs/data/stdlib_bpe

Your own text: text files (`--input=DIR --patterns='*.txt,*.md'`, one document
per file), JSONL (`--input=corpus.jsonl --jsonl_field=text`, one per line) or
parquet (`--input=DIR --parquet_column=text`, one per row; needs pyarrow).
`--tokenizer` is "bytes" (the default), a HF tokenizer.json or a sentencepiece
.model. The trainer reads the result with `--config.data.kind=prepared
--config.data.path=runs/data/stdlib_bpe`.

Output (`k3jax/data/prepare.py`): `train-*-of-*.array_record` and
`heldout-*-of-*.array_record` (one record per document), the tokenizer file and
manifest.json. Documents are held out by a stable hash of their path (plus the
line or row), so the same inputs and options give byte-identical files. The run
writes `<out>.partial-<pid>` and renames it to `<out>` when done: a killed run
leaves nothing that the reader accepts; run the same command again.

Exit status: 0 written, 2 a bad argument or input (one `error:` paragraph).
"""
import os
import sys

from absl import app
from absl import flags

# Run from a checkout without installing: the repository root holds the k3jax package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3jax.data.corpus import stdlib_source_dir  # noqa: E402
from k3jax.data.prepare import PrepareOptions, prepare  # noqa: E402
from k3jax.data.tokenizer import load_tokenizer  # noqa: E402
from k3jax.train import cli_errors  # noqa: E402

_INPUT = flags.DEFINE_multi_string("input", None, "Files or directories to read (default: the stdlib sources).")
_PATTERNS = flags.DEFINE_list("patterns", None, "File-name globs kept when walking directories "
                              "(default: *.py for text, *.jsonl, *.parquet).")
_JSONL_FIELD = flags.DEFINE_string("jsonl_field", None, "Read JSONL, one document per line, from this field.")
_PARQUET_COLUMN = flags.DEFINE_string("parquet_column", None, "Read parquet, one document per row, from this column.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", "'bytes', a tokenizer.json or a sentencepiece .model.")
_OUT = flags.DEFINE_string("out", None, "The prepared-data directory to create.")
_HELDOUT = flags.DEFINE_float("heldout_fraction", 0.05, "Share of documents held out, in (0, 1).")
_SHARDS = flags.DEFINE_integer("shards", 1, "array_record files per split.", lower_bound=1)
_ADD_EOS = flags.DEFINE_bool("add_eos", None, "Append eos to every document (default: when the tokenizer has one).")
_WORKERS = flags.DEFINE_integer("workers", None, "Encoding processes (default: os.cpu_count()).", lower_bound=1)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --out.")
flags.mark_flag_as_required("out")


def main(argv):
  if len(argv) > 1:
    cli_errors.fail_input(f"unexpected arguments {argv[1:]}: every setting is a flag, e.g. --input=DIR")
  options = PrepareOptions(patterns=tuple(_PATTERNS.value or ()), jsonl_field=_JSONL_FIELD.value,
                           parquet_column=_PARQUET_COLUMN.value, heldout_fraction=_HELDOUT.value,
                           shards=_SHARDS.value, add_eos=_ADD_EOS.value)
  try:
    manifest = prepare(_INPUT.value or [stdlib_source_dir()], load_tokenizer(_TOKENIZER.value), _OUT.value,
                       options, workers=_WORKERS.value, overwrite=_OVERWRITE.value)
  except ValueError as e:
    cli_errors.fail_input(str(e))
  splits = ", ".join(f"{s} {v['documents']} documents / {v['tokens']} tokens"
                     for s, v in manifest["splits"].items())
  print(f"wrote {_OUT.value}: {splits}; vocab {manifest['tokenizer']['vocab_size']}, "
        f"{manifest['token_dtype']}, {manifest['empty_documents']} empty documents skipped", flush=True)


if __name__ == "__main__":
  app.run(main, flags_parser=cli_errors.parse_flags)
