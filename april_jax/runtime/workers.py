"""Worker processes for user code: every call has a time limit, and a call past it has its
process killed and replaced, whatever the code holds.

Rewards and user environments run here, not in the trainer: Python code that holds the
interpreter lock (`10**(10**10)`, a C extension that never returns) cannot be stopped in
a thread; it would stall the run and outlive it. A process can be killed.

  pool = WorkerPool(make, num=4, preload=("my_module",))
  value, seconds = pool.call(job, timeout_s=10.0)
    CallTimeout       past the limit (its worker is killed and replaced)
    UserCodeError     the code raised; the message names the user's file and line
    WorkerDied        the worker died (`os._exit`, a segfault); it is replaced
    PoolClosed        the pool was closed while the call waited
  pool.close()

`make` must be picklable (a module-level function, or a functools.partial of one); each
worker calls `make()` once and serves every call with what it returns, `fn(job)`. Calls
from several threads run at once, one per worker. Workers are forked from a forkserver
(the trainer holds threads and an accelerator runtime that a fork would copy), one for
every pool of the process, which imports the first pool's `preload` once, so a
replacement starts at once. A worker's start-up (imports,
`make()`) is not counted in its first call's time limit.

What a worker prints goes through the run's relay when it has one (user_output.py).

No worker outlives the run: `close` kills them, Ctrl-C kills them (`interrupt.on_leave`),
and if the run is killed outright, on Linux the kernel kills the forkserver
(forkserver_guard.py) and each worker when its forkserver goes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import sys
import threading
import time
import types
from typing import Any, Callable

from april_jax import errors
from april_jax.runtime import interrupt
from april_jax.runtime import user_output

START_TIMEOUT_S = 120.0  # a worker that does not start in this long has died
_START_AGAIN = object()  # in the idle queue: a worker whose start failed, to start again
# Worker starts hide the main module (_main_hidden), one at a time across every pool.
_START_LOCK = threading.Lock()


class CallTimeout(Exception):
  """A call ran past its time limit; its worker was killed."""


class UserCodeError(Exception):
  """The user's code raised; the message is errors.describe's line."""


class WorkerDied(Exception):
  """A worker process died during a call (the code ended its process, or crashed)."""


class PoolClosed(Exception):
  """The pool was closed before or during the call."""


def die_with_parent() -> None:
  """Linux: the kernel kills this process when its parent ends (a worker's parent is the
  forkserver, the forkserver's the run: forkserver_guard.py)."""
  if not sys.platform.startswith("linux"):
    return
  try:
    import ctypes  # pylint: disable=g-import-not-at-top

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    return
  if os.getppid() == 1:  # the parent went before the call above: leave now
    os._exit(0)  # pylint: disable=protected-access


def _print_into(output) -> None:
  """The worker's stdout and stderr become `output` (a pipe to the run's relay)."""
  if output is None:
    return
  for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
    os.dup2(output.fileno(), fd)
  output.close()


def _serve(conn, make: Callable[[], Callable[[Any], Any]], output=None) -> None:
  """A worker: builds its function once, then answers jobs until its pipe closes. It
  ignores Ctrl-C and SIGTERM sent to the whole process group: the run answers them, and
  ends its workers itself. What it prints goes to `output` when given (user_output.py)."""
  interrupt.ignore_in_child()
  die_with_parent()
  _print_into(output)
  me = os.getpid()
  try:
    fn, broken = make(), None
  except BaseException as e:  # pylint: disable=broad-except
    fn, broken = None, errors.describe(e)
  try:
    conn.send("ready")  # its start-up (imports, make) is not a call's time
  except (EOFError, OSError):
    return
  while True:
    try:
      job = conn.recv()
    except (EOFError, OSError):
      return
    if job is None:
      return
    start = time.monotonic()
    if fn is None:
      out = (False, broken)
    else:
      try:
        out = (True, fn(job))
      except BaseException as e:  # pylint: disable=broad-except
        out = (False, errors.describe(e))
    if os.getpid() != me:  # a child the code forked, come back here: it never answers
      os._exit(0)  # pylint: disable=protected-access
    seconds = time.monotonic() - start
    try:
      conn.send(out + (seconds,))
    except (EOFError, OSError):
      return
    except Exception as e:  # pylint: disable=broad-except  # the result cannot be pickled
      conn.send((False, f"its result cannot be sent back: {errors.describe(e)}", seconds))


@contextlib.contextmanager
def _main_hidden(needs_main: bool):
  """multiprocessing has a new worker run the program's main module again (for
  `python -m april_jax.main`: jax, the trainer, every import; seconds a worker, each time
  one is replaced) unless the main module is hidden while it starts. Only where `make`
  comes from an importable module; under the pool's lock, for the moment of a start."""
  if needs_main:
    yield
    return
  main = sys.modules.get("__main__")
  sys.modules["__main__"] = types.ModuleType("__main__")
  try:
    yield
  finally:
    sys.modules["__main__"] = main


def _how_it_ended(process) -> str:
  code = process.exitcode
  if code is None:
    return "still running"
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exit status {code}"


class WorkerPool:
  """`num` worker processes serving `make()`'s function; see the module docstring."""

  def __init__(self, make: Callable, num: int, preload: tuple[str, ...] = (), name: str = "worker"):
    self._ctx = multiprocessing.get_context("forkserver")
    self._ctx.set_forkserver_preload(["april_jax.runtime.forkserver_guard", __name__, *preload])
    self._make, self.name = make, name
    self._needs_main = b"__main__" in pickle.dumps(make)
    self._lock = threading.Lock()
    self._idle: queue.Queue = queue.Queue()
    self._all: list[multiprocessing.Process] = []
    self._closed = False
    interrupt.on_leave(self._kill_all)
    for _ in range(num):
      self._start_one()

  def _start_one(self) -> None:
    """Starts a worker and makes it idle; after close(), wakes a waiting thread instead. A
    start that fails leaves a token in its place: the next call tries again."""
    with self._lock:
      if self._closed:
        self._idle.put(None)
        return
      try:
        parent, child = self._ctx.Pipe()
        output = user_output.writer(self.name)
        if output is not None:  # a copy the start hands to the worker, then closes
          output = multiprocessing.connection.Connection(os.dup(output), readable=False)
        process = self._ctx.Process(target=_serve, args=(child, self._make, output), daemon=True)
        with _START_LOCK, _main_hidden(self._needs_main):
          process.start()
        child.close()
        if output is not None:
          output.close()
      except Exception:  # pylint: disable=broad-except  # the forkserver gone, no fds left
        self._idle.put(_START_AGAIN)
        raise
      self._all = [p for p in self._all if p.is_alive()] + [process]
    self._idle.put((process, parent))

  def _idle_worker(self):
    """The next idle worker (process, pipe), starting one where a start failed before."""
    while True:
      worker = self._idle.get()
      if worker is None:
        self._idle.put(None)
        raise PoolClosed()
      if worker is not _START_AGAIN:
        return worker
      self._start_one()

  def call(self, job: Any, timeout_s: float | None = None) -> tuple[Any, float]:
    """(fn(job), seconds it took) from an idle worker; see the module docstring."""
    process, conn = self._idle_worker()
    answered, reply, why = True, None, None
    try:
      if not getattr(conn, "ready", False):  # a new worker's start-up, outside the limit
        if not conn.poll(START_TIMEOUT_S):
          why = f"did not start within {START_TIMEOUT_S:g} s"
          raise EOFError
        if conn.recv() != "ready":
          raise EOFError
        conn.ready = True
      conn.send(job)
      answered = conn.poll(timeout_s)
      reply = conn.recv() if answered else None
    except (EOFError, OSError):
      reply = None
    except Exception as e:  # pylint: disable=broad-except  # a reply this process cannot read
      self._idle.put((process, conn))  # the worker is fine: the whole reply was read
      raise UserCodeError(
          f"its result cannot be read in the trainer ({errors.describe(e)}); return plain "
          "data (numbers, strings, lists, dicts)"
      ) from None
    if reply is None:  # past its limit, or dead
      process.kill()
      process.join(timeout=5)
      conn.close()
      self._start_one()
      if self._closed:
        raise PoolClosed()
      if not answered:
        raise CallTimeout(f"ran past its time limit of {timeout_s:g} s")
      why = why or _how_it_ended(process)
      raise WorkerDied(f"the {self.name} process died ({why})")
    self._idle.put((process, conn))
    ok, value, seconds = reply
    if not ok:
      raise UserCodeError(value)
    return value, seconds

  def pids(self) -> list[int]:
    """The live workers' process ids."""
    return [p.pid for p in list(self._all) if p.is_alive()]

  def _kill_all(self) -> None:
    """Kills every worker at once (no lock: this runs from a signal handler too)."""
    self._closed = True
    for process in list(self._all):
      try:
        os.kill(process.pid, signal.SIGKILL)
      except (OSError, TypeError):
        pass

  def close(self) -> None:
    """Kills every worker; calls waiting for one raise PoolClosed."""
    with self._lock:
      self._closed = True
      processes = list(self._all)
    self._idle.put(None)
    for process in processes:
      if process.is_alive():
        process.kill()
    for process in processes:
      process.join(timeout=5)
    interrupt.forget(self._kill_all)
