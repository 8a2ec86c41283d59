"""Ctrl-C ends a run at once, with one line on stderr and exit status 130.

A KeyboardInterrupt raised into JAX while it compiles, or into Python's shutdown while
XLA's threads still run, gives tracebacks and can crash the runtime. So SIGINT never
raises: the handler prints one line and leaves with `os._exit(130)`, which runs no
destructors. A watcher thread reads the signal from `signal.set_wakeup_fd`, so this
happens even while the main thread is inside a long XLA call (a compile, a decode), where
a Python-level handler would wait for the call to return. Before it leaves, it kills the
worker processes the run started for user code (workers.py registers them with
`on_leave`); their forkserver leaves by itself once the run is gone.

`install` also makes the command the subreaper of every process it starts, and ends every
one still alive when it exits, whatever their session or signal mask (process_tree.py):
at Ctrl-C here, at a normal exit, an error or a stop through atexit.

Leaving at once loses nothing that counts: a checkpoint only counts once committed (an
interrupted asynchronous save is ignored on resume), the jsonl files are cut back to the
last checkpoint on resume (a torn last line included), and the workdir's lock goes with
the process. Rerunning the same command resumes from the last committed checkpoint.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading

from april_jax.runtime import process_tree

INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

_message = "interrupted (Ctrl-C)"
_then = "rerun the same command to resume from the last checkpoint"
_lock = threading.Lock()
_on_leave: list = []  # callables that end the run's child processes (workers.py)


def on_leave(fn) -> None:
  """`fn()` runs when Ctrl-C ends the run, before it exits: it ends the processes the run
  started (it must be quick and take no lock another thread may hold)."""
  _on_leave.append(fn)


def forget(fn) -> None:
  """Undoes on_leave(fn) (its processes have ended)."""
  if fn in _on_leave:
    _on_leave.remove(fn)


def _leave() -> None:
  with _lock:  # the handler and the watcher may both get here: one line, once
    try:
      for fn in list(_on_leave):
        try:
          fn()
        except Exception:  # pylint: disable=broad-except
          pass
      process_tree.end_descendants()
      os.write(sys.stderr.fileno(), f"\napril_jax: {_message}; {_then}\n".encode())
    finally:
      os._exit(INTERRUPTED_EXIT)  # pylint: disable=protected-access


def _handler(signum, frame) -> None:
  del signum, frame
  _leave()


def _watch(read_fd: int) -> None:
  while True:
    try:
      data = os.read(read_fd, 64)
    except OSError:
      return
    if not data:
      return
    if signal.SIGINT in data:
      _leave()


def install(then: str | None = None) -> None:
  """From the main thread, as early as possible (before jax is imported). `then`: what the
  line says after "interrupted (Ctrl-C)" (default: how a run resumes)."""
  global _then
  _then = then or _then
  process_tree.adopt_orphans()
  atexit.register(process_tree.end_descendants)  # registered first: runs last
  signal.signal(signal.SIGINT, _handler)
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  threading.Thread(target=_watch, args=(read_fd,), name="sigint-watch", daemon=True).start()


def ignore_in_child() -> None:
  """For worker processes: the terminal's Ctrl-C, and a launcher's SIGTERM to the whole
  process group (SLURM, a container's stop), reach every process, and the run, not each
  worker, answers them: it cuts its step and then ends its workers itself."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
