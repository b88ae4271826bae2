"""The trainer on prepared BPE documents end to end, and the data errors it raises before any compute."""
import json
import os

import numpy as np
import pytest

from k3jax.data.prepare import PrepareOptions, prepare
from k3jax.data.tokenizer import train_bpe
from k3jax.train.config_schema import ConfigError
from k3jax.train.metrics import read_jsonl
from k3jax.train.trainer import train_and_evaluate
from tests.config_helpers import set_dotted
from tests.test_tokenizer import tiny_bpe, write_corpus
from tests.test_train import _shrunk_tiny


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """(prepared directory, its tokenizer): 40 small documents through a 300-token BPE."""
  tmp = tmp_path_factory.mktemp("prepared")
  tokenizer = tiny_bpe(str(tmp))
  docs = write_corpus(str(tmp / "docs"), n=40)
  out = str(tmp / "data")
  prepare(docs, tokenizer, out, PrepareOptions(heldout_fraction=0.2), workers=1, show_progress=False)
  return out, tokenizer


def _config(path, **overrides):
  return _shrunk_tiny(**{"data.kind": "prepared", "data.path": path, "model.vocab_size": 320,
                         "num_steps": 3, "checkpoint_every": 0, "eval_every": 0, **overrides})


def test_trainer_on_prepared_bpe_documents(tmp_path, prepared):
  path, tokenizer = prepared
  result = train_and_evaluate(_config(path), str(tmp_path))
  assert result["step"] == 3 and np.isfinite(result["eval"]["loss"])
  assert "perplexity" in result["eval"]
  # The run keeps its tokenizer and the tokenizer's digest, so generation and a resume use the same.
  assert (tmp_path / "tokenizer.json").read_bytes() == open(os.path.join(path, "tokenizer.json"), "rb").read()
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["data"]["tokenizer_sha256"] == tokenizer.sha256
  train = read_jsonl(str(tmp_path / "metrics.jsonl"), "train")
  assert train[-1]["segments/overflow_rows"] == 0.0
  # Resuming with the same data is allowed (the digest matches the saved one).
  again = train_and_evaluate(set_dotted(_config(path), {"num_steps": 4}), str(tmp_path))
  assert again["step"] == 4 and again["resumed_from"] == 3


@pytest.mark.parametrize("overrides, needles", [
    ({"model.vocab_size": 256}, ["model.vocab_size=256", "tokenizer vocabulary 300",
                                 "--config.model.vocab_size=300"]),
    ({"data.tokenizer": "/no/such/tokenizer.json"}, ["does not exist", "leave data.tokenizer empty"]),
    ({"data.tokenizer_sha256": "0" * 64}, ["tokenizer_sha256", "leave it empty"]),
])
def test_data_errors_before_any_compute(tmp_path, prepared, overrides, needles):
  path, _ = prepared
  with pytest.raises(ConfigError) as e:
    train_and_evaluate(_config(path, **overrides), str(tmp_path / "run"))
  for needle in needles:
    assert needle in str(e.value)
  assert not (tmp_path / "run").exists()


def test_a_tokenizer_other_than_the_datas_is_refused(tmp_path, prepared):
  path, _ = prepared
  text = tmp_path / "other.txt"
  text.write_text("completely different words " * 50, encoding="utf-8")
  tok = train_bpe([str(text)], vocab_size=280, out_path=str(tmp_path / "other.json"), show_progress=False)
  with pytest.raises(ConfigError, match="is not the tokenizer"):
    train_and_evaluate(_config(path, **{"data.tokenizer": str(tmp_path / "other.json")}),
                       str(tmp_path / "run"))
  assert tok.sha256 and not (tmp_path / "run").exists()


def test_an_empty_split_is_refused(tmp_path):
  (tmp_path / "corpus").mkdir()
  (tmp_path / "corpus" / "only.py").write_text("x = 1\n" * 100)
  c = _shrunk_tiny(**{"data.paths": (str(tmp_path / "corpus"),), "data.max_bytes": 0})
  with pytest.raises(ConfigError, match="split of the corpus .* is empty"):
    train_and_evaluate(c, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
