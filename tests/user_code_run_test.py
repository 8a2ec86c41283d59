"""A user's environment and reward files drive a real run (configs/tiny_lookup.py), and
what that code does beyond its job is contained: what it prints goes to the workdir's
log and to the console as marked lines, a few a step, never into the run's own lines;
the processes it starts (in new sessions, deaf to SIGINT and SIGTERM, forked) end with
the run; wrong files stop the run before it compiles. One run of each, shared by the
tests below."""

import concurrent.futures
import json
import os
import re

import pytest

from april_jax.runtime import user_output
import cli

USER_ENV = '''
import os
import signal
import subprocess
import sys
import time

from april_jax.envs.base import EnvStep

PIDS = {pids!r}
DEAF = "import signal, time\\nfor s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_IGN)\\ntime.sleep(600)"


def _leave_processes_behind():
  """A process in a session of its own and a forked one, both deaf to SIGINT and SIGTERM."""
  started = subprocess.Popen([sys.executable, "-c", DEAF], start_new_session=True)
  forked = os.fork()
  if forked == 0:
    os.setsid()
    for s in (signal.SIGINT, signal.SIGTERM):
      signal.signal(s, signal.SIG_IGN)
    time.sleep(600)
    os._exit(0)
  with open(PIDS, "a") as f:
    f.write(f"{{started.pid}}\\n{{forked}}\\n")


class Oracle:
  """Tells the target of the built-in task's walk when asked with ':'; chatty, and it
  leaves processes behind on its first calls."""

  calls = 0

  def reset(self, row):
    return {{"last": row["answer"][-1], "asked": 0}}

  def step(self, state, turn):
    Oracle.calls += 1
    if Oracle.calls <= 2:
      _leave_processes_behind()
    for i in range(15):
      print(f"oracle says {{i}} of call {{Oracle.calls}}")
    print("oracle's stderr line " + "x" * 1000, file=sys.stderr)
    if turn.replace("<eos>", "") != ":":
      return EnvStep(None, True, state)
    from april_jax.tasks.longtail import target_of
    return EnvStep(target_of(state["last"]) + "=", False, {{**state, "asked": state["asked"] + 1}})


NOT_AN_ENV = 3
'''

USER_REWARD = '''
def walk(sample):
  """The walk after the last observation against the answer, and the episode's turns."""
  print("scoring", sample["answer"])
  walk = sample["response"].rpartition("=")[2].strip()
  return {"score": float(walk == sample["answer"]), "turns": sample["turns"]}
'''


def _main(workdir, *flags):
  # max_response_len as configs/tiny.py's: the programs other runs compiled are cached.
  return cli.run(
      "--config.rollout.max_response_len=64", *flags, config="tiny_lookup.py", workdir=workdir
  )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The good run (2 steps, isolation=none) and two runs with a wrong file, side by side
  (two cores; the wrong ones end before compiling)."""
  tmp = tmp_path_factory.mktemp("user_code")
  pids = tmp / "pids.txt"
  (tmp / "my_env.py").write_text(USER_ENV.format(pids=str(pids)))
  (tmp / "my_reward.py").write_text(USER_REWARD)
  env, reward = tmp / "my_env.py", tmp / "my_reward.py"
  wrong = [
      (f"--config.env.name={env}:NOT_AN_ENV", "NOT_AN_ENV is a int, not a class or a factory"),
      (f"--config.rollout.reward={reward}:missing", "has no function 'missing'"),
  ]
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    bad = [pool.submit(_main, tmp / f"bad{i}", flag) for i, (flag, _) in enumerate(wrong)]
    good = pool.submit(
        _main,
        tmp / "run",
        f"--config.env.name={env}:Oracle",
        f"--config.rollout.reward={reward}:walk",
        "--config.env.isolation=none",
        "--config.num_steps=2",
        "--config.train.sft_steps=30",
        "--config.eval_every=0",
    )
  return {
      "tmp": tmp,
      "good": good.result(),
      "bad": [
          (f.result(), message, tmp / f"bad{i}")
          for i, (f, (_, message)) in enumerate(zip(bad, wrong))
      ],
      "pids": [int(p) for p in pids.read_text().split()] if pids.exists() else [],
  }


def test_a_users_reward_and_environment_files_drive_the_run(runs):
  run = runs["good"]
  assert run.returncode == 0, run.stderr[-3000:]
  lines = [json.loads(l) for l in (runs["tmp"] / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [l["step"] for l in lines] == [1, 2]
  for line in lines:  # the warm start taught the call: episodes take turns
    assert line["rollout/env/turns"] > line["rollout/env/episodes_done"] > 0
    assert 0 < line["rollout/observation_token_frac"] < 0.5
    assert line["reward/turns"] > 1  # the reward's extra number: it saw the episodes
    assert 0.0 <= line["rollout/reward_mean"] <= 1.0


def test_wrong_user_files_stop_the_run_in_one_line_before_it_compiles(runs):
  for bad, message, workdir in runs["bad"]:
    assert bad.returncode == 2 and message in bad.stderr, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr and "compiling" not in bad.stdout
    assert not (workdir / "checkpoints").exists()


def test_no_process_the_users_environment_started_outlives_the_run(runs):
  assert runs["good"].returncode == 0
  pids = runs["pids"]
  # Each worker's first two calls, each a setsid'd process and a fork.
  assert len(pids) >= 4 and len(pids) % 4 == 0, pids
  alive = []
  for pid in pids:
    try:
      with open(f"/proc/{pid}/stat") as f:
        state = f.read().rpartition(")")[2].split()[0]
      if state not in ("Z", "X"):
        alive.append(pid)
    except FileNotFoundError:
      pass
  assert not alive, f"still running after the run: {alive}"


def test_what_user_code_prints_goes_to_the_log_and_marked_capped_lines_on_the_console(runs):
  run, workdir = runs["good"], runs["tmp"] / "run"
  log = (workdir / user_output.LOG_NAME).read_text()
  # Every line the environment and the reward printed, marked with who printed it.
  assert re.search(r"^\[environment\] oracle says 14 of call \d+$", log, re.M)
  assert re.search(r"^\[environment\] oracle's stderr line x{1000}$", log, re.M)
  assert re.search(r"^\[reward\] scoring \S+$", log, re.M)
  # None of it on the run's stdout, whose lines are the run's own.
  assert "oracle" not in run.stdout and "scoring" not in run.stdout
  # On stderr: whole marked lines, long ones cut, and the rest of a step's lines held back.
  marked = [l for l in run.stderr.splitlines() if l.startswith(("[environment]", "[reward]"))]
  assert marked and all(
      len(l) <= len("[environment] ") + user_output.MAX_CONSOLE_CHARS + 4 for l in marked
  )
  assert "oracle" not in "".join(
      l for l in run.stderr.splitlines() if l not in marked and "more lines" not in l
  )
  assert re.search(
      r"^april_jax: user code printed \d+ more lines this step: .*user_output\.log$",
      run.stderr,
      re.M,
  )
  console_environment_lines = sum(l.startswith("[environment] oracle says") for l in marked)
  log_environment_lines = len(re.findall(r"^\[environment\] oracle says", log, re.M))
  assert console_environment_lines < log_environment_lines


def test_a_run_without_isolation_warns_at_start_up_and_in_its_summary(runs):
  run = runs["good"]
  assert "april_jax: warning: env.isolation=none" in run.stderr
  summary = run.stdout[run.stdout.index("run summary") :]
  assert "warning          env.isolation=none" in summary
