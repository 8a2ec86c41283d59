"""process_tree finds every process below this one, whatever session it moved to, and
ends them all with SIGKILL, deaf to other signals or not; as the subreaper, this process
gets the orphans of its children back and can end them too."""

import os
import subprocess
import sys
import time

from april_jax.runtime import process_tree

# A child that starts two grandchildren (one in a session of its own), all deaf to SIGINT
# and SIGTERM, prints their pids, then leaves: its grandchildren are orphans.
DEAF = "import signal, time\nfor s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_IGN)\ntime.sleep(600)"
ORPHANING = f"""
import subprocess, sys
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
a = subprocess.Popen([sys.executable, "-c", {DEAF!r}], start_new_session=True, **quiet)
b = subprocess.Popen([sys.executable, "-c", {DEAF!r}], **quiet)
print(a.pid, b.pid, flush=True)
"""


def _alive(pid: int) -> bool:
  return process_tree._running(pid)  # pylint: disable=protected-access


def test_the_subreaper_adopts_orphans_and_ends_every_descendant_whatever_its_session():
  script = (
      "import subprocess, sys, time\n"
      "from april_jax.runtime import process_tree\n"
      "assert process_tree.adopt_orphans()\n"
      f"out = subprocess.run([sys.executable, '-c', {ORPHANING!r}], capture_output=True, text=True).stdout\n"
      "pids = [int(p) for p in out.split()]\n"
      "time.sleep(0.5)\n"
      "assert sorted(process_tree.descendants()) == sorted(pids), (process_tree.descendants(), pids)\n"
      "print(' '.join(map(str, pids)), flush=True)\n"
      "print(process_tree.end_descendants(), flush=True)\n"
      "print(process_tree.descendants(), flush=True)\n"
  )
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  pids_line, killed, left = proc.stdout.splitlines()
  pids = [int(p) for p in pids_line.split()]
  assert int(killed) == 2 and left == "[]"
  assert not any(_alive(pid) for pid in pids)


def test_without_the_subreaper_orphans_escape_which_is_why_the_run_adopts_them():
  out = subprocess.run([sys.executable, "-c", ORPHANING], capture_output=True, text=True).stdout
  pids = [int(p) for p in out.split()]
  try:
    assert all(_alive(pid) for pid in pids)
    assert not set(pids) & set(process_tree.descendants())  # not ours to find any more
  finally:
    for pid in pids:
      os.kill(pid, 9)


def test_descendants_lists_children_before_grandchildren():
  child = subprocess.Popen(
      [
          sys.executable,
          "-c",
          f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {DEAF!r}])",
      ]
  )
  try:
    deadline = time.monotonic() + 30
    while not process_tree.children(child.pid) and time.monotonic() < deadline:
      time.sleep(0.05)
    found = [
        pid
        for pid in process_tree.descendants()
        if pid == child.pid or pid in process_tree.children(child.pid)
    ]
    assert found[0] == child.pid and len(found) == 2
  finally:
    for pid in process_tree.children(child.pid):
      os.kill(pid, 9)
    child.kill()
    child.wait()
