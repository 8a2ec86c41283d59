"""Stops are prompt and leave nothing behind: SIGTERM cuts the step at once (its rollouts
kept in a checkpoint), Ctrl-C exits at once, and no process the run started (the
forkserver, reward and environment workers) is alive a few seconds later."""

import os
from pathlib import Path
import signal
import time

import pytest

import cli
from process_tree import alive, descendants

# Writes a mark, then holds the interpreter lock until killed (when SPIN is set).
SPINNING_REWARD = """
import os
def score(response, answer):
  if os.environ.get("SPIN"):
    open(os.environ["MARK"], "a").write("r")
    while True:
      pass
  return float(len(response) % 2)
"""

SPINNING_ENV = """
import os
from april_jax.envs.base import EnvStep
class Env:
  def reset(self, row):
    return {}
  def step(self, state, turn):
    open(os.environ["MARK"], "a").write("e")
    x = 10 ** (10 ** 10)
"""

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree")


def _start(config: str, workdir: Path, mark: Path, *flags: str, spin: bool = True):
  # A compilation cache of its own: a run ended at once (Ctrl-C) may leave an entry it was
  # writing cut short, which the session's other runs would read and warn about.
  env = dict(MARK=str(mark), JAX_COMPILATION_CACHE_DIR=str(workdir.parent / "xla_cache"))
  if spin:
    env["SPIN"] = "1"
  return cli.launch(
      "--config.train.sft_steps=0",
      "--config.eval_every=0",
      "--config.rollout.max_failed_steps=0",
      *flags,
      config=config,
      workdir=workdir,
      env=env,
  )


def _busy_tree(proc, mark: Path, workers: int) -> set[int]:
  """Waits until user code runs (its mark) and the run has its workers; their pids."""
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and proc.poll() is None:
    tree = descendants(proc.pid)
    if mark.exists() and len(tree) >= workers:
      return tree
    time.sleep(0.2)
  proc.kill()
  raise AssertionError(f"user code never ran: {proc.communicate()[1][-3000:]}")


def _all_ended(pids: set[int], within_s: float = 5.0) -> set[int]:
  deadline = time.monotonic() + within_s
  while time.monotonic() < deadline and any(alive(p) for p in pids):
    time.sleep(0.1)
  return {p for p in pids if alive(p)}


def test_sigterm_cuts_the_step_at_once_saves_and_leaves_no_process(tmp_path):
  (tmp_path / "spin.py").write_text(SPINNING_REWARD)
  flags = [
      f"--config.rollout.reward={tmp_path / 'spin.py'}:score",
      "--config.rollout.reward_timeout_s=600",  # only the stop can end a step
      "--config.num_steps=2",
  ]
  mark = tmp_path / "mark"
  proc = _start("tiny.py", tmp_path / "run", mark, *flags)
  # The resource tracker, the forkserver and its two reward workers.
  tree = _busy_tree(proc, mark, workers=4)
  start = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  took = time.monotonic() - start
  assert proc.returncode == 143, err[-3000:]
  assert took < 30.0, took  # the cut and the save; a step would wait 600 s per reward
  assert "stopped by SIGTERM during step 1 of 2: its rollouts so far are kept in " in out
  assert "Traceback" not in err
  assert not _all_ended(tree)
  assert (tmp_path / "run" / "checkpoints" / "0").is_dir()
  # Resumed with a reward that answers: the cut's groups are in the buffer, the run ends.
  resumed = _start("tiny.py", tmp_path / "run", mark, *flags, spin=False)
  out, err = resumed.communicate(timeout=600)
  assert resumed.returncode == 0, err[-3000:]
  assert "resumed from step 0 (" in out and " groups in the partial buffer)" in out
  assert "resumed from step 0 (0 groups" not in out
  lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  assert [int(l.split('"step": ')[1].split(",")[0]) for l in lines] == [1, 2]


def test_ctrl_c_ends_the_run_and_every_worker_at_once(tmp_path):
  (tmp_path / "spin_env.py").write_text(SPINNING_ENV)
  (tmp_path / "spin.py").write_text(SPINNING_REWARD)
  mark = tmp_path / "mark"
  proc = _start(
      "tiny_lookup.py",
      tmp_path / "run",
      mark,
      "--config.rollout.max_response_len=64",
      f"--config.env.name={tmp_path / 'spin_env.py'}:Env",
      "--config.env.timeout_s=600",
      f"--config.rollout.reward={tmp_path / 'spin.py'}:score",
  )
  # The resource tracker, the forkserver, two reward workers and an environment worker.
  tree = _busy_tree(proc, mark, workers=5)
  start = time.monotonic()
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 130, err[-3000:]
  assert time.monotonic() - start < 5.0
  assert err.strip().splitlines()[-1].startswith("april_jax: interrupted (Ctrl-C)")
  assert not _all_ended(tree)
