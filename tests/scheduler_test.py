"""The APRIL scheduler: nothing lost, baseline semantics, versions, staleness, DAPO, rewards."""

import itertools
import time

import jax
import numpy as np
import pytest

from april_jax import sharding
from april_jax.models import qwen3
from april_jax.data import PromptItem
from april_jax.rollout import (
    AprilScheduler,
    PartialBuffer,
    RewardRunner,
    RolloutSettings,
    rollout_metrics,
)
from april_jax.rollout.group import Group
from april_jax.sampler import EngineConfig, SampleRecord, SlotEngine
from conftest import step_at, tiny_qwen3
from fake_engine import FakeEngine

CFG = tiny_qwen3(vocab_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
PARAMS = qwen3.init_params(CFG, jax.random.key(0), std=0.3)
MAX_BUDGET = 40


def _parity_reward(text, answer):
  del answer
  return float(len(text) % 2)


def _make(
    budgets,
    *,
    N=2,
    n=3,
    Np=4,
    num_slots=5,
    answers=lambda i: "",
    sync_every=4,
    reward=_parity_reward,
    timeout_s=5.0,
    mesh=None,
    engine_settings=None,
    engine="fake",
    **settings
):
  """A scheduler over an engine ("fake": on the host, fake_engine.py; "slot": SlotEngine
  on a tiny model, for what depends on its pages, shards or prefill calls); responses
  run exactly to their budgets (no stop)."""
  config = EngineConfig(
      num_slots=num_slots, max_len=64, sync_every=sync_every, **(engine_settings or {})
  )
  if engine == "fake":
    engine = FakeEngine(config, vocab_size=CFG.vocab_size)
  else:
    params = PARAMS if mesh is None else jax.device_put(PARAMS, qwen3.param_shardings(CFG, mesh))
    engine = SlotEngine(CFG, params, config, mesh=mesh)
  handed_out = []
  counter = itertools.count()

  def source():
    i = next(counter)
    handed_out.append(i)
    prompt = np.random.default_rng(i).integers(0, CFG.vocab_size, 2 + i % 5)
    return PromptItem(prompt_id=i, tokens=prompt, answer=answers(i), budgets=budgets(i, n))

  runner = RewardRunner(
      reward, decode=lambda ids: "x" * len(ids), timeout_s=timeout_s, fallback=-1.0, processes=False
  )
  rollout = RolloutSettings(
      batch_size=N, n_samples_per_prompt=n, over_sampling_batch_size=Np, **settings
  )
  return AprilScheduler(engine, rollout, source, runner), handed_out


def _make_on_slot_engine(budgets, **options):
  """_make with SlotEngine: for what depends on its pages, shards or prefill calls."""
  return _make(budgets, engine="slot", **options)


def _longtail_budgets(i, n):
  rng = np.random.default_rng(1000 + i)
  return np.clip(np.rint(4 * np.exp(0.9 * rng.standard_normal(n))), 1, MAX_BUDGET).astype(int)


@pytest.mark.parametrize("resume_mode", ["kv", "recompute"])
def test_every_admitted_prompt_is_trained_once_rejected_or_buffered(resume_mode):
  sched, handed_out = _make(_longtail_budgets, dynamic_sampling=True, resume_mode=resume_mode)
  trained, rejected = [], []
  for step in range(12):
    result = step_at(sched, step, step)
    assert len(result.groups) == 2
    for g in result.groups:
      # No group is trained before all n samples are done, each to its full budget.
      assert g.complete and len(g.samples) == 3
      assert [len(s.response) for s in g.samples] == list(_longtail_budgets(g.prompt_id, 3))
      assert not g.rewards_all_equal()
    assert all(g.rewards_all_equal() for g in result.rejected)
    trained += [g.prompt_id for g in result.groups]
    rejected += [g.prompt_id for g in result.rejected]
  buffered = [g.prompt_id for g in sched.buffer]
  everything = trained + rejected + buffered
  assert len(everything) == len(set(everything))  # nothing twice
  assert sorted(everything) == sorted(handed_out)  # nothing lost
  assert rejected and sched.totals["rejected"] == len(rejected)
  assert sched.totals["trained"] == len(trained) == 24


@pytest.mark.parametrize("resume_mode", ["kv", "recompute"])
def test_a_scarce_pool_over_two_slot_shards_starts_what_fits_and_loses_nothing(resume_mode):
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 (CPU) devices")
  # Slots split over two devices, each with pages for little more than one long sample:
  # partials and fresh samples compete for pages shard by shard, and each must go to a
  # slot on a shard whose pages room_for counted for it.
  budgets = lambda i, n: np.random.default_rng(2000 + i).integers(5, 58, n)
  sched, handed_out = _make_on_slot_engine(
      budgets,
      num_slots=6,
      resume_mode=resume_mode,
      mesh=sharding.make_mesh((2, 1, 1), jax.devices()[:2]),
      engine_settings=dict(page_size=8, kv_pages=20, resume_mode=resume_mode),
  )
  trained = []
  for step in range(6):
    result = step_at(sched, step, step)
    assert len(result.groups) == 2
    for g in result.groups:
      assert [len(s.response) for s in g.samples] == list(budgets(g.prompt_id, 3))
    trained += [g.prompt_id for g in result.groups]
  assert sched.totals["preemptions"] > 0
  everything = trained + [g.prompt_id for g in sched.buffer]
  assert sorted(everything) == sorted(handed_out) and len(set(everything)) == len(everything)


def test_waiting_samples_take_slots_on_shards_with_pages_for_them():
  # Slots 0-1 on one device, 2-3 on another, 8 pages each. A long sample in slot 0
  # leaves its shard 2 pages. Group A waits with a short fresh sample, group B with a
  # long partial (6 pages). The partial starts in slot 2, on the shard with the pages,
  # and the fresh sample in slot 1. (Counted in group order, the fresh sample was given
  # slot 1 and the partial slot 2, but the partials' call then took slot 1 and raised.)
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 (CPU) devices")
  sched, _ = _make_on_slot_engine(
      lambda i, n: np.full(n, 20),
      num_slots=4,
      mesh=sharding.make_mesh((2, 1, 1), jax.devices()[:2]),
      engine_settings=dict(page_size=8, kv_pages=16),
  )
  engine = sched.engine
  record = lambda P, budget: SampleRecord(np.arange(P) % 32, budget, np.zeros(2, np.uint32))
  partial = record(40, 20)
  engine.admit([partial])
  engine.step(refill=False)
  engine.snapshot(with_kv=True)
  assert partial.started and partial.has_kv
  engine.admit([record(40, 20)])  # slot 0
  assert engine.kv.book.free(1) == 2 and engine.kv.book.free(2) == 8
  fresh = record(4, 4)
  st = sched._begin(0)  # pylint: disable=protected-access
  st.active = [Group(g, g, r.prompt, "", [r], 0) for g, r in enumerate([fresh, partial])]
  assert sched._start_waiting(st) and not st.blocked  # pylint: disable=protected-access
  owner = engine.slots.owner
  assert owner(1) is fresh and owner(2) is partial and engine.kv.book.free(2) == 2
  finished = []
  while engine.num_live:
    finished += engine.step()
  assert len(fresh.response) == 4 and len(partial.response) == 20
  assert any(r is partial for r in finished)


def test_synchronous_baseline_finishes_every_admitted_group_in_its_step():
  sched, _ = _make(_longtail_budgets, Np=2, partial_rollout=False)
  for step in range(5):
    result = step_at(sched, step, step)
    assert len(result.groups) == 2 and len(sched.buffer) == 0
    # Every step generates its whole batch, all of it by this step's policy.
    trained_tokens = sum(len(s.response) for g in result.groups for s in g.samples)
    assert result.stats["new_tokens"] == trained_tokens > 0
    for s in (s for g in result.groups for s in g.samples):
      assert set(s.versions.tolist()) == {step}  # all on-policy
    assert rollout_metrics(result, step)["rollout/off_policy_token_frac"] == 0.0


@pytest.mark.parametrize("partial_rollout", [True, False])
def test_groups_admitted_together_share_prefill_calls(partial_rollout):
  # Twelve slots take the step's four groups of three at once: their prompts (one length
  # bucket) are prefilled in one call, not four. Equal budgets: nothing starts later.
  sched, _ = _make_on_slot_engine(
      lambda i, n: np.full(n, 6), N=4, Np=4, num_slots=12, partial_rollout=partial_rollout
  )
  result = step_at(sched, 0, 0)
  assert len(result.groups) == 4 and result.stats["admitted_groups"] == 4
  assert sched.engine.counters.prefills == 1
  assert all(len(s.response) == 6 for g in result.groups for s in g.samples)
  # Each sample decoded its own group's prompt: greedy-equal to a fresh engine's.
  for group in result.groups:
    alone = SlotEngine(CFG, PARAMS, EngineConfig(num_slots=3, max_len=64))
    fresh = [
        SampleRecord(s.prompt, s.max_new_tokens, s.rng, s.temperature, s.top_k, s.top_p)
        for s in group.samples
    ]
    alone.admit(fresh)
    while alone.num_live:
      alone.step()
    for s, want in zip(group.samples, fresh):
      np.testing.assert_array_equal(s.response, want.response)
      np.testing.assert_allclose(s.logprobs, want.logprobs, atol=1e-5)


def test_synchronous_baseline_refuses_to_over_sample():
  # N' > N would complete surplus groups and train them a step later, off-policy.
  with pytest.raises(ValueError, match="over_sampling_batch_size == batch_size"):
    _make(_longtail_budgets, N=2, Np=4, partial_rollout=False)


@pytest.mark.parametrize("resume_mode", ["recompute", "kv"])
def test_resumed_sample_is_tagged_with_the_oldest_params_it_saw_and_metrics_match_hand_count(
    resume_mode,
):
  # Group 0 has one long sample; every other group is short, so each step stops early
  # and group 0's long sample is carried over across updates.
  budgets = lambda i, n: [24, 1] if i == 0 else [2, 2]
  sched, _ = _make(budgets, N=1, n=2, Np=2, num_slots=4, resume_mode=resume_mode)
  for step in range(40):
    result = step_at(sched, step, step)
    (group,) = result.groups
    if group.prompt_id == 0:
      break
  else:
    pytest.fail("group 0 was never trained")
  long_sample = group.samples[0]
  k = long_sample.cuts  # step ends it was cut at, and continued after
  assert k >= 2
  if resume_mode == "recompute":  # each continuation recomputes its KV: one tag per update
    assert set(long_sample.versions.tolist()) == set(range(k + 1))
    assert np.all(np.diff(long_sample.versions) >= 0)
  else:  # every token attended to the KV version 0 computed
    assert set(long_sample.versions.tolist()) == {0}
  metrics = rollout_metrics(result, step)
  all_versions = np.concatenate([s.versions for s in group.samples])
  assert metrics["rollout/stale_token_frac"] == pytest.approx(
      np.sum(all_versions < step) / len(all_versions)
  )
  # The paper's measure: the long sample was cut at k step ends and continued; its short
  # sibling finished in the step it started, so its token is not counted.
  assert group.samples[1].cuts == 0
  assert metrics["rollout/off_policy_token_frac"] == pytest.approx(24 / 25)
  assert metrics["rollout/staleness_max"] == step  # its first token was drawn at version 0
  assert metrics["rollout/staleness_mean"] == pytest.approx(
      np.mean([step - s.versions.min() for s in group.samples])
  )


@pytest.mark.parametrize("limit", [0, 2])
def test_max_staleness_holds_and_every_group_trains_within_a_bounded_delay(limit):
  sched, handed_out = _make_on_slot_engine(
      _longtail_budgets, N=1, n=3, Np=3, num_slots=4, max_staleness=limit
  )
  restarts, trained = 0, []
  for step in range(25):
    result = step_at(sched, step, step)
    restarts += result.stats.get("stale_restarts", 0)
    for g in result.groups:
      # Live: an overdue group trains in its step unless older overdue groups fill the
      # batch; with N' = 3N that costs at most two more steps.
      assert step - g.first_step <= limit + 3
      trained.append(g.prompt_id)
      for s in g.samples:
        assert step - s.versions.min() <= limit
    # Pages are kept only for samples still in the buffer: a restarted one lets go.
    assert set(sched.engine.kv.book.kept) <= {s for g in sched.buffer for s in g.samples}
  assert restarts > 0 and sched.totals["stale_restarts"] == restarts
  assert sorted(trained + [g.prompt_id for g in sched.buffer]) == sorted(handed_out)


@pytest.mark.parametrize("resume_mode", ["kv", "recompute"])
def test_a_response_longer_than_the_staleness_limit_restarts_once_and_trains(resume_mode):
  # Prompt 0 needs 36 tokens; every step ends after ~2, so it crosses the limit of 2
  # versions. With the old rule it restarted every third step, forever.
  budgets = lambda i, n: [36, 1] if i == 0 else [2, 2]
  sched, _ = _make(
      budgets, N=1, n=2, Np=2, num_slots=4, sync_every=4, max_staleness=2, resume_mode=resume_mode
  )
  first_keys = None
  for step in range(60):
    result = step_at(sched, step, step)
    if step == 0:
      first_keys = [s.rng.copy() for s in sched.buffer.get(0).samples]
    (group,) = result.groups
    if group.prompt_id == 0:
      break
  else:
    pytest.fail("the long prompt was never trained")
  assert step == 3 and result.stats["overdue_groups"] == 1
  assert sched.totals["stale_restarts"] == 2  # both samples once, then never again
  for sample, key in zip(group.samples, first_keys):
    assert sample.restarts == 1 and not np.array_equal(sample.rng, key)
    assert set(sample.versions.tolist()) == {step}  # redrawn within this step: on-policy
  assert [len(s.response) for s in group.samples] == [36, 1]


def test_a_stale_sample_restarts_but_its_siblings_within_the_limit_are_kept():
  sched, _ = _make(lambda i, n: [6, 6], N=1, n=2, Np=1, num_slots=2, max_staleness=1)
  prompt = np.array([3, 4, 5], np.int32)
  old = SampleRecord(
      prompt=prompt,
      max_new_tokens=6,
      rng=np.array([1, 2], np.uint32),
      response=[7, 8],
      logprobs=[-1.0, -1.0],
      versions=[0, 0],
      group_id=0,
      index=0,
      cuts=2,
  )
  recent = SampleRecord(
      prompt=prompt,
      max_new_tokens=6,
      rng=np.array([3, 4], np.uint32),
      response=[9] * 6,
      logprobs=[-1.0] * 6,
      versions=[2] * 6,
      finish_reason="length",
      group_id=0,
      index=1,
  )
  sched.buffer.add(
      Group(
          group_id=0, prompt_id="p", prompt=prompt, answer="", samples=[old, recent], first_step=0
      )
  )
  sched.next_group_id = 1
  result = step_at(sched, 3, 3)
  (group,) = result.groups
  assert result.stats["stale_restarts"] == 1
  assert group.samples[1] is recent  # finished two versions ago: within the limit, kept
  restarted = group.samples[0]
  assert set(restarted.versions.tolist()) == {3} and len(restarted.response) == 6
  assert restarted.cuts == 0 and restarted.restarts == 1


def test_dapo_filter_keeps_all_equal_groups_out_and_still_delivers_n_groups():
  # Even prompt ids: all budgets even, rewards all equal -> rejected.
  budgets = lambda i, n: [2, 4, 6] if i % 2 == 0 else [2, 3, 4]
  sched, _ = _make(budgets, N=2, Np=2, dynamic_sampling=True)
  for step in range(4):
    result = step_at(sched, step, step)
    assert len(result.groups) == 2
    assert all(g.prompt_id % 2 == 1 for g in result.groups)
    assert all(g.prompt_id % 2 == 0 for g in result.rejected)
    assert result.stats["zero_std_groups_dropped"] == len(result.rejected) > 0


def test_dapo_filter_stops_dropping_at_its_cap_so_a_hopeless_step_still_ends():
  # Every group's rewards are equal (a data set the policy always fails): without the
  # cap the filter would admit groups forever.
  sched, _ = _make(lambda i, n: [2, 4, 6], N=2, Np=2, dynamic_sampling=True, max_dropped_groups=3)
  for step in range(2):
    result = step_at(sched, step, step)
    assert len(result.groups) == 2 and len(result.rejected) == 3
    assert result.stats["zero_std_groups_dropped"] == 3
    assert result.stats["zero_std_groups_kept"] == 2
    assert all(g.rewards_all_equal() for g in result.groups)


def test_reward_that_raises_or_hangs_gets_fallback_and_is_counted():
  def reward(text, answer):
    if answer == "boom":
      raise RuntimeError("malformed answer")
    if answer == "hang":
      time.sleep(3.0)
    return 1.0

  answers = lambda i: {0: "boom", 1: "hang"}.get(i, "ok")
  sched, _ = _make(
      lambda i, n: [3] * n, N=3, n=2, Np=3, answers=answers, reward=reward, timeout_s=0.3
  )
  result = step_at(sched, 0, 0)
  by_id = {g.prompt_id: g for g in result.groups}
  assert by_id[0].rewards == [-1.0, -1.0] and by_id[0].reward_info["errors"] == 2
  assert by_id[1].rewards == [-1.0, -1.0] and by_id[1].reward_info["timeouts"] == 2
  assert by_id[2].rewards == [1.0, 1.0]
  assert result.stats["reward_errors"] == 2 and result.stats["reward_timeouts"] == 2


def test_surplus_complete_groups_stay_buffered_and_train_first_next_step():
  sched, handed_out = _make(lambda i, n: [2] * n, N=1, n=2, Np=4, num_slots=8)
  first = step_at(sched, 0, 0)
  assert [g.prompt_id for g in first.groups] == [0]
  assert sorted(g.prompt_id for g in sched.buffer) == [1, 2, 3]
  assert all(g.complete and g.scored for g in sched.buffer)
  second = step_at(sched, 1, 1)
  assert [g.prompt_id for g in second.groups] == [1]  # oldest surplus first, no decoding
  assert second.stats["new_tokens"] == 0


def test_buffer_round_trips_through_numpy_state_and_resumes_identically():
  """One scheduler keeps its partials' KV in the pool; the other goes through a
  checkpoint's state (the KV copied out, the buffer rebuilt from numpy) and continues
  from host KV. Both continue bit for bit alike."""
  make = lambda: _make(_longtail_budgets, resume_mode="kv")[0]
  a, b = make(), make()
  step_at(a, 0, 0)
  step_at(b, 0, 0)
  partials = [s for g in a.buffer for s in g.samples if s.started and not s.finished]
  assert partials and all(a.engine.keeps(s) and not s.has_kv for s in partials)
  for g in list(a.buffer) + list(b.buffer):  # a dataset row rides along, for the reward
    g.row = {"level": 3, "tags": ["algebra"], "source": {"name": "amc"}}
  state, _ = b.checkpoint()
  assert not any(b.engine.keeps(s) for g in b.buffer for s in g.samples)
  b.buffer = PartialBuffer.from_state({k: np.array(v) for k, v in state.items()})
  for ga, gb in zip(a.buffer, b.buffer):
    assert (ga.group_id, ga.prompt_id, ga.rewards) == (gb.group_id, gb.prompt_id, gb.rewards)
    assert gb.row == ga.row
    for sa, sb in zip(ga.samples, gb.samples):
      np.testing.assert_array_equal(sa.response, sb.response)
      np.testing.assert_array_equal(sa.versions, sb.versions)
      np.testing.assert_array_equal(sa.rng, sb.rng)
      assert sa.finish_reason == sb.finish_reason
      assert sb.has_kv == a.engine.keeps(sa)
      if sb.has_kv:  # the used length: every position but the pending token's
        assert sb.kv_k.shape[1] == sb.length - 1 and sb.kv_version == sa.kv_version == 0
  assert b.buffer.host_bytes() > a.buffer.host_bytes() > 0
  ra, rb = step_at(a, 1, 1), step_at(b, 1, 1)
  assert [g.group_id for g in ra.groups] == [g.group_id for g in rb.groups]
  for ga, gb in zip(ra.groups, rb.groups):
    for sa, sb in zip(ga.samples, gb.samples):
      np.testing.assert_array_equal(sa.response, sb.response)
      np.testing.assert_array_equal(sa.logprobs, sb.logprobs)
      np.testing.assert_array_equal(sa.versions, sb.versions)
  assert a.engine.counters.kv_bytes_to_device == 0 < b.engine.counters.kv_bytes_to_device


def test_occupancy_and_throughput_follow_their_definitions():
  sched, _ = _make(_longtail_budgets, N=2, Np=4)
  result = step_at(sched, 0, 0)
  m, st = rollout_metrics(result, 0), result.stats
  assert 0 < m["rollout/slot_occupancy"] <= 1
  assert m["rollout/slot_occupancy"] == pytest.approx(
      st["new_tokens"] / (st["num_slots"] * st["decode_steps"])
  )
  assert m["rollout/tokens_per_s"] == pytest.approx(st["new_tokens"] / st["rollout_s"])
  trained_tokens = sum(len(s.response) for g in result.groups for s in g.samples)
  assert st["new_tokens"] >= trained_tokens


def test_kept_kv_changes_no_decision_under_a_scarce_pool(monkeypatch):
  """APRIL over a pool too small for its slots (preemptions, kept pages reclaimed), once
  keeping its partials' KV in the pool and once copying it to the host at each step's
  end: the same samples, tokens, logprobs and stats, step by step."""
  budgets = lambda i, n: np.random.default_rng(3000 + i).integers(5, 58, n)
  settings = dict(page_size=8, kv_pages=24)
  kept, _ = _make_on_slot_engine(budgets, num_slots=6, resume_mode="kv", engine_settings=settings)
  copied, _ = _make_on_slot_engine(budgets, num_slots=6, resume_mode="kv", engine_settings=settings)
  snapshot = copied.engine.snapshot
  monkeypatch.setattr(
      copied.engine, "snapshot", lambda with_kv=True, keep=False: snapshot(with_kv, keep=False)
  )
  counts = ("preemptions", "new_tokens", "decode_steps", "partial_samples")
  for step in range(6):
    a, b = step_at(kept, step, step), step_at(copied, step, step)
    assert [g.group_id for g in a.groups] == [g.group_id for g in b.groups]
    assert [a.stats.get(k) for k in counts] == [b.stats.get(k) for k in counts]
    for ga, gb in zip(a.groups, b.groups):
      for sa, sb in zip(ga.samples, gb.samples):
        np.testing.assert_array_equal(sa.response, sb.response)
        np.testing.assert_array_equal(sa.logprobs, sb.logprobs)
        np.testing.assert_array_equal(sa.versions, sb.versions)
  assert kept.totals["preemptions"] > 0
  # Preempted samples and reclaimed kept pages still cross to the host; less of it.
  assert 0 < kept.engine.counters.kv_bytes_to_host < copied.engine.counters.kv_bytes_to_host
  assert kept.engine.counters.kv_bytes_to_device < copied.engine.counters.kv_bytes_to_device


@pytest.mark.parametrize("resume_mode", ["kv", "recompute"])
def test_a_step_cut_early_keeps_everything_in_the_buffer_and_the_run_loses_nothing(resume_mode):
  """What SIGTERM does: the step ends before its next decode call, nothing trains, every
  unfinished sample is a partial and every complete group waits in the buffer (one whose
  score was running is scored again when next admitted). The steps after train every
  group once, whole, each sample to its budget."""
  slow = lambda text, answer: time.sleep(0.05) or float(len(text) % 2)
  sched, handed_out = _make(
      _longtail_budgets, dynamic_sampling=True, resume_mode=resume_mode, reward=slow
  )
  calls = itertools.count()
  cut = step_at(sched, 0, 0, cut_now=lambda: next(calls) == 3)
  assert cut.cut and cut.groups == [] and sched.totals["trained"] == 0
  assert len(sched.buffer) == len(handed_out) - len(cut.rejected) > 0
  drawn = [s for g in sched.buffer for s in g.samples if s.started]
  assert any(not s.finished for s in drawn)  # partials, cut mid-response
  # A cut while waiting for rewards: the wait ends at once.
  sched.rewards.timeout_s = 60.0
  sched.rewards._reward_fn = lambda text, answer: time.sleep(30.0) or 1.0  # pylint: disable=protected-access
  for g in sched.buffer:  # the scores are wanted again
    if g.complete:
      g.rewards = None
  start = time.monotonic()
  given_up = step_at(sched, 1, 1, cut_now=lambda: False, give_up=lambda: True)
  assert given_up.cut and time.monotonic() - start < 5.0
  sched.rewards._reward_fn = slow  # pylint: disable=protected-access
  trained, rejected = [], [g.prompt_id for g in cut.rejected + given_up.rejected]
  for step in range(2, 10):
    result = step_at(sched, step, step)
    for g in result.groups:
      assert g.complete and g.scored and not g.rewards_all_equal()
      assert [len(s.response) for s in g.samples] == list(_longtail_budgets(g.prompt_id, 3))
    trained += [g.prompt_id for g in result.groups]
    rejected += [g.prompt_id for g in result.rejected]
  everything = trained + rejected + [g.prompt_id for g in sched.buffer]
  assert len(everything) == len(set(everything))  # nothing twice
  assert sorted(everything) == sorted(handed_out)  # nothing lost
  assert len(trained) == 16
