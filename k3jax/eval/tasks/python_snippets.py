"""The bundled lm-eval tasks' data: short Python functions in the standard library's style.

`python k3jax/eval/tasks/python_snippets.py` writes `python_snippets.jsonl` (the same file
every time): per snippet its `text` (the rolling task, bits per byte) and a multiple
choice (the next-line task): the snippet but its last line as `context`, that line and
the last lines of three other snippets as `choices`, `gold` the right one's index.

`load` is the tasks' `custom_dataset`: it reads the YAML's `dataset_kwargs.data_files`
beside this file, wherever lm-eval runs from, and never touches the network.
"""
import json
import os
import random

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))
DATA_FILE = os.path.join(HERE, "python_snippets.jsonl")
NUM_CHOICES = 4

SNIPPETS = [
    "def is_even(n):\n    return n % 2 == 0\n",
    "def clamp(value, low, high):\n    if value < low:\n        return low\n    if value > high:\n"
    "        return high\n    return value\n",
    "def read_lines(path):\n    with open(path, encoding='utf-8') as f:\n"
    "        return f.read().splitlines()\n",
    "def mean(values):\n    values = list(values)\n    if not values:\n"
    "        raise ValueError('mean of an empty sequence')\n    return sum(values) / len(values)\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
    "        self.count += 1\n",
    "def first(iterable, default=None):\n    for item in iterable:\n        return item\n"
    "    return default\n",
    "def flatten(lists):\n    out = []\n    for items in lists:\n        out.extend(items)\n"
    "    return out\n",
    "def chunks(seq, size):\n    for start in range(0, len(seq), size):\n"
    "        yield seq[start:start + size]\n",
    "import os\n\n\ndef ensure_dir(path):\n    if not os.path.isdir(path):\n"
    "        os.makedirs(path)\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "def reverse_words(sentence):\n    return ' '.join(reversed(sentence.split()))\n",
    "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n"
    "    return result\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "def unique(items):\n    seen = set()\n    out = []\n    for item in items:\n"
    "        if item not in seen:\n            seen.add(item)\n            out.append(item)\n"
    "    return out\n",
    "def strip_comments(line):\n    index = line.find('#')\n    if index >= 0:\n"
    "        line = line[:index]\n    return line.rstrip()\n",
    "import json\n\n\ndef load_json(path):\n    with open(path) as f:\n        return json.load(f)\n",
    "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
    "def is_palindrome(text):\n    text = text.lower()\n    return text == text[::-1]\n",
    "def merge_dicts(*dicts):\n    merged = {}\n    for d in dicts:\n        merged.update(d)\n"
    "    return merged\n",
    "def transpose(matrix):\n    return [list(row) for row in zip(*matrix)]\n",
    "class Stack:\n    def __init__(self):\n        self._items = []\n\n    def push(self, item):\n"
    "        self._items.append(item)\n\n    def pop(self):\n        return self._items.pop()\n",
    "def parse_int(text, default=0):\n    try:\n        return int(text)\n    except ValueError:\n"
    "        return default\n",
    "def max_index(values):\n    best = 0\n    for i, value in enumerate(values):\n"
    "        if value > values[best]:\n            best = i\n    return best\n",
    "def join_path(*parts):\n    return '/'.join(part.strip('/') for part in parts)\n",
    "def word_lengths(words):\n    return {word: len(word) for word in words}\n",
    "def sign(x):\n    if x > 0:\n        return 1\n    if x < 0:\n        return -1\n    return 0\n",
    "import sys\n\n\ndef warn(message):\n    print(message, file=sys.stderr)\n",
    "def pairwise(items):\n    for a, b in zip(items, items[1:]):\n        yield a, b\n",
    "def capitalize_all(words):\n    return [word.capitalize() for word in words]\n",
    "def binary_search(items, target):\n    low, high = 0, len(items) - 1\n    while low <= high:\n"
    "        mid = (low + high) // 2\n        if items[mid] == target:\n            return mid\n"
    "        if items[mid] < target:\n            low = mid + 1\n        else:\n"
    "            high = mid - 1\n    return -1\n",
]


def _last_line(snippet: str) -> str:
  return snippet.rstrip("\n").rsplit("\n", 1)[1] + "\n"


def examples(seed: int = 0) -> list[dict]:
  """One record per snippet: id, text, context, choices, gold."""
  rng = random.Random(seed)
  lasts = [_last_line(s) for s in SNIPPETS]
  out = []
  for i, snippet in enumerate(SNIPPETS):
    wrong = [line for line in dict.fromkeys(lasts) if line != lasts[i]]
    choices = rng.sample(wrong, NUM_CHOICES - 1)
    gold = rng.randrange(NUM_CHOICES)
    choices.insert(gold, lasts[i])
    out.append({"id": i, "text": snippet, "context": snippet[:len(snippet) - len(lasts[i])],
                "choices": choices, "gold": gold})
  return out


def load(data_files: dict[str, str], **kwargs) -> datasets.DatasetDict:
  """The splits of `data_files` (paths relative to this directory) read from local JSONL."""
  del kwargs  # lm-eval passes the task's metadata too
  files = {split: os.path.join(HERE, path) for split, path in data_files.items()}
  return datasets.load_dataset("json", data_files=files)


if __name__ == "__main__":
  with open(DATA_FILE, "w", encoding="utf-8") as f:
    for record in examples():
      f.write(json.dumps(record) + "\n")
  print(f"wrote {len(SNIPPETS)} examples to {DATA_FILE}")
