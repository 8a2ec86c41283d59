"""The code's shape stays readable: no function over 60 lines outside the configs, no
module of the package over 600 lines."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 60, 600


def _python_files():
  for folder in ("april_jax", "tests", "launch"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      if "configs" not in path.relative_to(ROOT).parts:
        yield path


def test_no_function_is_over_60_lines_outside_the_configs():
  long = []
  for path in _python_files():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
          long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
  assert not long, "functions over 60 lines:\n" + "\n".join(long)


def test_no_module_of_the_package_is_over_600_lines():
  big = [
      f"{p.relative_to(ROOT)} ({n} lines)"
      for p in sorted((ROOT / "april_jax").rglob("*.py"))
      if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
  ]
  assert not big, "modules over 600 lines:\n" + "\n".join(big)
