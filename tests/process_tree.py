"""The process tree as Linux's /proc shows it, for the tests that check which processes a
run or a pool leaves alive: a process's parent, its descendants, whether it still runs."""

import os
from pathlib import Path


def _stat(pid: int) -> list[str]:
  """/proc/<pid>/stat's fields after the command name: state, parent, ..."""
  return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def parent(pid: int) -> int:
  return int(_stat(pid)[1])


def descendants(pid: int) -> set[int]:
  children: dict[int, list[int]] = {}
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        children.setdefault(parent(int(name)), []).append(int(name))
      except OSError:  # it ended meanwhile
        continue
  out, todo = set(), [pid]
  while todo:
    for child in children.get(todo.pop(), []):
      out.add(child)
      todo.append(child)
  return out


def alive(pid: int) -> bool:
  try:
    state = _stat(pid)[0]
  except OSError:
    return False
  return state != "Z"  # a zombie has ended; only its exit status is left
