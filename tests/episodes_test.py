"""Multi-turn episodes: observations fed in place, cuts and resumes, loss masks, the env."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest

from april_jax import sampler
from april_jax.data import PromptItem
from april_jax.envs import base
from april_jax.rollout import episodes
from april_jax.envs.observation_format import TextFormat
from april_jax.sampler.episode_state import Episode
from april_jax.models import qwen3
from april_jax.rl import batch as batch_lib
from april_jax.rollout import AprilScheduler, PartialBuffer, RewardRunner, RolloutSettings
from april_jax.rollout import rollout_metrics
from april_jax.rollout.group import Group
from april_jax.sampler import EngineConfig, SampleRecord, SlotEngine
from april_jax.sampler.records import Status
from april_jax.validation import checks as validate
from april_jax.settings.env import EnvSettings
from conftest import QWEN3_TOKENIZER_DIR, load_config, sampler_qwen3, step_at
from record_builders import teacher_forced_logprobs

CFG = sampler_qwen3()
PARAMS = qwen3.init_params(CFG, jax.random.key(0), std=0.35)
STOPS = (3, 17, 29, 41, 55, 68, 80, 91)  # a turn ends on any of these
OBS_START = 200  # a scripted observation's token ids, decoded from their text


def encode(text):
  return [int(t) for t in text.split()]


def decode(ids):
  return " ".join(str(int(i)) for i in ids)


class ScriptedEnv:
  """Answers turn k with k + 5 tokens that depend on what the model wrote; done after the
  fourth turn. Its state (JSON) counts turns and sums the turns' tokens."""

  def reset(self, row):
    return {"turns": 0, "seen": 0, "row": row["answer"]}

  def step(self, state, turn):
    ids = encode(turn)
    state = {"turns": state["turns"] + 1, "seen": state["seen"] + sum(ids), "row": state["row"]}
    if state["turns"] == 4:
      return base.EnvStep(observation=None, done=True, state=state, reward=1.0)
    obs = [(state["seen"] + j) % CFG.vocab_size for j in range(state["turns"] + 4)]
    obs = [t if t not in STOPS else t + 1 for t in obs]  # given tokens never stop a slot
    return base.EnvStep(observation=decode(obs), done=False, state=state, reward=0.5)


def _runner(**settings):
  return episodes.EpisodeRunner(ScriptedEnv(), encode, decode, EnvSettings(**settings))


def _engine(num_slots=2, sync_every=3):
  config = EngineConfig(
      num_slots=num_slots, max_len=128, sync_every=sync_every, stop_ids=STOPS, hold_stopped=True
  )
  return SlotEngine(CFG, PARAMS, config)


def _record(seed=0, budget=90):
  prompt = np.random.default_rng(seed).integers(0, CFG.vocab_size, 6).astype(np.int32)
  return SampleRecord(
      prompt=prompt, max_new_tokens=budget, rng=sampler.sample_keys(seed, 1)[0], temperature=1.0
  )


def _drawn(record: SampleRecord, tokens) -> SampleRecord:
  """The record after the model drew `tokens` (logprob 0, version 0), as an engine's
  read-back leaves it."""
  n = len(record.response) + len(tokens)
  return dataclasses.replace(
      record,
      response=np.concatenate([record.response, np.asarray(tokens, np.int32)]),
      logprobs=np.zeros(n, np.float32),
      versions=np.zeros(n, np.int32),
  )


def _through_buffer(record, with_kv):
  """The partial as a checkpoint stores and restores it."""
  group = Group(0, 0, record.prompt, "", [record], first_step=0)
  buffer = PartialBuffer()
  buffer.add(group)
  state = {k: np.array(v) for k, v in buffer.to_state().items()}
  (restored,) = PartialBuffer.from_state(state).get(0).samples
  assert restored.has_kv == with_kv
  return restored


def _episode(cut=None, mode="kv", seed=0):
  """One episode to its end. cut: None; "turn" (snapshot whenever an observation has
  just been given, before it is fed); "every" (snapshot after every decode call:
  mid-turn, and mid-observation). A cut sample goes through the checkpoint format and
  comes back in another slot."""
  engine, runner = _engine(), _runner()
  record = _record(seed)
  runner.start([record], [{"answer": "gold"}])
  engine.admit([record])
  cuts = 0
  while True:
    cut_now = cut == "every"
    for r in engine.step():
      if r.index == "blocker":
        if engine.holds(r):
          engine.release(r)
        continue
      if r.status is Status.HELD:
        observation = runner.turn([r])[0]
        if observation is not None:
          engine.extend(r, observation)
          cut_now = cut_now or cut == "turn"
          continue
        engine.release(r)
      return r, cuts
    if cut_now and engine.num_live:
      (partial,) = engine.snapshot(with_kv=mode == "kv")
      record = _through_buffer(partial, with_kv=mode == "kv")
      if engine.num_free == 2:  # resume in the other slot
        blocker = dataclasses.replace(_record(seed=99, budget=1), index="blocker")
        engine.admit([blocker])
      engine.admit([record], mode=mode)
      cuts += 1


@pytest.fixture(scope="module")
def uncut():
  record, _ = _episode()
  return record


def test_an_episode_feeds_observations_in_place_and_draws_over_them_exactly(uncut):
  episode = uncut.episode
  assert episode.turns == 4 and episode.state["turns"] == 4 and episode.reward == 1.0
  assert len(episode.observations) == 3 and uncut.finish_reason == "stop"
  mask = uncut.drawn_mask
  for k, (start, end) in enumerate(episode.observations):
    assert end - start == k + 5  # turn k + 1's observation, whole
    assert uncut.response[start - 1] in STOPS  # right after the turn's stop token
    np.testing.assert_array_equal(uncut.logprobs[start:end], 0.0)
  # Every drawn token's logprob is that of one forward over the whole episode: the KV
  # grown over the observations in the slot is the KV of the full sequence.
  drawn = mask > 0
  np.testing.assert_allclose(
      uncut.logprobs[drawn],
      teacher_forced_logprobs(CFG, PARAMS, uncut, padded_len=128)[drawn],
      atol=1e-4,
  )
  stops_drawn = [i for i, t in enumerate(uncut.response) if drawn[i] and t in STOPS]
  assert len(stops_drawn) == 4  # one per turn, the last ending the episode


@pytest.mark.parametrize("mode", ["kv", "recompute"])
@pytest.mark.parametrize("cut", ["turn", "every"])
def test_an_episode_cut_and_resumed_equals_the_uncut_one(uncut, cut, mode):
  record, cuts = _episode(cut=cut, mode=mode)
  assert cuts >= (3 if cut == "turn" else 10)
  np.testing.assert_array_equal(record.response, uncut.response)
  np.testing.assert_allclose(record.logprobs, uncut.logprobs, atol=1e-4)
  for key in ("observations", "turns", "state", "reward"):
    assert getattr(record.episode, key) == getattr(uncut.episode, key), key


def test_loss_mask_leaves_out_exactly_the_observation_tokens(uncut):
  spans = uncut.episode.observations
  observed = sum(end - start for start, end in spans)
  assert observed == 5 + 6 + 7
  group = Group(0, 0, uncut.prompt, "", [uncut], first_step=0, rewards=[0.0])
  arrays = batch_lib.TrainBatch.from_groups([group], version=0).rows()
  P, R = len(uncut.prompt), len(uncut.response)
  mask = arrays["mask"][0]
  assert mask.sum() == R - observed
  for start, end in spans:  # position t predicts token t + 1
    np.testing.assert_array_equal(mask[P - 1 + start : P - 1 + end], 0.0)
    assert mask[P - 2 + start] == 1.0  # the turn's stop token is trained


class _Raises:

  def reset(self, row):
    return {}

  def step(self, state, turn):
    raise RuntimeError("the tool crashed")


class _Exits(_Raises):

  def step(self, state, turn):
    raise SystemExit(3)  # a tool that calls sys.exit: it ended the run


class _Hangs(_Raises):

  def step(self, state, turn):
    import time

    time.sleep(5)


class _BadState(ScriptedEnv):

  def step(self, state, turn):
    out = super().step(state, turn)
    return base.EnvStep(out.observation, out.done, {"handle": object()})


class _CannotReset(ScriptedEnv):

  def reset(self, row):
    raise KeyError("level")


class _Chatty(ScriptedEnv):

  def step(self, state, turn):
    out = super().step(state, turn)
    return base.EnvStep(" ".join(["7"] * 40), out.done, out.state) if not out.done else out


def _to_the_end(runner):
  """One episode of `runner`'s environment, run to its end on an engine of its own."""
  engine, record = _engine(), _record()
  runner.start([record], [{"answer": ""}])
  engine.admit([record])
  while engine.num_live:
    for r in engine.step():
      if r.status is Status.HELD:
        observation = runner.turn([r])[0]
        if observation is not None:
          engine.extend(r, observation)
          continue
        engine.release(r)
  return record


@pytest.mark.parametrize(
    "env, settings, count",
    [
        (_Raises(), {}, "env/errors"),
        (_Exits(), {}, "env/errors"),
        (_BadState(), {}, "env/errors"),
        (_CannotReset(), {}, "env/errors"),
        (_Hangs(), {"timeout_s": 0.2}, "env/timeouts"),
        (ScriptedEnv(), {"max_turns": 2}, "env/turn_limit"),
        (
            _Chatty(),
            {"max_observation_tokens": 10, "observation_template": "1 {observation} 2"},
            "env/observations_cut",
        ),
    ],
)
def test_an_environment_that_fails_or_overruns_ends_or_cuts_the_episode_counted(
    env, settings, count
):
  template = settings.pop("observation_template", "{observation}")
  runner = episodes.EpisodeRunner(
      env, encode, decode, EnvSettings(**settings), observations=TextFormat(encode, template)
  )
  record = _to_the_end(runner)
  assert record.finished and runner.counts[count] >= 1
  if count in ("env/errors", "env/timeouts"):
    assert record.env_error is not None and record.episode.turns == 1
  if count == "env/turn_limit":
    assert record.episode.turns == 2 and len(record.episode.observations) == 1
  if count == "env/observations_cut":  # the observation is cut, not the template around it
    for start, end in record.episode.observations:
      assert end - start == 12 and record.response[start] == 1 and record.response[end - 1] == 2


class _Floods(ScriptedEnv):

  def step(self, state, turn):
    out = super().step(state, turn)
    return base.EnvStep("7 " * 1_000_000, out.done, out.state) if not out.done else out


def test_a_huge_observation_is_cut_before_it_is_tokenized():
  """A 2 MB observation was tokenized whole (seconds of a real tokenizer, outside the
  environment's time limit), then cut to max_observation_tokens."""
  longest = []

  def spying_encode(text):
    longest.append(len(text))
    return encode(text)

  settings = EnvSettings(max_observation_tokens=10)
  runner = episodes.EpisodeRunner(
      _Floods(),
      spying_encode,
      decode,
      settings,
      observations=TextFormat(spying_encode, "1 {observation} 2"),
  )
  record = _to_the_end(runner)
  assert record.finished and runner.counts["env/observations_cut"] >= 1
  assert max(longest) <= 10 * episodes.MAX_CHARS_PER_TOKEN
  for start, end in record.episode.observations:
    assert end - start == 12 and record.response[start] == 1 and record.response[end - 1] == 2


# ------------------------------------------------------------------- the scheduler


def _scheduler(
    reward=lambda text, answer: float(len(text.split()) % 3 == 0),
    first_prompt=0,
    num_slots=4,
    sync_every=4,
    n=2,
):
  engine = _engine(num_slots=num_slots, sync_every=sync_every)
  counter = itertools.count(first_prompt)

  def source():
    i = next(counter)
    prompt = np.random.default_rng(i).integers(0, CFG.vocab_size, 3 + i % 4)
    return PromptItem(prompt_id=i, tokens=prompt, answer=str(i), row={"level": i})

  runner = RewardRunner(reward, decode=decode, timeout_s=5.0, fallback=-1.0, processes=False)
  settings = RolloutSettings(
      batch_size=2,
      n_samples_per_prompt=n,
      over_sampling_batch_size=3,
      max_response_len=60,
      temperature=1.0,
  )
  # Every call answered right after the decode call that ended its turn: runs compared
  # token for token cannot depend on when a call's thread returns (env.overlap).
  return AprilScheduler(engine, settings, source, runner, episodes=_runner(overlap=False))


def _trained(result):
  return [
      (g.prompt_id, s.response.tolist(), s.episode.observations)
      for g in result.groups
      for s in g.samples
  ]


def test_kill_and_resume_mid_episode_equals_the_uninterrupted_run():
  a = _scheduler()
  uninterrupted = [_trained(step_at(a, step, 0)) for step in range(4)]
  b = _scheduler()
  first = [_trained(step_at(b, step, 0)) for step in range(2)]
  arrays, host = b.checkpoint()
  mid_episode = [
      s for g in b.buffer for s in g.samples if s.started and not s.finished and s.episode.turns
  ]
  assert mid_episode  # the cut fell inside episodes that had taken turns
  # A new process: new engine and env, the checkpoint's buffer, the data where it was.
  c = _scheduler(first_prompt=max(g.prompt_id for g in b.buffer) + 1)
  c.restore({k: np.array(v) for k, v in arrays.items()}, host)
  resumed = first + [_trained(step_at(c, step, 0)) for step in range(2, 4)]
  assert resumed == uninterrupted
  assert sum(len(spans) for step in uninterrupted for _, _, spans in step) > 4


class _Coin(ScriptedEnv):
  """Ends an episode at a turn of an odd number of tokens: siblings part ways."""

  def step(self, state, turn):
    out = super().step(state, turn)
    return base.EnvStep(None, True, out.state) if len(encode(turn)) % 2 else out


def test_every_episode_trains_once_and_whole_even_when_siblings_end_turns_together():
  # Slots to spare: decoding runs on through finishes, so one decode call can end one
  # sibling's episode and another's turn; the group is complete only after both.
  s = _scheduler(num_slots=16, sync_every=16, n=4)
  s.episodes = episodes.EpisodeRunner(_Coin(), encode, decode)
  trained = []
  for step in range(6):
    for group in step_at(s, step, step).groups:
      trained.append(group.prompt_id)
      for x in group.samples:
        assert x.finished and x.episode.turns >= 1
        spans, stop_ended = x.episode.observations, x.response[-1] in STOPS
        # An episode the environment ended answered every turn but its last.
        assert len(spans) == x.episode.turns - 1 or not stop_ended
        assert all(x.response[b - 1] in STOPS for b, _ in spans)
  assert len(trained) == len(set(trained)) == 12
  assert s.totals["trained"] == 12


def test_scheduler_counts_turns_and_masks_observations_in_its_metrics():
  s = _scheduler()
  result = step_at(s, 0, 0)
  metrics = rollout_metrics(result, 0)
  samples = [x for g in result.groups for x in g.samples]
  observed = sum(e - b for x in samples for b, e in x.episode.observations)
  total = sum(len(x.response) for x in samples)
  assert metrics["rollout/env/turns"] >= sum(x.episode.turns for x in samples) > 0
  assert metrics["rollout/observation_token_frac"] == pytest.approx(observed / total)


def test_a_sample_whose_environment_failed_gets_the_fallback_reward():
  engine = _engine(num_slots=4, sync_every=4)
  items = iter(range(100))
  source = lambda: PromptItem(
      prompt_id=(i := next(items)), tokens=np.arange(3 + i % 3, dtype=np.int32), answer=""
  )
  runner = RewardRunner(
      lambda text, answer: 1.0, decode=decode, timeout_s=5.0, fallback=-1.0, processes=False
  )
  settings = RolloutSettings(
      batch_size=1, n_samples_per_prompt=2, over_sampling_batch_size=1, max_response_len=60
  )
  env = episodes.EpisodeRunner(_Raises(), encode, decode)
  result = AprilScheduler(engine, settings, source, runner, episodes=env).step(0)
  (group,) = result.groups
  for sample, reward in zip(group.samples, group.rewards):
    assert reward == (-1.0 if sample.env_error is not None else 1.0)
  assert result.stats["env/errors"] == sum(x.env_error is not None for x in group.samples) > 0


def test_an_engine_and_scheduler_disagreeing_on_episodes_is_refused():
  engine = SlotEngine(CFG, PARAMS, EngineConfig(num_slots=2, max_len=64))
  runner = RewardRunner(lambda t, a: 0.0, decode=decode, processes=False)
  settings = RolloutSettings(batch_size=1, n_samples_per_prompt=1, over_sampling_batch_size=1)
  with pytest.raises(ValueError, match="hold_stopped"):
    AprilScheduler(engine, settings, lambda: None, runner, episodes=_runner())


# ------------------------------------------------------------- configs and the CLI


def test_gsm8k_tool_config_answers_each_qwen3_tool_call_in_the_template_s_tool_role():
  from april_jax.rollout import run_episodes  # pylint: disable=g-import-not-at-top
  from april_jax.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top

  c = load_config("gsm8k_tool")
  problems = []
  validate._checks_env(c, problems.append)  # pylint: disable=protected-access
  assert not problems  # (the run itself: real_data_test.py)
  tok = Tokenizer.from_pretrained(QWEN3_TOKENIZER_DIR)
  runner, turn_stop_ids = run_episodes.runner_for(c, tok)
  assert turn_stop_ids == ()  # a turn ends where a chat turn does: no call is hidden
  call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
  turn = "Half of 48, and twice that:\n" + call % "48 / 2" + "\n" + call % "48 * 2"
  record = SampleRecord(prompt=[1, 2], max_new_tokens=200, rng=[0, 0])
  runner.start([record], [{"answer": "24"}])
  record = _drawn(record, tok.encode(turn) + [tok.stop_ids[0]])
  observation = runner.turn([record])[0]
  assert tok.decode(observation.tolist()) == (  # thinking off (data.enable_thinking)
      "\n<|im_start|>user\n<tool_response>\n24\n</tool_response>\n<tool_response>\n96\n"
      "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
  )
  assert record.episode.state == {"calls": 1} and record.episode.observations == [
      [len(record.response), len(record.response) + len(observation)]
  ]
  # A turn that ends on <|im_end|> with no call is the final answer.
  record.give(observation, 0)
  record = _drawn(record, tok.encode("\\boxed{24}") + [tok.stop_ids[0]])
  assert runner.turn([record])[0] is None and runner.counts["env/episodes_done"] == 1
  runner.close()


def test_a_held_slot_stays_parked_with_its_pages_while_the_other_slots_decode():
  engine = _engine()
  record, other = _record(0), _record(1)
  engine.admit([record, other])
  with pytest.raises(ValueError, match="not held in a slot at a stop"):
    engine.extend(record, [5])  # still decoding
  stopped = []
  while not stopped:
    stopped = [r for r in engine.step() if r.status is Status.HELD]
  held = stopped[0]
  going = other if held is record else record
  slot = engine.slots.slot_of(held)
  pages, length = engine.kv.table()[slot].copy(), int(engine.slots.lengths[slot])
  if engine.holds(going) and going.status is Status.LIVE:
    before = engine.counters.tokens_generated
    engine.step()  # the other slot decodes; the held one does not move
    assert engine.counters.tokens_generated > before
  assert held.status is Status.HELD and engine.num_decoding == (
      1 if engine.holds(going) and going.status is Status.LIVE else 0
  )
  np.testing.assert_array_equal(engine.kv.table()[slot], pages)
  assert int(engine.slots.lengths[slot]) == length
  with pytest.raises(ValueError, match="no room"):
    engine.extend(held, np.ones(held.budget_left, np.int32))
  engine.release(held)
  with pytest.raises(ValueError, match="not held"):
    engine.release(held)


def test_on_several_hosts_process_0_answers_and_every_process_applies_the_same_outcome():
  outcomes = []

  def share(outcome):  # process 0's side of the collective: what it broadcasts
    outcomes.append(outcome)
    return outcome

  class Unreachable(ScriptedEnv):

    def reset(self, row):
      raise AssertionError("only process 0 calls the environment")

    step = reset

  leader = episodes.EpisodeRunner(ScriptedEnv(), encode, decode, agree=share)
  follower = episodes.EpisodeRunner(
      Unreachable(), encode, decode, agree=lambda _: outcomes[-1], leader=False
  )
  records = [_record(5), _record(5)]
  for runner, record in zip((leader, follower), records):
    runner.start([record], [{"answer": "a"}])
  for turn in range(4):
    given = []
    for i, runner in enumerate((leader, follower)):
      records[i] = record = _drawn(records[i], [10 + turn, STOPS[0]])
      given.append(runner.turn([record])[0])
      if given[-1] is not None:
        record.give(given[-1], 0)
    assert (given[0] is None) == (given[1] is None) == (turn == 3)
    if turn < 3:
      np.testing.assert_array_equal(given[0], given[1])
  assert records[0].episode == records[1].episode and leader.counts == follower.counts


def test_a_group_reward_gets_each_episode_and_a_failed_environment_gets_the_fallback(tmp_path):
  user = tmp_path / "group_reward.py"
  user.write_text(
      "def judge(samples):\n"
      "  return [10 * s['turns'] + (s['env_reward'] or 0) for s in samples]\n"
  )
  from april_jax.rewards import loading  # pylint: disable=g-import-not-at-top

  runner = RewardRunner(
      loading.UserReward(f"{user}:judge"), decode=decode, fallback=-1.0, processes=False
  )
  samples = [
      dataclasses.replace(
          _drawn(_record(i), [4, 5]),
          finish_reason="stop",
          episode=Episode(state={}, turns=i + 1, reward=0.5, error=error),
      )
      for i, error in enumerate([None, None, "step: RuntimeError: down"])
  ]
  group = Group(0, 0, samples[0].prompt, "", samples, first_step=0)
  runner.submit(group)
  runner.wait_all()
  runner.close()
  assert group.rewards == [10.5, 20.5, -1.0]
