"""The reward runner in worker processes: a pathological answer costs its time limit and
no more, a raising reward is counted, killed workers are replaced, close leaves nothing."""

import json
import signal
import time

import numpy as np

from april_jax.rewards.math import math_reward
from april_jax.rollout import Group, RewardRunner
from april_jax.sampler import SampleRecord
import cli
from record_builders import text_of

TOWER = "\\boxed{10^{10^{10}}}"  # sympy would compute 10**(10**10) holding the GIL


def _group(group_id: int, answer: str, responses: list[str]) -> Group:
  samples = [
      SampleRecord(
          prompt=np.array([1], np.int32),
          max_new_tokens=len(text),
          rng=np.zeros(2),
          response=[ord(c) for c in text],
          logprobs=np.zeros(len(text)),
          versions=np.zeros(len(text)),
      )
      for text in responses
  ]
  return Group(
      group_id=group_id,
      prompt_id=group_id,
      prompt=samples[0].prompt,
      answer=answer,
      samples=samples,
      first_step=0,
  )


SLACK_S = 10.0


def test_a_pathological_answer_costs_its_time_limit_and_the_workers_recover():
  runner = RewardRunner(
      math_reward, text_of, num_workers=2, timeout_s=1.0, fallback=-1.0, processes=True
  )
  try:
    runner.wait_for([_group(0, "7", ["so \\boxed{7}"])])  # workers up and warm
    start = time.monotonic()
    tower, fine = _group(1, "7", [f"so {TOWER}", TOWER]), _group(2, "7", ["\\boxed{7}", "8"])
    runner.submit(tower)
    runner.submit(fine)
    runner.wait_for([tower, fine])
    elapsed = time.monotonic() - start
    # The time limit, plus a killed worker's replacement starting: a second alone, several
    # on two cores that a test run keeps busy. Unbounded (the tower never returns) without.
    assert elapsed < 1.0 + SLACK_S, elapsed
    assert tower.rewards == [-1.0, -1.0] and tower.reward_info["timeouts"] == 2
    assert fine.rewards == [1.0, 0.0] and runner.timeouts == 2
    # A gold answer that is itself the tower: the same bound; then the workers still score.
    gold_tower = _group(3, TOWER, ["\\boxed{5}"])
    after = _group(4, "12", ["\\boxed{12}", "\\boxed{13}"])
    start = time.monotonic()
    runner.submit(gold_tower)
    runner.submit(after)
    runner.wait_for([gold_tower, after])
    assert time.monotonic() - start < 1.0 + SLACK_S
    assert gold_tower.rewards == [-1.0] and after.rewards == [1.0, 0.0]
  finally:
    start = time.monotonic()
    runner.close()
  assert time.monotonic() - start < 5.0
  assert not any(p.is_alive() for p in runner._workers._all)


def _raises(text: str, answer: str) -> float:
  raise ValueError(f"cannot score {text!r}")


def test_a_reward_that_raises_in_a_worker_gets_the_fallback_and_is_counted():
  runner = RewardRunner(
      _raises, text_of, num_workers=1, timeout_s=5.0, fallback=-1.0, processes=True
  )
  try:
    group = _group(0, "1", ["a", "b"])
    runner.submit(group)
    runner.wait_for([group])
    assert group.rewards == [-1.0, -1.0] and group.reward_info["errors"] == 2
    assert runner.errors == 2 and runner.timeouts == 0
  finally:
    runner.close()


def test_a_run_whose_rewards_run_away_steps_on_and_ends_within_10_s_of_sigterm(tmp_path):
  # `main` on the built-in task with a reward (tests/runaway_reward.py) that never returns.
  proc = cli.launch(
      "--config.rollout.reward=runaway_for_tests",
      "--config.rollout.dynamic_sampling=False",  # every reward is the fallback
      "--config.rollout.reward_timeout_s=1.0",
      "--config.rollout.max_failed_steps=0",  # a run that goes on whatever fails
      "--config.rollout.reward_workers=4",
      "--config.rollout.batch_size=2",
      "--config.rollout.n_samples_per_prompt=2",
      "--config.rollout.over_sampling_batch_size=2",
      "--config.rollout.partial_rollout=False",
      "--config.rollout.num_slots=4",
      "--config.train.sft_steps=0",
      "--config.eval_every=0",
      "--config.checkpoint_every=0",
      "--config.num_steps=200",
      config="tiny.py",
      workdir=tmp_path,
      preload="runaway_reward",
      optimised=False,
  )
  metrics = tmp_path / "metrics.jsonl"
  deadline = time.monotonic() + 300
  while proc.poll() is None and time.monotonic() < deadline:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
      break
    time.sleep(0.1)
  assert proc.poll() is None, proc.communicate()[1][-3000:]
  lines = [json.loads(l) for l in metrics.read_text().splitlines()[:3]]
  assert [l["rollout/reward_timeouts"] for l in lines] == [4, 4, 4]  # every sample, killed
  assert all(l["rollout/reward_mean"] == 0.0 for l in lines)  # the fallback
  # Four runaway rewards on four workers: a step costs the time limit plus under a second.
  assert lines[2]["time/step_s"] < 1.0 + 1.0, lines[2]["time/step_s"]
  start = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=60)
  # The step is cut at once; a checkpoint and the shutdown: about 3 s beside another test
  # process; a runaway reward that held the exit would never end.
  assert time.monotonic() - start < 10.0
  assert proc.returncode == 143, err[-3000:]  # stopped by SIGTERM, saved
