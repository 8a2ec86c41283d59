"""One run per workdir: an exclusive lock on `<workdir>/.lock`, held while the run lives.

The lock is the operating system's (flock), so it goes with its process: a run killed by
kill -9 or a crash leaves a file that no longer blocks. The file says who holds it.
"""

from __future__ import annotations

import fcntl
import os
import socket

from april_jax.errors import InputError


class WorkdirLock:
  """Held from construction until `release()` or the end of the process."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, ".lock")
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

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)  # closing the last descriptor drops the lock
      self._fd = None
