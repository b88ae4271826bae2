"""No block of six or more lines stands twice in `k3jax/` or `pallas_kernels/` (issue 37).

The rule: each .py file is read as lines with white space folded; blank
lines, comment-only lines, import lines and lines of lone punctuation
(brackets, commas, colons) are passed over. A repeat is a window of
`MIN_LINES` consecutive remaining lines that stands, line for line, in two
places (in one file or in two). Only the same lines count: code alike in
shape but with other names is a judgement, not a failure.

`python tests/test_no_repeats.py` prints every repeated block.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREES = ("k3jax", "pallas_kernels")
MIN_LINES = 6
_SKIP = re.compile(r"^(#.*|import .*|from \S+ import .*|[()\[\]{},:]*)$")


def _code_lines(path: str) -> list[tuple[int, str]]:
  """(line number, folded text) of the lines that count."""
  out = []
  for number, line in enumerate(open(path, encoding="utf-8"), 1):
    text = " ".join(line.split())
    if text and not _SKIP.match(text):
      out.append((number, text))
  return out


def repeated_blocks() -> list[tuple[str, str]]:
  """('file:first-last', 'file:first-last') for each maximal repeated block, first place first."""
  seen: dict[tuple[str, ...], tuple[str, int, int]] = {}
  pairs: dict[tuple[str, str], list[int]] = {}
  for top in TREES:
    for dirpath, _, names in sorted(os.walk(os.path.join(ROOT, top))):
      for name in sorted(names):
        if not name.endswith(".py"):
          continue
        path = os.path.join(dirpath, name)
        rel = os.path.relpath(path, ROOT)
        lines = _code_lines(path)
        for i in range(len(lines) - MIN_LINES + 1):
          window = tuple(text for _, text in lines[i:i + MIN_LINES])
          here = (rel, lines[i][0], lines[i + MIN_LINES - 1][0])
          first = seen.setdefault(window, here)
          if first is not here:
            pairs.setdefault((first[0], rel), []).append((first[1], first[2], here[1], here[2]))
  blocks = []
  for (a, b), spans in sorted(pairs.items()):
    # Overlapping windows of one repeat join into one block.
    spans.sort()
    start = spans[0]
    end = spans[0]
    for span in spans[1:] + [None]:
      if span is not None and span[0] <= end[1] and span[2] <= end[3]:
        end = span
        continue
      blocks.append((f"{a}:{start[0]}-{end[1]}", f"{b}:{start[2]}-{end[3]}"))
      start = end = span
  return blocks


def test_no_block_of_six_lines_stands_twice():
  blocks = repeated_blocks()
  assert blocks == [], "\n".join(f"{a} ~ {b}" for a, b in blocks)


if __name__ == "__main__":
  found = repeated_blocks()
  for a, b in found:
    print(f"{a} ~ {b}")
  print(f"{len(found)} repeated blocks of {MIN_LINES}+ lines in {', '.join(TREES)}")
  sys.exit(0)
