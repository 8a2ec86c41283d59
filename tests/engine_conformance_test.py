"""The engine contract's promises (sampler/contract.py), asked of every engine alike:
SlotEngine, and the host-only FakeEngine the drivers' logic tests run on. What a sample
draws depends on its key, its tokens and the params alone; every admitted sample leaves
once; version tags follow the contract's rule; a sample held at a stop is extended,
released or set aside as the contract says."""

import jax
import numpy as np
import pytest

from april_jax.models import qwen3
from april_jax.sampler import EngineConfig, SampleRecord, SlotEngine
from april_jax.sampler.records import Status
from conftest import tiny_qwen3
from fake_engine import FakeEngine
from record_builders import random_prompts

CFG = tiny_qwen3(vocab_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
PARAMS = qwen3.init_params(CFG, jax.random.key(0), std=0.3)
BUDGETS = [3, 9, 6, 12, 5]


def _engine(kind: str, **settings) -> SlotEngine | FakeEngine:
  config = EngineConfig(**{**dict(num_slots=3, max_len=32, sync_every=4), **settings})
  if kind == "slot":
    return SlotEngine(CFG, PARAMS, config)
  return FakeEngine(config, vocab_size=CFG.vocab_size, params=PARAMS)


def _records(budgets=BUDGETS) -> list[SampleRecord]:
  prompts = random_prompts(3, [4 + i % 3 for i in range(len(budgets))], vocab=CFG.vocab_size)
  return [
      SampleRecord(prompt=p, max_new_tokens=b, rng=[i, 11], temperature=1.0, index=i)
      for i, (p, b) in enumerate(zip(prompts, budgets))
  ]


def _run_to_end(engine, waiting: list[SampleRecord], out: list[SampleRecord]) -> None:
  """Admits what fits and steps until every sample has finished (out: in finish order)."""
  while waiting or engine.num_live:
    room = engine.room_for(waiting)
    engine.admit(waiting[:room])
    waiting[:room] = []
    out += engine.step(refill=bool(waiting))
    assert not engine.take_preempted()


ENGINES = ["slot", "fake"]


@pytest.mark.parametrize("kind", ENGINES)
def test_a_cut_sample_resumes_to_the_tokens_it_draws_uncut_and_leaves_once(kind):
  straight, heard = [], []
  engine = _engine(kind)
  engine.listen(lambda event, seconds, **facts: heard.append((event, facts)))
  _run_to_end(engine, _records(), straight)
  # The engine tells its listeners what it did: every decode call and the KV positions
  # it read (a sample's t-th token reads prompt + t positions), every admission.
  steps = [facts for event, facts in heard if event == "step"]
  assert steps and all(set(f) == {"kv_positions"} for f in steps)
  expected = sum(
      len(r.prompt) * len(r.response) + len(r.response) * (len(r.response) - 1) // 2
      for r in straight
  )
  assert sum(f["kv_positions"] for f in steps) == expected
  assert [e for e, _ in heard].count("start_fresh") >= 2  # three, then the two left

  assert sorted(r.index for r in straight) == list(range(len(BUDGETS)))
  by_index = {r.index: r for r in straight}
  for i, budget in enumerate(BUDGETS):  # no stop token: each runs to its budget
    r = by_index[i]
    assert r.status is Status.FINISHED and r.finish_reason == "length"
    assert len(r.response) == budget and (r.logprobs <= 0).all() and (r.versions == 0).all()

  for mode in ("kv", "recompute"):
    engine, records, out = _engine(kind), _records(), []
    engine.admit(records[:3])
    out += engine.step()
    cut = engine.snapshot(with_kv=True, keep=mode == "kv")
    assert engine.num_live == 0 and all(not r.finished for r in cut)
    assert all(r.status is (Status.KEPT if mode == "kv" else Status.PARTIAL) for r in cut)
    engine.set_policy(PARAMS, 1)  # the same params under a new version
    waiting = cut[::-1] + records[3:]  # other slots, other neighbours
    while waiting or engine.num_live:
      room = engine.room_for(waiting)
      engine.admit(waiting[:room], mode=mode)
      waiting[:room] = []
      out += engine.step()
    assert sorted(r.index for r in out) == list(range(len(BUDGETS)))  # once each
    for r in out:
      np.testing.assert_array_equal(r.response, by_index[r.index].response)
    for r in cut:  # drawn after the cut on KV of version 0 (kv) or 1 (recompute)
      before = len(by_index[r.index].response) - int((r.versions != 0).sum())
      after = 0 if mode == "kv" else 1
      assert set(r.versions[before:]) <= {after}, (mode, r.versions)
    assert all((r.versions == 1).all() for r in records[3:])  # started after the update


def _stop_at_third_token(kind) -> tuple[int, int]:
  """A token the first sample draws at its third position or later and not before, and
  where."""
  straight = []
  _run_to_end(_engine(kind, stop_ids=()), _records([12]), straight)
  tokens = straight[0].response
  at = next(t for t in range(2, len(tokens)) if tokens[t] not in tokens[:t])
  return int(tokens[at]), at


@pytest.mark.parametrize("kind", ENGINES)
def test_a_sample_held_at_a_stop_is_extended_released_or_set_aside(kind):
  stop, at = _stop_at_third_token(kind)
  engine = _engine(kind, stop_ids=(stop,), hold_stopped=True)
  record = _records([12])[0]
  engine.admit([record])
  assert engine.step() == [record]
  assert record.status is Status.HELD and engine.holds(record) and engine.num_decoding == 0
  assert len(record.response) == at + 1 and record.response[-1] == stop
  with pytest.raises(ValueError, match="no room in the sample's budget"):
    engine.extend(record, [1] * (12 - at - 1))
  engine.set_policy(PARAMS, 4)
  engine.extend(record, [1, 2])  # an observation: given, logprob 0, the policy's version
  assert record.status is Status.LIVE and engine.num_decoding == 1
  np.testing.assert_array_equal(record.response[-2:], [1, 2])
  assert list(record.logprobs[-2:]) == [0.0, 0.0] and list(record.versions[-2:]) == [4, 4]
  with pytest.raises(ValueError, match="not held"):
    engine.release(record)  # a live sample ends through a step only
  while engine.step() != [record]:  # it draws on: held again at a stop, or its budget ends
    assert record.status is Status.LIVE
  assert len(record.response) > at + 3
  if record.status is Status.HELD and record.budget_left:
    engine.set_aside(record)  # its KV kept for it; its slot free
    assert record.status is Status.KEPT and engine.keeps(record) and engine.num_live == 0
    engine.admit([record])
    assert record.status is Status.LIVE and not engine.keeps(record)
    engine.snapshot(with_kv=False)
  else:  # its budget is spent: finished, or held on a stop that was its last token
    assert len(record.response) == 12
    if record.status is Status.HELD:
      engine.release(record)

  other = _records([12])[0]
  engine.admit([other])
  engine.step()
  assert other.status is Status.HELD
  engine.release(other)
  assert other.status is Status.FINISHED and other.finish_reason == "stop"
  assert engine.num_live == 0
