"""The whole tree is formatted as pyproject.toml's [tool.pyink] says: one formatter, checked
with the tests (fix with `pyink .`)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_is_formatted_by_pyink():
  pytest.importorskip("pyink")
  proc = subprocess.run(
      [sys.executable, "-m", "pyink", "--check", "--diff", "."],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=False,
  )
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
