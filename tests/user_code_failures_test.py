"""User code that fails is seen: each failed sample keeps why (the error, the user's file
and line), a step says so on the console, a run whose every sample fails the same way
stops with one line and exit 2, and an environment's call past its limit is ended
whatever it holds."""

import ctypes
import math
import os
import time

import numpy as np
import pytest

from april_jax.runtime import workers
from april_jax.rollout import episodes
from april_jax.envs import in_workers
from april_jax.rollout import failures
from april_jax.rollout.group import Group
from april_jax.rollout.reward_runner import RewardRunner
from april_jax.sampler import SampleRecord
from april_jax.settings.env import EnvSettings
import cli


# ------------------------------------------------------------- rewards that go wrong
def _raises(text, answer):
  raise ValueError("boom")


def _returns_text(text, answer):
  return "1.0 (correct)"


def _returns_none(text, answer):
  return None


def _returns_a_list(text, answer):
  return [1.0]


def _returns_nan(text, answer):
  return math.nan


def _has_no_score(text, answer):
  return {"correct": 1.0}


def _exits(text, answer):
  os._exit(3)


def _segfaults(text, answer):
  ctypes.string_at(0)


BROKEN = [
    (_raises, "ValueError: boom ("),
    (_returns_text, "TypeError: a reward returns a number or a dict with a 'score', got str"),
    (_returns_none, "got NoneType"),
    (_returns_a_list, "got list"),
    (_returns_nan, "ValueError: the reward is NaN"),
    (_has_no_score, "TypeError: a reward's dict needs a 'score', got keys ['correct']"),
    (_exits, "the reward process died (exit status 3)"),
    (_segfaults, "the reward process died (killed by SIGSEGV)"),
]


def _group(gid, n=2):
  """A complete group of n two-token samples (finished: their budget is spent)."""
  samples = [
      SampleRecord(
          prompt=np.array([1, 2], np.int32),
          max_new_tokens=2,
          rng=np.zeros(2),
          response=[3, 4 + i],
          logprobs=np.zeros(2),
          versions=np.zeros(2),
      )
      for i in range(n)
  ]
  return Group(gid, gid, samples[0].prompt, "7", samples, first_step=0)


@pytest.mark.parametrize("reward, why", BROKEN, ids=[f.__name__ for f, _ in BROKEN])
def test_a_broken_reward_gets_the_fallback_and_keeps_why_with_its_file_and_line(reward, why):
  runner = RewardRunner(reward, lambda ids: str(ids), num_workers=1, timeout_s=10.0, fallback=-1.0)
  try:
    group = _group(0)
    runner.submit(group)
    runner.wait_for([group])
    assert group.rewards == [-1.0, -1.0] and runner.errors == 2
    assert [status for status, _ in group.reward_info["failures"]] == ["error", "error"]
    message = group.reward_info["failures"][0][1]
    assert why in message, message
    if reward is _raises:  # the place is the user's line, not the runner's
      assert message.endswith(f"({__file__}:{_raises.__code__.co_firstlineno + 1})"), message
    tally = failures.StepFailures.of([group])
    assert tally.failed == tally.samples == 2 and tally.all_one_cause
    assert tally.line(4).startswith("step 4: 2 of 2 samples failed: the reward raised for 2: ")
    assert runner.worker_pids()  # a worker that died was replaced
  finally:
    runner.close()
  assert not runner.worker_pids()


def _tally(*causes):
  """A step's failures: one sample per cause ((kind, why), or None for a success)."""
  out = failures.StepFailures()
  for c in causes:
    out.samples += 1
    if c is not None:
      out.failed += 1
      out.kinds[c[0]] += 1
      out.first.setdefault(c[0], c[1])
      out.causes.add(failures.cause(*c))
  return out


BOOM = ("reward_error", "ValueError: boom (/x/r.py:2)")


def test_the_run_stops_at_the_first_step_or_after_max_failed_steps_of_one_cause():
  # At the first step a process runs: at once.
  assert "every sample of step 1 failed the same way" in failures.FailureStreak(3).see(
      _tally(BOOM, BOOM), 1
  )
  streak = failures.FailureStreak(3)
  assert streak.see(_tally(BOOM, None), 1) is None  # one sample scored: not all failed
  assert streak.see(_tally(BOOM, BOOM), 2) is None
  assert streak.see(_tally(BOOM, BOOM), 3) is None
  why = streak.see(_tally(BOOM, BOOM), 4)
  assert why.startswith("every sample of steps 2-4 failed the same way (the reward raised): ")
  # The text may name the sample: the type and the place make the cause.
  other_text = ("reward_error", "ValueError: bang (/x/r.py:2)")
  streak = failures.FailureStreak(2)
  streak.see(_tally(), 1)
  assert streak.see(_tally(BOOM, other_text), 2) is None
  assert streak.see(_tally(BOOM, other_text), 3) is not None
  # Two causes in one step, or a success between, reset the count; 0 never stops.
  streak = failures.FailureStreak(2)
  streak.see(_tally(), 1)
  assert streak.see(_tally(BOOM, ("reward_timeout", "ran past")), 2) is None
  assert streak.see(_tally(BOOM), 3) is None
  assert streak.see(_tally(None), 4) is None
  assert streak.see(_tally(BOOM), 5) is None
  assert failures.FailureStreak(0).see(_tally(BOOM), 1) is None


# ------------------------------------------------------------------- whole runs
def _lines(workdir):
  path = workdir / "metrics.jsonl"
  return cli.read_jsonl(path) if path.exists() else []


def test_a_reward_that_always_raises_stops_the_run_at_step_1_naming_its_file_and_line(tmp_path):
  (tmp_path / "my_reward.py").write_text(
      'def score(response, answer):\n  raise ValueError("boom")\n'
  )
  spec = f"{tmp_path / 'my_reward.py'}:score"
  run = cli.run(
      f"--config.rollout.reward={spec}",
      "--config.train.sft_steps=0",
      "--config.eval_every=0",
      "--config.num_steps=3",
      config="tiny.py",
      workdir=tmp_path / "run",
  )
  assert run.returncode == 2, run.stderr[-3000:]
  where = f"ValueError: boom ({tmp_path / 'my_reward.py'}:2)"
  err = run.stderr.strip().splitlines()
  assert err[-2].startswith("april_jax: warning: step 1: ") and where in err[-2]
  assert err[-1].startswith(
      "april_jax: every sample of step 1 failed the same way (the reward raised): " + where
  ), err[-1]
  assert "Traceback" not in run.stderr
  assert not [l for l in _lines(tmp_path / "run") if l["step"] >= 1]  # nothing was trained


def test_a_reward_that_fails_some_samples_is_said_each_step_and_counted_in_the_summary(tmp_path):
  (tmp_path / "odd.py").write_text(
      "def score(response, answer):\n"
      "  if len(response) % 2:\n"
      "    raise KeyError(len(response))\n"
      "  return 1.0\n"
  )
  run = cli.run(
      f"--config.rollout.reward={tmp_path / 'odd.py'}:score",
      "--config.train.sft_steps=0",
      "--config.eval_every=0",
      "--config.num_steps=2",
      config="tiny.py",
      workdir=tmp_path / "run",
  )
  assert run.returncode == 0, run.stderr[-3000:]
  warnings = [l for l in run.stderr.splitlines() if l.startswith("april_jax: warning: step ")]
  assert [w.split(":")[2].strip() for w in warnings] == ["step 1", "step 2"], run.stderr[-2000:]
  for w in warnings:
    assert " samples failed: the reward raised for " in w
    assert w.endswith(f"({tmp_path / 'odd.py'}:3)") and "KeyError: " in w
  errors = sum(l["rollout/reward_errors"] for l in _lines(tmp_path / "run"))
  assert errors > 0
  assert f"  failures         {int(errors)} reward errors" in run.stdout


# ------------------------------------------------------------------- environments
def _after_first_turn() -> SampleRecord:
  """An episode's sample after its first turn: two drawn tokens, room for 100 more."""
  return SampleRecord(
      prompt=[1], max_new_tokens=102, rng=[0, 0], response=[5, 6], logprobs=[0, 0], versions=[0, 0]
  )


def test_a_users_environment_holding_the_interpreter_lock_is_killed_at_its_limit(tmp_path):
  (tmp_path / "slow_env.py").write_text(
      "from april_jax.envs.base import EnvStep\n"
      "class Env:\n"
      "  def reset(self, row):\n"
      "    return {}\n"
      "  def step(self, state, turn):\n"
      "    x = 10 ** (10 ** 9)  # holds the interpreter lock for minutes\n"
      "    return EnvStep('1', False, {})\n"
  )
  env = in_workers.load(f"{tmp_path / 'slow_env.py'}:Env", timeout_s=0.5)
  assert isinstance(env, in_workers.ProcessEnv)
  runner = episodes.EpisodeRunner(env, lambda t: [1] * len(t), str, EnvSettings(timeout_s=0.5))
  try:
    first = env.pids()
    records = [_after_first_turn(), _after_first_turn()]
    runner.start(records, [{}, {}])
    start = time.monotonic()
    assert runner.turn(records) == [None, None]  # each episode ends, counted
    assert time.monotonic() - start < 2 * 0.5 + 2.0
    assert runner.counts["env/timeouts"] == 2
    assert records[0].env_error == "step ran past env.timeout_s=0.5 s"
    assert env.pids() and not set(env.pids()) & set(first)  # killed and replaced
  finally:
    runner.close()
  assert not env.pids()


def test_a_users_environment_that_raises_keeps_its_file_and_line(tmp_path):
  (tmp_path / "bad_env.py").write_text(
      "class Env:\n  def reset(self, row):\n    raise RuntimeError('no table for ' + row['q'])\n"
      "  def step(self, state, turn):\n    pass\n"
  )
  env = in_workers.load(f"{tmp_path / 'bad_env.py'}:Env", timeout_s=5.0)
  runner = episodes.EpisodeRunner(env, lambda t: [1] * len(t), str)
  try:
    record = _after_first_turn()
    runner.start([record], [{"q": "x"}])
    why = record.env_error
    assert why == f"reset: RuntimeError: no table for x ({tmp_path / 'bad_env.py'}:3)", why
    assert failures.StepFailures.of([_FakeGroup([record])]).kinds == {"env_error": 1}
  finally:
    runner.close()


class _FakeGroup:

  def __init__(self, samples):
    self.samples, self.n, self.reward_info = samples, len(samples), {}


def test_an_environment_that_cannot_be_made_in_its_worker_is_one_line(tmp_path):
  (tmp_path / "broken_env.py").write_text(
      "class Env:\n  def __init__(self):\n    raise OSError('no sandbox')\n"
  )
  with pytest.raises(in_workers.EnvError, match="making it raised OSError: no sandbox"):
    in_workers.load(f"{tmp_path / 'broken_env.py'}:Env", timeout_s=5.0)


def test_a_users_environment_whose_reset_raises_stops_the_run_naming_it(tmp_path):
  (tmp_path / "my_env.py").write_text(
      "class Env:\n"
      "  def reset(self, row):\n"
      "    raise ValueError('no reset')\n"
      "  def step(self, state, turn):\n"
      "    raise AssertionError('never reached')\n"
  )
  run = cli.run(
      f"--config.env.name={tmp_path / 'my_env.py'}:Env",
      "--config.rollout.max_response_len=64",
      "--config.train.sft_steps=0",
      "--config.eval_every=0",
      "--config.num_steps=2",
      config="tiny_lookup.py",
      workdir=tmp_path / "run",
  )
  assert run.returncode == 2, run.stderr[-3000:]
  last = run.stderr.strip().splitlines()[-1]
  assert last.startswith(
      "april_jax: every sample of step 1 failed the same way (the environment raised): "
      f"reset: ValueError: no reset ({tmp_path / 'my_env.py'}:3)"
  ), last


def test_the_calls_of_one_turn_run_at_once_one_per_worker(tmp_path):
  log = tmp_path / "calls.txt"
  (tmp_path / "slow_tool.py").write_text(
      "import os, time\n"
      "from april_jax.envs.base import EnvStep\n"
      "class Env:\n"
      "  def reset(self, row):\n"
      "    return {}\n"
      "  def step(self, state, turn):\n"
      "    start = time.time(); time.sleep(0.5)\n"
      f"    open({str(log)!r}, 'a').write(f'{{os.getpid()}} {{start}} {{time.time()}}\\n')\n"
      "    return EnvStep('1', True, {})\n"
  )
  env = in_workers.load(f"{tmp_path / 'slow_tool.py'}:Env", timeout_s=10.0, workers=2)
  runner = episodes.EpisodeRunner(env, lambda t: [1] * len(t), str)
  try:
    records = [_after_first_turn(), _after_first_turn()]
    runner.start(records, [{}, {}])
    assert runner.turn(records) == [None, None]
  finally:
    runner.close()
  (a_pid, a_start, a_end), (b_pid, b_start, b_end) = [
      [float(x) for x in line.split()] for line in log.read_text().splitlines()
  ]
  assert a_pid != b_pid and max(a_start, b_start) < min(a_end, b_end)  # they overlapped
