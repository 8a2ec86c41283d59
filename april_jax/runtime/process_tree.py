"""The processes a run started, found from /proc and ended, whatever session they moved to.

A run starts processes (worker pools for user code, the reward's math-verify children,
the Python tool's sandboxes) and user code starts more: a `step` that forks, a child that
calls setsid and leaves its parent. `adopt_orphans()` makes this process the child
subreaper of all of them (PR_SET_CHILD_SUBREAPER): a process whose parent ends is handed
to the run, not to the machine's init, so the run can still find it. `end_descendants()`
then kills every descendant with SIGKILL (which no signal mask or handler stops) until
none is left, and reaps them. main.py does both: at start-up, and at every exit (a
finished or stopped run, an error, Ctrl-C).

Only this module's functions read /proc; on a system without it they find nothing.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36
END_ROUNDS = 20  # kill-and-look rounds: a process may fork while its siblings die


def adopt_orphans() -> bool:
  """Makes this process the subreaper of its descendants (Linux); whether it could."""
  if not sys.platform.startswith("linux"):
    return False
  try:
    import ctypes  # pylint: disable=g-import-not-at-top

    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
  except (OSError, AttributeError):
    return False


def _parents() -> dict[int, int]:
  """pid -> parent pid, for every process /proc shows."""
  parents = {}
  try:
    names = os.listdir("/proc")
  except OSError:
    return parents
  for name in names:
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat", "rb") as f:
        stat = f.read()
    except OSError:  # it ended meanwhile
      continue
    # pid (comm) state ppid ...: comm may hold spaces and parentheses; it ends at the last ')'
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) > 1:
      parents[int(name)] = int(fields[1])
  return parents


def children(pid: int) -> list[int]:
  """The processes whose parent is `pid`."""
  return [child for child, parent in _parents().items() if parent == pid]


def descendants(pid: int | None = None) -> list[int]:
  """Every process below `pid` (this process by default), parents before children."""
  root = os.getpid() if pid is None else pid
  by_parent: dict[int, list[int]] = {}
  for child, parent in _parents().items():
    by_parent.setdefault(parent, []).append(child)
  found, frontier = [], [root]
  while frontier:
    below = [c for p in frontier for c in by_parent.get(p, ()) if c not in found]
    found += below
    frontier = below
  return found


def _reap() -> None:
  """Collects the exit status of every child that has ended (zombies)."""
  while True:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    except OSError:
      return
    if pid == 0:
      return


def end_descendants() -> int:
  """Kills every descendant of this process with SIGKILL, until none is left, and reaps
  its own children; how many it killed. Quick and lock-free: Ctrl-C's handler calls it."""
  killed, me = set(), os.getpid()
  for _ in range(END_ROUNDS):
    alive = [pid for pid in descendants(me) if pid not in killed or _running(pid)]
    if not alive:
      break
    for pid in alive:
      try:
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
      except (ProcessLookupError, PermissionError):
        pass
    _reap()
  _reap()
  return len(killed)


def _running(pid: int) -> bool:
  """Whether `pid` is alive and not a zombie."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      stat = f.read()
  except OSError:
    return False
  state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
  return state not in (b"Z", b"X")
