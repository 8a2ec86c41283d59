"""Environment calls off the decode path: parked slots, calls that run while others decode,
calls past their limit ended, calls cut at a step's end, and reset's first messages."""

import itertools
import json
import os
import threading
import time

import jax
import numpy as np
import pytest

from april_jax.data import PromptItem
from april_jax.validation.checks import ConfigError, validate
from april_jax.envs import base, in_workers
from april_jax.rollout import episodes
from april_jax.models import qwen3
from april_jax.rollout import AprilScheduler, RewardRunner, RolloutSettings
from april_jax.rollout.failures import FailureStreak, StepFailures
from april_jax.sampler import EngineConfig, SlotEngine
from april_jax.settings.env import EnvSettings
from conftest import load_config, sampler_qwen3, step_at

CFG = sampler_qwen3()
PARAMS = qwen3.init_params(CFG, jax.random.key(0), std=0.35)
STOPS = (3, 17, 29, 41, 55, 68, 80, 91)


def encode(text):
  return [int(t) for t in text.split()]


def decode(ids):
  return " ".join(str(int(i)) for i in ids)


class Tool:
  """Three turns; turn k's observation is 6 tokens that depend on the turn's text. Each
  call sleeps `delay` seconds (a slow tool); rows with level % hang_every == 0 hang."""

  def __init__(self, delay=0.0, hang_every=0):
    self.delay, self.hang_every = delay, hang_every

  def reset(self, row):
    return {"turns": 0, "level": row["level"]}

  def step(self, state, turn):
    if self.hang_every and state["level"] % self.hang_every == 0:
      time.sleep(60)
    time.sleep(self.delay)
    state = {"turns": state["turns"] + 1, "level": state["level"]}
    if state["turns"] == 3:
      return base.EnvStep(observation=None, done=True, state=state)
    seen = sum(encode(turn)) + state["turns"]
    obs = [(seen + 7 * j) % CFG.vocab_size for j in range(6)]
    obs = [t + 1 if t in STOPS else t for t in obs]
    return base.EnvStep(observation=decode(obs), done=False, state=state)


def _scheduler(
    env, overlap=True, num_slots=4, workers=4, timeout_s=10.0, batch_size=2, agree=None, leader=True
):
  config = EngineConfig(
      num_slots=num_slots, max_len=128, sync_every=4, stop_ids=STOPS, hold_stopped=True
  )
  engine = SlotEngine(CFG, PARAMS, config)
  counter = itertools.count()

  def source():
    i = next(counter)
    prompt = np.random.default_rng(i).integers(0, CFG.vocab_size, 3 + i % 4)
    return PromptItem(prompt_id=i, tokens=prompt, answer=str(i), row={"level": i})

  rewards = RewardRunner(lambda text, answer: 1.0, decode=decode, timeout_s=5.0, processes=False)
  settings = RolloutSettings(
      batch_size=batch_size,
      n_samples_per_prompt=2,
      over_sampling_batch_size=batch_size + 1,
      max_response_len=90,
      temperature=1.0,
  )
  runner = episodes.EpisodeRunner(
      env,
      encode,
      decode,
      EnvSettings(overlap=overlap, workers=workers, timeout_s=timeout_s),
      render=lambda messages: encode(" ".join(m["content"] for m in messages)),
      agree=agree,
      leader=leader,
  )
  return AprilScheduler(engine, settings, source, rewards, episodes=runner)


def _samples(scheduler, steps):
  """{(prompt id, index): response} of every sample trained over `steps` steps."""
  out = {}
  for step in range(steps):
    for group in step_at(scheduler, step, 0).groups:
      for s in group.samples:
        assert (group.prompt_id, s.index) not in out  # nothing trains twice
        out[(group.prompt_id, s.index)] = (s.response.tolist(), s.episode.observations)
  return out


@pytest.fixture(scope="module")
def waited():
  """Every call waited for after the decode call that ended its turn (reproducible)."""
  return _samples(_scheduler(Tool(), overlap=False), 3)


def test_calls_that_overlap_decoding_and_slots_set_aside_draw_what_waited_calls_draw(waited):
  s = _scheduler(Tool(delay=0.05))
  engine_step, overlaps = s.engine.step, []

  def step(**kw):  # decode calls made while some calls ran
    overlaps.append(bool(s.episodes.pending) and s.engine.num_decoding > 0)
    return engine_step(**kw)

  s.engine.step = step
  engine_set_aside, set_aside = s.engine.set_aside, []
  s.engine.set_aside = lambda r: (set_aside.append(r), engine_set_aside(r))
  overlapped = _samples(s, 3)
  common = set(overlapped) & set(waited)
  assert len(common) >= 6
  for key in common:
    assert overlapped[key] == waited[key], key
  assert all(len(spans) == 2 for _, spans in overlapped.values())  # three turns each
  assert sum(overlaps) > len(overlaps) / 4  # slots decoded while calls ran
  assert set_aside  # samples waited for slots: parked ones gave theirs up


def test_slots_set_aside_are_counted_and_their_return_is_not_a_partial():
  s = _scheduler(Tool(delay=0.05))
  engine = s.engine
  set_aside, carried, partials = [], set(), []
  engine_set_aside, engine_admit, engine_preempted = (
      engine.set_aside,
      engine.admit,
      engine.take_preempted,
  )
  engine.set_aside = lambda r: (set_aside.append(r), engine_set_aside(r))

  def take_preempted():  # a preempted sample is a partial when it comes back
    out = engine_preempted()
    carried.update(id(r) for r in out)
    return out

  def admit(records, **kw):
    partials.append(sum(id(r) in carried for r in records))
    carried.difference_update(id(r) for r in records)
    return engine_admit(records, **kw)

  engine.take_preempted, engine.admit = take_preempted, admit
  for step in range(4):  # the samples carried from the last step are the partials
    carried = {id(r) for g in s.buffer for r in g.samples if r.started and not r.finished}
    set_aside.clear(), partials.clear()
    stats = step_at(s, step, 0).stats
    assert stats.get("env/set_aside", 0) == len(set_aside), step
    assert stats.get("partial_samples", 0) == sum(partials), step
  assert s.episodes.counts["env/set_aside"] > 0  # samples waited for slots


class CountedTool(Tool):

  def __init__(self, delay):
    super().__init__(delay)
    self.calls = 0

  def step(self, state, turn):
    self.calls += 1
    return super().step(state, turn)


def test_with_overlapping_calls_two_hosts_see_the_same_episodes(waited):
  """Two processes of a run as two threads: process 0 alone calls the environment and
  decides which calls have returned; `agree` (JSON, as between hosts) gives that to the
  other, which must then draw the same tokens, whatever the calls' timing."""
  barrier, box = threading.Barrier(2, timeout=120), [None]

  def agree(leader):
    def share(outcome):
      if leader:
        box[0] = json.dumps(outcome)
      barrier.wait()
      value = json.loads(box[0])
      barrier.wait()  # both read it before the next call writes
      return value

    return share

  tools = [CountedTool(delay=0.05), CountedTool(delay=0.05)]
  schedulers = [_scheduler(tools[i], agree=agree(i == 0), leader=i == 0) for i in range(2)]
  samples, errors = [None, None], []

  def host(i):
    try:
      samples[i] = _samples(schedulers[i], 3)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
      barrier.abort()

  threads = [threading.Thread(target=host, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=300)
  assert not errors, errors
  assert samples[0] == samples[1] and len(samples[0]) >= 6
  assert tools[0].calls > 0 and tools[1].calls == 0  # only process 0 called it
  for key in set(samples[0]) & set(waited):  # and what one process draws
    assert samples[0][key] == waited[key], key


def test_an_episode_cut_while_its_call_runs_resumes_with_its_observation(waited):
  s = _scheduler(Tool(delay=0.3))
  cut = step_at(s, 0, 0, cut_now=lambda: bool(s.episodes.pending))
  assert cut.cut and s.episodes.counts["env/calls_cut"] >= 1
  waiting = [r for g in s.buffer for r in g.samples if s.episodes.awaits(r)]
  assert waiting and all(r.engine_status is None for r in waiting)
  cut_keys = {(s.buffer.get(r.group_id).prompt_id, r.index) for r in waiting}
  resumed = _samples(s, 3)
  assert cut_keys <= set(resumed)  # each trained, whole: three turns, two observations
  assert all(len(resumed[key][1]) == 2 for key in cut_keys)
  for key in set(resumed) & set(waited):
    assert resumed[key] == waited[key], key


def test_a_checkpoint_waits_for_running_calls_and_a_resumed_run_loses_none(waited):
  s = _scheduler(Tool(delay=0.3))
  step_at(s, 0, 0, cut_now=lambda: bool(s.episodes.pending))
  assert s.episodes.pending
  arrays, host = s.checkpoint()
  assert not s.episodes.pending  # answered into the buffer
  given = [r for g in s.buffer for r in g.samples if r.episode and r.episode.observations]
  assert given and all(r.logprobs[r.episode.observations[-1][0]] == 0 for r in given)
  fresh = _scheduler(Tool())
  fresh.restore({k: np.array(v) for k, v in arrays.items()}, host)
  fresh._prompt_source = s._prompt_source  # the data where it was
  resumed = _samples(fresh, 3)
  for key in set(resumed) & set(waited):
    assert resumed[key] == waited[key], key


HANGS = """
import time
class Hangs:
  def reset(self, row):
    return {"level": row["level"]}
  def step(self, state, turn):
    if state["level"] % 3 == 0:
      time.sleep(120)
    from april_jax.envs.base import EnvStep
    return EnvStep(observation=None, done=True, state=state)
"""


def test_a_call_past_its_limit_is_ended_and_counted_while_other_episodes_finish(tmp_path):
  (tmp_path / "hangs.py").write_text(HANGS)
  env = in_workers.load(f"{tmp_path / 'hangs.py'}:Hangs", timeout_s=1.0, workers=2)
  try:
    s = _scheduler(env, workers=2, timeout_s=1.0, batch_size=3)
    pids = set(env.pids())
    result = step_at(s, 0, 0)
    samples = [r for g in result.groups for r in g.samples]
    hung = [r for r in samples if r.episode.error]
    assert s.episodes.counts["env/timeouts"] >= 2 and hung
    assert all("ran past env.timeout_s=1 s" in r.episode.error for r in hung)
    assert any(r.episode.error is None and r.episode.turns == 1 for r in samples)
    ended = pids - set(env.pids())  # the hung calls' workers were killed (and replaced)
    assert ended
    for pid in ended:
      with pytest.raises(OSError):
        os.kill(pid, 0)
  finally:
    env.close()


class Greets(Tool):
  """reset gives the episode's first messages: a system prompt and the task."""

  def reset(self, row):
    messages = [
        {"role": "system", "content": "90 91"},
        {"role": "user", "content": f"{row['level'] % 50} 7"},
    ]
    return base.EnvReset(state={"turns": 0, "level": row["level"]}, messages=messages)


def test_reset_messages_become_the_group_s_prompt():
  s = _scheduler(Greets())
  result = step_at(s, 0, 0)
  for group in result.groups:
    expected = [90, 91, group.prompt_id % 50, 7]
    assert group.prompt.tolist() == expected
    assert all(r.prompt.tolist() == expected for r in group.samples)
    assert all(r.episode.turns >= 1 for r in group.samples)


class NoState(Tool):

  def reset(self, row):
    return base.EnvReset()


class SetState(Tool):

  def step(self, state, turn):
    return base.EnvStep(observation="5", done=False, state={1, 2})


@pytest.mark.parametrize(
    "env, says",
    [
        (NoState(), "reset returned an EnvReset with neither state nor messages"),
        (SetState(), "the environment's state is not JSON"),
    ],
)
def test_an_environment_that_always_fails_stops_the_run_in_one_line_naming_it(env, says):
  s = _scheduler(env)
  result = step_at(s, 0, 0)
  why = FailureStreak(max_failed_steps=3).see(StepFailures.of(result.groups), 0)
  assert why is not None and says in why and "\n" not in why


def test_a_tool_pool_of_zero_is_one_line_naming_it():
  config = load_config("tiny_lookup")
  config.env.workers = 0
  with pytest.raises(ConfigError, match=r"env.workers must be >= 1, got 0") as info:
    validate(config)
  assert [l.strip() for l in str(info.value).splitlines()[1:]] == [
      "env.workers must be >= 1, got 0"
  ]
