"""experiments/generate.py as a command: one `error:` paragraph and exit status 2 per bad argument,
and the text stops of its output rows."""
import importlib.util
import os
import subprocess
import sys

import pytest

from k3jax.data.tokenizer import ByteTokenizer
from k3jax.train import cli_errors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATE = os.path.join(ROOT, "experiments", "generate.py")
TINY = "--config=configs/tiny.py"
# An MQAR run (ids, no tokenizer) of a 2-layer, 8-wide model.
IDS_RUN = "--workdir=" + os.path.join(ROOT, "tests", "fixtures", "run_0eb97c0")


def _generate(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, GENERATE, *args], capture_output=True, text=True, env=env,
                        cwd=ROOT, timeout=300, check=False)


# Each case stops before any model is built (the length checks read only the config).
@pytest.mark.parametrize("args, message", [
    ((TINY, "--temperature=nan"), "--temperature=nan must be a finite number >= 0"),
    ((TINY, "--temperature=-1"), "--temperature=-1.0 must be a finite number >= 0"),
    ((TINY, "--top_k=0"), "--top_k=0 must be >= 1"),
    ((TINY, "--top_p=1.5"), "--top_p=1.5 must be in (0, 1]"),
    ((TINY, "--max_new_tokens=0"), "--max_new_tokens=0 must be >= 1"),
    ((TINY, "--num_samples=0"), "--num_samples=0 must be >= 1"),
    ((TINY, "--prompt_ids=1,x"), "--prompt_ids='1,x' is not comma-separated integers"),
    ((TINY, "--prompt_file=no/such/prompts.txt"), "--prompt_file='no/such/prompts.txt' cannot be read"),
    (("--prompt=x",), "give --workdir (a training run directory) or --config"),
    ((TINY, "--promt=x"), "Unknown command line flag 'promt'. Did you mean: prompt"),
    ((TINY, "--max_len=16", "--max_new_tokens=8", "--prompt=" + "x" * 9),
     "prompt 0 has 9 tokens; with --max_new_tokens=8 a row needs 17 positions, more than "
     "--max_len=16; the decoding caches of 1 row(s) of 17 positions would take"),
    ((TINY, "--max_new_tokens=100000000000"), "positions would take 93.1 TiB (attention KV caches "
     "93.1 TiB, KDA states 61.5 KiB), more than the"),
    ((IDS_RUN, "--prompt=x"), "this model's data are ids without a tokenizer (vocabulary 16)"),
], ids=lambda x: x.split(" ")[0] if isinstance(x, str) else None)
def test_a_bad_argument_is_one_error_paragraph(args, message):
  result = _generate(*args)
  assert result.returncode == cli_errors.EXIT_INPUT_ERROR, result.stderr
  assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
  assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr
  assert len(result.stderr.strip().splitlines()) <= 2
  assert "restored" not in result.stdout and "random model" not in result.stdout


def test_ragged_id_prompts_print_each_row():
  ok = _generate(IDS_RUN, "--prompt_ids=1,2,3", "--prompt_ids=4", "--max_new_tokens=3",
                 "--temperature=0", "--num_samples=2")
  assert ok.returncode == 0, ok.stderr
  lines = ok.stdout.splitlines()
  for prompt, ids in ((0, "1,2,3"), (1, "4")):
    for sample in (0, 1):
      at = lines.index(f"--- prompt {prompt}, sample {sample}")
      row = lines[at + 1].split(",")
      assert ",".join(row[:len(ids.split(","))]) == ids and len(row) == len(ids.split(",")) + 3
      assert lines[at + 2] == "--- length, 3 new tokens"


def _binary():
  spec = importlib.util.spec_from_file_location("generate_binary", GENERATE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def binary():
  return _binary()


@pytest.fixture(scope="module")
def row_class(binary):
  return binary._Row


def test_prompt_files_hold_one_prompt_a_line_or_jsonl(binary, tmp_path):
  text = tmp_path / "prompts.txt"
  text.write_text("def f(\n\nimport os\n", encoding="utf-8")
  assert binary._read_prompt_file(str(text)) == ["def f(", "import os"]
  jsonl = tmp_path / "prompts.jsonl"
  jsonl.write_text('"a\\nb"\n{"prompt": "c"}\n\n', encoding="utf-8")
  assert binary._read_prompt_file(str(jsonl)) == ["a\nb", "c"]
  jsonl.write_text('{"text": "c"}\n', encoding="utf-8")
  with pytest.raises(binary.UsageError, match=r"prompts.jsonl:1 must be a JSON string or an object"):
    binary._read_prompt_file(str(jsonl))
  jsonl.write_text("{oops\n", encoding="utf-8")
  with pytest.raises(binary.UsageError, match=r"prompts.jsonl:1 is not JSON"):
    binary._read_prompt_file(str(jsonl))
  text.write_text("\n\n", encoding="utf-8")
  with pytest.raises(binary.UsageError, match="holds no prompts"):
    binary._read_prompt_file(str(text))


def test_a_stop_string_across_tokens_is_found_and_never_printed(row_class):
  row = row_class(ByteTokenizer(), ["\n\n", "END"])
  shown = [row.add(list(chunk.encode())) for chunk in ("ab\nc", "d\n", "\nmore")]
  assert shown == ["ab", "\nc", "d"] and row.stopped  # "\n" held back until the next chunk
  assert row.flush() == "" and row.text == "ab\ncd"


def test_a_split_character_waits_for_its_last_byte(row_class):
  row = row_class(ByteTokenizer(), [])
  snowman = list("\u2603".encode())
  assert row.add([ord("a")] + snowman[:2]) == "a"
  assert row.add(snowman[2:]) == "\u2603"
  assert row.flush() == "" and not row.stopped


def test_the_run_tokenizer_is_the_copy_its_digest_names(tmp_path):
  from k3jax.data.tokenizer import train_bpe
  from k3jax.train.defaults import base_config
  from k3jax.train.restore import run_tokenizer
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("def main():\n    return 0\n" * 20, encoding="utf-8")
  tok = train_bpe([str(corpus)], vocab_size=270, out_path=str(tmp_path / "run" / "tokenizer.json"),
                  show_progress=False)
  config = base_config()
  assert run_tokenizer(config, str(tmp_path / "run")).kind == "bytes"  # data.kind="bytes"
  with config.unlocked():
    config.data.kind, config.data.tokenizer_sha256 = "prepared", tok.sha256
  found = run_tokenizer(config, str(tmp_path / "run"))
  assert found.sha256 == tok.sha256 and found.eos_id == tok.eos_id is not None
  with config.unlocked():
    config.data.tokenizer_sha256 = "0" * 64
  with pytest.raises(ValueError, match=r"none of its files \['tokenizer.json'\] is its tokenizer"):
    run_tokenizer(config, str(tmp_path / "run"))
  with config.unlocked():
    config.data.kind = "mqar"
  assert run_tokenizer(config, str(tmp_path / "run")) is None
