"""The package's shape: no function longer than a screen (60 lines), so that each does
one thing a reader can hold at once."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "april_jax"
LONGEST = 60


def test_no_function_is_longer_than_60_lines():
  long = []
  for path in sorted(PACKAGE.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > LONGEST:
          long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
  assert not long, long
