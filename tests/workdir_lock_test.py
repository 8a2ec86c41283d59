"""One run per workdir: a second one is refused by name; a lock left by a killed run, or
released, does not block; a folder that holds a run's names but is not a run's is refused
with every byte left as it was."""

import os
import signal
import subprocess
import sys
import time

import pytest

from april_jax.errors import InputError
from april_jax.runtime.workdir_lock import WorkdirLock


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
          "import sys, time; from april_jax.runtime.workdir_lock import WorkdirLock; "
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


def _tree(folder):
  return {
      str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
      for p in sorted(folder.rglob("*"))
  }


def test_a_folder_holding_another_tools_run_files_is_refused_untouched(tmp_path):
  """A fresh start would empty its metrics.jsonl and set its checkpoints/<step> aside."""
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
  (tmp_path / "checkpoints" / "100").mkdir(parents=True)
  (tmp_path / "checkpoints" / "100" / "model.pt").write_bytes(b"weights")
  (tmp_path / "notes.txt").write_text("mine")
  before = _tree(tmp_path)
  with pytest.raises(InputError, match=r"holds checkpoints, metrics.jsonl, which a run would"):
    WorkdirLock(str(tmp_path))
  assert _tree(tmp_path) == before  # not even a lock file
  (tmp_path / ".lock").write_text("pid 1 on another\n")  # a run's, from before the mark
  WorkdirLock(str(tmp_path)).release()
  assert (tmp_path / ".april_jax_run").is_file()
  assert {k: v for k, v in _tree(tmp_path).items() if k not in (".lock", ".april_jax_run")} == (
      before
  )


def test_a_run_marks_a_new_or_empty_workdir_and_a_folder_of_other_files(tmp_path):
  for folder in (tmp_path / "new", tmp_path / "other"):
    if folder.name == "other":
      folder.mkdir()
      (folder / "my_reward.py").write_text("def score(r, a): return 0.0\n")
    WorkdirLock(str(folder)).release()
    assert (folder / ".april_jax_run").is_file()
    (folder / "metrics.jsonl").write_text("")  # the run's own, from now on
    WorkdirLock(str(folder)).release()
