"""What user code prints goes to a bounded log in the workdir, and to the console as whole
lines marked with who printed them, a few a step, never through the run's own streams.

A user's reward or environment runs in worker processes (workers.py); its stdout and
stderr are a pipe that a thread of the run reads here. Each line goes to
`<workdir>/user_output.log` (at most MAX_LOG_BYTES; what comes after is counted, not
kept) and, up to CONSOLE_LINES_PER_STEP lines a step (`new_step()`), to the run's
stderr as `[reward] ...` or `[environment] ...`, each line one write, so the run's own
lines are never broken by it; past the cap one line says where the rest is.

  relay = user_output.start(workdir)    # the trainer, before it starts any worker
  fd = user_output.writer("environment")  # a pool, for each worker it starts (or None)
  relay.new_step(); relay.close()

Without a relay (tests, benchmarks, library use) workers keep the process's own streams.
"""

from __future__ import annotations

import os
import re
import threading

LOG_NAME = "user_output.log"
MAX_LOG_BYTES = 64 << 20
CONSOLE_LINES_PER_STEP = 20
MAX_CONSOLE_CHARS = 400  # a console line longer than this is cut (the log keeps it whole)
READ_BYTES = 1 << 16
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # but tab; ESC and CR among them

_current: OutputRelay | None = None
_lock = threading.Lock()


class OutputRelay:
  """The log file, the console's per-step budget, and one reading thread per pipe."""

  def __init__(self, workdir: str, log_name: str = LOG_NAME, echo_fd: int = 2):
    self.path = os.path.join(workdir, log_name)
    self._log = open(self.path, "ab")  # pylint: disable=consider-using-with
    self._echo_fd = echo_fd
    self._lock = threading.Lock()
    self._pipes: dict[str, tuple[int, int]] = {}  # role -> (read fd, write fd)
    self._threads: list[threading.Thread] = []
    self.logged_bytes = 0
    self.dropped_bytes = 0
    self.echoed = 0
    self.held_back = 0  # lines over this step's console budget
    self._closed = False

  def writer(self, role: str) -> int:
    """The write end of `role`'s pipe (made on first use), for a worker's stdout/stderr."""
    with self._lock:
      if role not in self._pipes:
        read_fd, write_fd = os.pipe()
        self._pipes[role] = (read_fd, write_fd)
        thread = threading.Thread(
            target=self._relay, args=(role, read_fd), name=f"user-output-{role}", daemon=True
        )
        thread.start()
        self._threads.append(thread)
      return self._pipes[role][1]

  def _relay(self, role: str, read_fd: int) -> None:
    pending = b""
    while True:
      try:
        chunk = os.read(read_fd, READ_BYTES)
      except OSError:
        chunk = b""
      if not chunk:  # every writer gone: the workers ended and close() ran
        if pending:
          self._line(role, pending)
        try:
          os.close(read_fd)
        except OSError:
          pass
        return
      pending += chunk
      *lines, pending = pending.split(b"\n")
      for line in lines:
        self._line(role, line)
      if len(pending) > READ_BYTES:  # a line without end: cut it here
        self._line(role, pending)
        pending = b""

  def _line(self, role: str, line: bytes) -> None:
    with self._lock:
      if self._closed:
        return
      record = b"[" + role.encode() + b"] " + line + b"\n"
      if self.logged_bytes + len(record) <= MAX_LOG_BYTES:
        self._log.write(record)
        self._log.flush()
        self.logged_bytes += len(record)
      else:
        self.dropped_bytes += len(record)
      if self.echoed < CONSOLE_LINES_PER_STEP:
        self.echoed += 1
        text = _CONTROL.sub("?", line.decode("utf-8", "replace"))  # no terminal escapes
        if len(text) > MAX_CONSOLE_CHARS:
          text = text[:MAX_CONSOLE_CHARS] + " ..."
        self._echo(f"[{role}] {text}")
      else:
        self.held_back += 1

  def _echo(self, text: str) -> None:
    try:
      os.write(self._echo_fd, (text + "\n").encode("utf-8", "replace"))
    except OSError:
      pass

  def new_step(self) -> None:
    """A new step's console budget; says how many lines the last one held back."""
    with self._lock:
      if self.held_back:
        self._echo(
            f"april_jax: user code printed {self.held_back} more lines this step: {self.path}"
        )
      self.echoed, self.held_back = 0, 0

  def close(self) -> None:
    """Stops logging (the workers' pipes close with them); notes what was not kept."""
    self.new_step()
    with self._lock:
      if self._closed:
        return
      self._closed = True
      if self.dropped_bytes:
        self._log.write(
            f"[april_jax] {self.dropped_bytes} bytes more were printed, past the log's "
            f"{MAX_LOG_BYTES >> 20} MB\n".encode()
        )
      self._log.close()
      for _, write_fd in self._pipes.values():
        os.close(write_fd)


def start(workdir: str, log_name: str = LOG_NAME) -> OutputRelay:
  """The run's relay: every worker started from now on prints through it."""
  global _current
  with _lock:
    if _current is not None:
      _current.close()
    _current = OutputRelay(workdir, log_name)
    return _current


def stop() -> None:
  """Closes the run's relay; workers started later keep the process's own streams."""
  global _current
  with _lock:
    if _current is not None:
      _current.close()
    _current = None


def writer(role: str) -> int | None:
  """The fd a new worker of `role` prints into, or None (no relay: the process's own)."""
  with _lock:
    return None if _current is None else _current.writer(role)
