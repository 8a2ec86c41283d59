"""One run per workdir: an exclusive lock on `<workdir>/.lock`, held while the run lives.

The lock is the operating system's (flock), so it goes with its process: a run killed by
kill -9 or a crash leaves a file that no longer blocks. The file says who holds it.

A workdir is a run's once it holds `.april_jax_run`, written when a run first takes an
empty (or new) folder (or `.lock`, which runs before the mark left too). A folder without it that holds any of the names a run writes
(metrics.jsonl, checkpoints/, ...) is someone else's: a run there would rewrite or set
aside what it found, so it is refused, naming them.
"""

from __future__ import annotations

import fcntl
import os
import socket

from april_jax.errors import InputError

MARKER = ".april_jax_run"
RUN_NAMES = (  # what a run writes into its workdir and would rewrite or set aside
    "checkpoints",
    "damaged_checkpoints",
    "metrics.jsonl",
    "rollouts.jsonl",
    "tb",
    "progress.png",
)  # not xla_cache: a cache, which another process of a run may make before the lock


def _refuse_if_foreign(workdir: str) -> None:
  """An InputError if `workdir` holds a run's names without the mark of a run's workdir."""
  if not os.path.isdir(workdir) or os.path.exists(os.path.join(workdir, MARKER)):
    return
  if os.path.exists(os.path.join(workdir, ".lock")):
    return  # a run's workdir from before the mark: every run has left its lock file
  found = sorted(set(os.listdir(workdir)) & set(RUN_NAMES))
  if found:
    raise InputError(
        f"workdir {workdir} is not an april_jax run's (no {MARKER}) but holds "
        f"{', '.join(found)}, which a run would rewrite: choose a new or empty folder"
    )


class WorkdirLock:
  """Held from construction until `release()` or the end of the process."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, ".lock")
    _refuse_if_foreign(workdir)  # before anything is written there
    try:
      os.makedirs(workdir, exist_ok=True)
      self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise InputError(
          f"workdir {workdir} cannot be created or written: {e.strerror or e}"
      ) from None
    try:
      fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip() or "unknown"
      os.close(self._fd)
      raise InputError(
          f"workdir {workdir} is in use by another run ({holder}): wait for it to end, or "
          "give this run another --workdir"
      ) from None
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    marker = os.path.join(workdir, MARKER)
    if not os.path.exists(marker):
      with open(marker, "w", encoding="utf-8") as f:
        f.write("april_jax run workdir\n")

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)  # closing the last descriptor drops the lock
      self._fd = None
