"""One run per workdir: a second one is refused by name; a lock left by a killed run, or
released, does not block."""

import os
import signal
import subprocess
import sys
import time

import pytest

from april_jax.errors import InputError
from april_jax.workdir_lock import WorkdirLock


def test_a_second_run_on_a_workdir_is_refused_until_the_first_releases(tmp_path):
  first = WorkdirLock(str(tmp_path))
  with pytest.raises(
      InputError, match=rf"workdir {tmp_path} is in use by another run " rf"\(pid {os.getpid()} on "
  ):
    WorkdirLock(str(tmp_path))
  first.release()
  WorkdirLock(str(tmp_path)).release()


def test_a_lock_left_by_a_killed_run_does_not_block(tmp_path):
  holder = subprocess.Popen(
      [
          sys.executable,
          "-c",
          "import sys, time; from april_jax.workdir_lock import WorkdirLock; "
          f"WorkdirLock({str(tmp_path)!r}); print('held', flush=True); time.sleep(600)",
      ],
      stdout=subprocess.PIPE,
      text=True,
  )
  assert holder.stdout.readline().strip() == "held"
  with pytest.raises(InputError, match=f"pid {holder.pid} on "):
    WorkdirLock(str(tmp_path))
  holder.send_signal(signal.SIGKILL)
  holder.wait(timeout=30)
  assert (tmp_path / ".lock").exists()  # the file stays; its lock went with the process
  start = time.monotonic()
  WorkdirLock(str(tmp_path)).release()
  assert time.monotonic() - start < 1.0
