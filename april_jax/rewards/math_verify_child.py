"""math-verify in a child process, so that a comparison which runs away can be killed.

    verdict(pred, gold, timeout_s) -> True | False | None   # None: past timeout_s

math-verify (sympy) can take hours on a short answer (`10^{10^{10}}` is a power it
computes in C, holding the interpreter lock), and its own timeouts use signal.alarm(),
which works only in a main thread. So each calling thread gets a child interpreter of its
own that answers comparisons one at a time; past `timeout_s` the child is killed (its
whole process group) and the next call starts a fresh one. A child dies with the thread
that started it (PR_SET_PDEATHSIG) and at the interpreter's exit, and cannot grow past
CHILD_MEMORY_MB. Its start (importing sympy, about a second) is not counted in a call's
bound: a child is started, and waited for, before its first comparison.

Run as `python -m april_jax.rewards.math_verify_child`, this module is the child: it
reads one JSON [tag, pred, gold] per line on stdin and writes [tag, true|false] per line
on stdout (a line that is not a reply, something a library printed, is skipped).
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

CHILD_MEMORY_MB = 2048  # RLIMIT_AS of a child
START_TIMEOUT_S = 120.0  # for a child to import math-verify and say it is ready
_READY = "ready"

_local = threading.local()
_children: "weakref.WeakSet[_Child]" = weakref.WeakSet()


class _Child:
  """One child interpreter and the pipe to it."""

  def __init__(self):
    # A file, not a pipe: a child that logs a lot must never block on a full pipe.
    self._stderr = tempfile.TemporaryFile()
    # `-m` from the folder that holds the package: the child's sys.path[0] is that folder,
    # never april_jax/rewards/ (whose math.py would shadow the standard library's).
    root = str(Path(__file__).resolve().parents[2])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    self.process = subprocess.Popen(
        [sys.executable, "-m", __name__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=self._stderr,
        cwd=root,
        env=env,
        start_new_session=True,  # its own process group: a kill takes all it started
    )
    self._buffer = b""
    self._asked = 0
    self._selector = selectors.DefaultSelector()  # poll/epoll: any fd number
    self._selector.register(self.process.stdout, selectors.EVENT_READ)
    _children.add(self)
    if self._reply(START_TIMEOUT_S, _READY) is None:
      self.kill()
      self._stderr.seek(0)
      lines = self._stderr.read()[-4000:].decode(errors="replace").strip().splitlines()
      why = lines[-1][:300] if lines else "it exited without a word"
      raise ImportError(f"math-verify could not start in a child process: {why}")

  def ask(self, pred: str, gold: str, timeout_s: float) -> bool | None:
    """The child's verdict on (pred, gold); None when it took longer than timeout_s or
    died meanwhile (it is killed then)."""
    self._asked += 1
    self.process.stdin.write((json.dumps([self._asked, pred, gold]) + "\n").encode())
    self.process.stdin.flush()
    return self._reply(timeout_s, self._asked)

  def _reply(self, timeout_s: float, tag):
    """The value of the child's next reply [tag, value]; lines that are not one (anything
    a library printed) are skipped. None past `timeout_s` or if the child died."""
    deadline = time.monotonic() + timeout_s
    while True:
      line = self._read_line(deadline)
      if line is None:
        return None
      try:
        got, value = json.loads(line)
      except (ValueError, TypeError):
        continue
      if got == tag:
        return value

  def _read_line(self, deadline: float) -> str | None:
    """The child's next line of output; None past `deadline` (the child is killed) or
    if it died."""
    fd = self.process.stdout.fileno()
    while b"\n" not in self._buffer:
      left = deadline - time.monotonic()
      if left <= 0 or not self._selector.select(left):
        self.kill()
        return None
      chunk = os.read(fd, 65536)
      if not chunk:  # the child died
        self.kill()
        return None
      self._buffer += chunk
    line, _, self._buffer = self._buffer.partition(b"\n")
    return line.decode(errors="replace")

  @property
  def alive(self) -> bool:
    return self.process.poll() is None

  def kill(self) -> None:
    """Kills the child's process group and reaps the child."""
    if self.process.poll() is None:
      try:
        os.killpg(self.process.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    self.process.wait()
    self._selector.close()
    for stream in (self.process.stdin, self.process.stdout):
      stream.close()

  def __del__(self):
    try:
      self.kill()
    except Exception:  # pylint: disable=broad-except  # at interpreter exit
      pass


def verdict(pred: str, gold: str, timeout_s: float) -> bool | None:
  """math-verify's verdict on `pred` against `gold` (both read as boxed LaTeX), from this
  thread's child; None when it took longer than `timeout_s` (the child is then killed).
  ImportError when math-verify cannot start."""
  for attempt in range(2):
    child = getattr(_local, "child", None)
    if child is None or not child.alive:
      child = _local.child = _Child()
    try:
      answer = child.ask(pred, gold, timeout_s)
    except (BrokenPipeError, ValueError):  # it died between two calls: once more, anew
      _local.child = None
      if attempt:
        raise
      continue
    if answer is None:
      _local.child = None
    return answer
  return None


@atexit.register
def _kill_all() -> None:
  for child in list(_children):
    child.kill()


# ------------------------------------------------------------------------------ the child
def _serve() -> None:
  """The child's loop: one verdict per line of input, until stdin closes."""
  import ctypes  # pylint: disable=g-import-not-at-top
  import resource  # pylint: disable=g-import-not-at-top

  try:  # die with the thread that started us
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass
  limit = CHILD_MEMORY_MB * 2**20
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  from math_verify import LatexExtractionConfig, parse, verify  # pylint: disable=g-import-not-at-top

  latex_only = [LatexExtractionConfig(boxed_match_priority=0)]

  def equal(pred: str, gold: str) -> bool:
    gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=latex_only)
    pred_parsed = parse("\\boxed{" + pred + "}", extraction_config=latex_only)
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed))

  equal("1", "1")  # loads the grammar before we say we are ready
  out = sys.stdout
  out.write(json.dumps([_READY, True]) + "\n")
  out.flush()
  for line in sys.stdin:
    tag, pred, gold = json.loads(line)
    try:
      answer = equal(pred, gold)
    except Exception:  # pylint: disable=broad-except  # MemoryError, a parse error: not equal
      answer = False
    out.write(json.dumps([tag, answer]) + "\n")
    out.flush()


if __name__ == "__main__":
  _serve()
