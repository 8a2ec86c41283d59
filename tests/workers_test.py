"""Worker processes for user code: a call past its limit is ended whatever it holds, an
error names the user's line, a dead worker is replaced, and no worker outlives the
process that started it, however that process ends."""

import functools
import os
from pathlib import Path
import signal
import subprocess
import sys
import time
import types

import pytest

from april_jax.runtime import workers
from process_tree import alive, parent

ROOT = Path(__file__).resolve().parents[1]


def _serve_user_code(job):
  kind, arg = job
  if kind == "echo":
    return arg
  if kind == "raise":
    raise LookupError(f"no {arg}")
  if kind == "hold":  # holds the interpreter lock: no thread could stop this
    return 10 ** (10**arg)
  if kind == "exit":
    os._exit(arg)
  if kind == "ghost":  # an object of a module the calling process has never imported
    module = types.ModuleType("ghost_module")
    exec("class Ghost:\n  pass", module.__dict__)  # pylint: disable=exec-used
    sys.modules["ghost_module"] = module
    return module.Ghost()
  raise AssertionError(kind)


def _make():
  return _serve_user_code


def _fails_to_make():
  raise OSError("no sandbox")


def test_a_call_past_its_limit_is_killed_and_its_worker_replaced():
  pool = workers.WorkerPool(_make, 1, preload=(__name__,))
  try:
    (before,) = pool.pids()
    start = time.monotonic()
    with pytest.raises(workers.CallTimeout, match="time limit of 0.3 s"):
      pool.call(("hold", 10), timeout_s=0.3)
    assert time.monotonic() - start < 0.3 + 2.0
    (after,) = pool.pids()
    assert after != before
    assert pool.call(("echo", {"x": [1]}), timeout_s=5.0)[0] == {"x": [1]}
  finally:
    pool.close()
  assert not pool.pids()


def test_an_error_names_the_users_line_and_a_worker_that_dies_is_replaced():
  pool = workers.WorkerPool(_make, 1, preload=(__name__,))
  try:
    with pytest.raises(workers.UserCodeError) as raised:
      pool.call(("raise", "table"), timeout_s=5.0)
    line = _serve_user_code.__code__.co_firstlineno + 5
    assert str(raised.value) == f"LookupError: no table ({__file__}:{line})"
    with pytest.raises(workers.WorkerDied, match=r"process died \(exit status 7\)"):
      pool.call(("exit", 7), timeout_s=5.0)
    assert pool.call(("echo", 3), timeout_s=5.0)[0] == 3
  finally:
    pool.close()


def test_a_target_that_cannot_be_made_answers_every_call_with_why():
  pool = workers.WorkerPool(_fails_to_make, 1, preload=(__name__,))
  try:
    with pytest.raises(workers.UserCodeError, match="OSError: no sandbox"):
      pool.call(("echo", 1), timeout_s=5.0)
  finally:
    pool.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal")
def test_no_worker_outlives_a_process_killed_outright(tmp_path):
  """SIGKILL gives the process no chance to end its workers: the kernel does, through the
  forkserver (forkserver_guard.py), even with a worker holding the interpreter lock."""
  script = (
      "import sys, threading; sys.path.insert(0, 'tests')\n"
      "import workers_test as t; from april_jax.runtime import workers\n"
      "pool = workers.WorkerPool(t._make, 2, preload=('workers_test',))\n"
      "threading.Thread(target=pool.call, args=(('hold', 10), 600), daemon=True).start()\n"
      "print(' '.join(map(str, pool.pids())), flush=True)\n"
      "import time; time.sleep(600)\n"
  )
  proc = subprocess.Popen(
      [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
  )
  pids = [int(p) for p in proc.stdout.readline().split()]
  server = {parent(p) for p in pids}
  assert len(pids) == 2 and len(server) == 1 and proc.pid not in server
  time.sleep(0.5)  # the hold is running
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=10)
  deadline = time.monotonic() + 5
  left = set(pids) | server
  while left and time.monotonic() < deadline:
    left = {p for p in left if alive(p)}
    time.sleep(0.1)
  assert not left


def test_a_worker_does_not_run_the_programs_main_module_again(tmp_path):
  """multiprocessing would have each new worker run the program's main module as
  `__mp_main__` (for `python -m april_jax.main`: jax and the trainer, seconds a worker)."""
  log = tmp_path / "imports.txt"
  program = tmp_path / "program.py"
  program.write_text(
      f"open({str(log)!r}, 'a').write(__name__ + '\\n')\n"
      "if __name__ == '__main__':\n"
      f"  import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
      "  import workers_test as t; from april_jax.runtime import workers\n"
      "  pool = workers.WorkerPool(t._make, 2, preload=('workers_test',))\n"
      "  assert pool.call(('echo', 5), 30)[0] == 5\n"
      "  pool.close()\n"
  )
  subprocess.run([sys.executable, str(program)], cwd=tmp_path, check=True, timeout=120)
  assert log.read_text().split() == ["__main__"]


def test_a_result_the_caller_cannot_read_is_an_error_and_the_worker_stays():
  pool = workers.WorkerPool(_make, 1, preload=(__name__,))
  try:
    (pid,) = pool.pids()
    with pytest.raises(workers.UserCodeError, match="cannot be read in the trainer"):
      pool.call(("ghost", None), timeout_s=5.0)
    assert pool.call(("echo", 2), timeout_s=5.0)[0] == 2 and pool.pids() == [pid]
  finally:
    pool.close()


def test_a_sigterm_to_the_process_group_is_the_runs_to_answer_not_the_workers():
  pool = workers.WorkerPool(_make, 1, preload=(__name__,))
  try:
    assert pool.call(("echo", 1), timeout_s=5.0)[0] == 1
    (pid,) = pool.pids()
    os.kill(pid, signal.SIGTERM)
    os.kill(pid, signal.SIGINT)
    assert pool.call(("echo", 2), timeout_s=5.0)[0] == 2 and pool.pids() == [pid]
  finally:
    pool.close()
