"""lm-eval on a trained run (`k3jax.eval.harness`, `experiments/evaluate.py`), offline.

One tiny byte-level run is trained for one step (configs/tiny.py shrunk as in
test_train_cli); the bundled tasks run on it through the command, and the adapter's
answers are checked against the scoring API.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.test_train_cli import ROOT, SHRUNK, _env, _train

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from k3jax.data.tokenizer import ByteTokenizer  # noqa: E402
from k3jax.eval import harness  # noqa: E402
from k3jax.eval.run import run_tokenizer  # noqa: E402
from k3jax.models import score  # noqa: E402
from tests.test_tokenizer import tiny_bpe  # noqa: E402

EVALUATE = os.path.join(ROOT, "experiments", "evaluate.py")
TASKS = "k3jax_python_next_line,k3jax_python_snippets"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("eval") / "run"
  result = _train(workdir, "--config.num_steps=1", *SHRUNK)
  assert result.returncode == 0, result.stderr[-3000:]
  return str(workdir)


def _offline_env(tmp_dir):
  return _env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_dir / "hf"))


def test_command_writes_the_summary_of_the_bundled_tasks(run_dir, tmp_path):
  result = subprocess.run([sys.executable, EVALUATE, f"--workdir={run_dir}", f"--tasks={TASKS}",
                           "--limit=8"], capture_output=True, text=True, cwd=tmp_path,
                          env=_offline_env(tmp_path), timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  path = os.path.join(run_dir, "eval", f"{TASKS.replace(',', '+')}-step1.json")
  with open(path, encoding="utf-8") as f:
    summary = json.load(f)
  assert summary["step"] == 1 and summary["n-samples"]["k3jax_python_next_line"]["effective"] == 8
  assert 0.0 <= summary["results"]["k3jax_python_next_line"]["acc,none"] <= 1.0
  assert summary["results"]["k3jax_python_snippets"]["bits_per_byte,none"] > 0.0
  assert "k3jax_python_next_line" in result.stdout and "bits_per_byte" in result.stdout


def test_a_bad_flag_is_one_error_paragraph(run_dir, tmp_path):
  # (An unknown task is refused the same way, after lm-eval indexes its own tasks: 30 s.)
  result = subprocess.run([sys.executable, EVALUATE, f"--workdir={run_dir}", f"--tasks={TASKS}",
                           "--limit=0"], capture_output=True, text=True, env=_offline_env(tmp_path),
                          timeout=300)
  assert result.returncode == 2
  assert "Traceback" not in result.stderr and result.stderr.count("error:") == 1
  assert "--limit=0 must be >= 1" in result.stderr


def test_adapter_answers_are_the_scoring_api(run_dir):
  lm = harness.HarnessLM.from_run(run_dir)
  tok = lm.tokenizer
  # lm-eval moves a context's trailing white space into the continuation: none here.
  pairs = [("def f(x):", "\n    return x\n"), ("import os", "\nimport sys\n"), ("", "pass\n")]
  got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
  prefix = harness.prefix_id(tok)
  assert prefix == 10  # bytes: no eos or bos, a newline
  ids = [(tok.encode(c).tolist() or [prefix], tok.encode(x).tolist()) for c, x in pairs]
  assert got == score.continuation_logprobs(lm.model, ids, seq_len=lm.seq_len)

  texts = ["x = 1\n" * 20, "y\n"]  # the first longer than a row of 32
  rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), 0) for t in texts])
  np.testing.assert_array_equal(rolling, score.rolling_logprobs(
      lm.model, [tok.encode(t) for t in texts], seq_len=lm.seq_len, prefix_id=prefix))

  # Prompts of one length and one max_gen_toks: one program for today's generate too.
  requests = [("def f", {"until": ["\n"], "max_gen_toks": 6}),
              ("class", {"until": "(", "max_gen_toks": 6}), ("x = 1", {"max_gen_toks": 6})]
  texts = lm.generate_until([Instance("generate_until", {}, r, i) for i, r in enumerate(requests)])
  assert "\n" not in texts[0] and "(" not in texts[1]
  assert len(texts[2].encode()) <= 6 * 3  # U+FFFD (3 bytes) stands for a byte cut from its character
  # Greedy generation is what scoring calls greedy.
  if texts[0].isascii() and texts[0]:
    (_, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, ("def f", texts[0]), 0)])
    assert greedy


def test_cut_at_stop():
  assert harness.cut_at_stop("ab\ncd;e", ["\n", ";"]) == "ab"
  assert harness.cut_at_stop("abc", ["x", ""]) == "abc"


def test_a_run_reads_text_through_the_tokenizer_its_config_names(tmp_path):
  bpe = tiny_bpe(str(tmp_path))  # tokenizer.json beside config.json, as the trainer copies it
  (tmp_path / "config.json").write_text("{}")
  assert run_tokenizer(str(tmp_path), bpe.sha256).path == bpe.path
  assert isinstance(run_tokenizer(str(tmp_path), ByteTokenizer().sha256), ByteTokenizer)
  for digest, needle in (("", "has no tokenizer"), ("0" * 64, "no tokenizer file")):
    with pytest.raises(ValueError, match=needle):
      run_tokenizer(str(tmp_path), digest)
  # Bits per byte count the bytes of the scored tokens: all but the first token's without a prefix.
  text = "def main():\n    return 0\n"
  ids = bpe.encode(text)
  assert score.scored_bytes(text, ids, bpe, prefix_id=2) == len(text.encode())
  assert score.scored_bytes(text, ids, bpe, None) == len(bpe.decode(ids[1:]).encode())
