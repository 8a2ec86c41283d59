"""A sample's typed state: its status through the engine's calls, its transitions (the
only writers of its fields, each refusing a state it cannot leave), its fields in JSON and
in checkpoints (those of earlier versions too), and the engine contract's one writer of
the policy and its questions that change nothing."""

import ast
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from april_jax.sampler.episode_state import Episode
from april_jax.rollout.buffer import PartialBuffer
from april_jax.rollout.group import Group
from april_jax.sampler import EngineConfig, SampleRecord, SlotEngine
from april_jax.sampler.records import Status, TransitionError
from conftest import sampler_qwen3
from record_builders import random_prompts

CFG = sampler_qwen3()


def _record(prompt, budget=12, index=0, **kw):
  return SampleRecord(prompt=prompt, max_new_tokens=budget, rng=[index, 7], index=index, **kw)


def test_status_follows_a_sample_through_the_engine(sampler_params):
  engine = SlotEngine(
      CFG, sampler_params, EngineConfig(num_slots=2, max_len=32, sync_every=4, stop_ids=())
  )
  prompt = random_prompts(3, [5])[0]
  short, long = _record(prompt, budget=4), _record(prompt, budget=20, index=1)
  assert short.status is Status.WAITING and not short.finished
  engine.admit([short, long])
  assert short.status is Status.LIVE and engine.holds(short)
  finished = engine.step()  # 4 decode steps: the short one reaches its budget
  assert finished == [short] and short.status is Status.FINISHED
  assert short.finish_reason == "length" and not engine.holds(short)
  assert long.status is Status.LIVE
  [cut] = engine.snapshot(keep=True)
  assert cut is long and long.status is Status.KEPT and engine.keeps(long)
  engine.copy_out_kept()
  assert long.status is Status.PARTIAL and long.has_kv and not engine.keeps(long)
  engine.admit([long])
  assert long.status is Status.LIVE
  rejected = _record(prompt)
  rejected.reject("too long")
  assert rejected.status is Status.REJECTED and rejected.finished


def test_a_held_slot_is_held_until_extended_or_released(sampler_params):
  config = EngineConfig(num_slots=1, max_len=48, sync_every=8, hold_stopped=True)
  prompt = random_prompts(4, [6])[0]
  probe = SlotEngine(CFG, sampler_params, config)
  probe.admit([_record(prompt, budget=8)])
  [free] = probe.step()
  stop = int(free.response[2])  # a token it draws: make it a stop
  engine = SlotEngine(CFG, sampler_params, EngineConfig(**{**config.__dict__, "stop_ids": (stop,)}))
  record = _record(prompt, budget=20)
  engine.admit([record])
  [held] = engine.step()
  assert held is record and record.status is Status.HELD and not record.finished
  drawn = list(record.response)
  assert engine.step() == [] and engine.num_decoding == 0  # decoding goes around it
  assert record.status is Status.HELD and list(record.response) == drawn
  engine.extend(record, np.array([1, 2], np.int32))
  assert record.status is Status.LIVE
  while record.status is Status.LIVE:
    for r in engine.step():
      if r.status is Status.HELD:
        engine.release(r)
  assert record.status is Status.FINISHED and engine.num_live == 0


def test_a_records_fields_change_through_its_transitions_only():
  record = _record(random_prompts(3, [5])[0])
  for field in dataclasses.fields(SampleRecord):
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(record, field.name, getattr(record, field.name))
  for array in (record.prompt, record.rng, record.response, record.logprobs, record.versions):
    with pytest.raises(ValueError, match="read-only"):
      array[...] = 0
  # The one way around a frozen dataclass, object.__setattr__, is records.py's alone (and
  # the learner's TrainBatch's, which stores read-only copies of its own arrays).
  package = Path(__file__).resolve().parents[1] / "april_jax"
  writers = []
  for path in sorted(package.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Attribute) and node.attr in ("__setattr__", "__dict__"):
        writers.append(f"{path.relative_to(package)}:{node.lineno}")
  owners = ("sampler/records.py:", "rl/batch.py:")
  assert writers and all(w.startswith(owners) for w in writers), writers


def test_each_transition_refuses_a_state_it_cannot_leave():
  prompt = random_prompts(3, [5])[0]
  record = _record(prompt)
  with pytest.raises(TransitionError, match="hold: the sample is waiting, not live"):
    record.hold()
  with pytest.raises(TransitionError, match="count_cut: the sample is waiting"):
    record.count_cut()  # a step's end cuts only what started
  record.go_live()
  with pytest.raises(TransitionError, match="give: the sample is live"):
    record.give([1, 2], 0)  # given tokens join a sample stopped at a turn's end
  record.read_back([7, 8], [-0.5, -0.25], [3, 3])
  with pytest.raises(TransitionError, match="do not extend"):
    record.read_back([9], [-0.5], [3])  # what a sample drew is never lost
  with pytest.raises(TransitionError, match="its prompt is fixed"):
    record.set_prompt([1, 2, 3])
  record.hold()
  record.give([4, 5], version=3)
  np.testing.assert_array_equal(record.response, [7, 8, 4, 5])
  np.testing.assert_array_equal(record.logprobs, [-0.5, -0.25, 0.0, 0.0])
  np.testing.assert_array_equal(record.versions, [3, 3, 3, 3])
  record.leave_engine()
  assert record.status is Status.PARTIAL
  record.count_cut()
  assert record.cuts == 1
  record.finish("stop")
  with pytest.raises(TransitionError, match="finish: the sample is finished"):
    record.finish("length")
  with pytest.raises(TransitionError, match="go_live: the sample is finished"):
    record.go_live()
  with pytest.raises(ValueError, match="'stop' or 'length'"):
    _record(prompt).finish("done")


def test_fields_round_trip_through_a_checkpointed_buffer():
  episode = Episode(state={"x": [1, 2]}, turns=2, observations=[[3, 5]], reward=0.5)
  samples = [
      SampleRecord(
          prompt=[1, 2, 3],
          max_new_tokens=8,
          rng=[1, 2],
          response=[4, 5, 6],
          logprobs=[-0.1, -0.2, 0.0],
          versions=[0, 0, 1],
          group_id=7,
          index=i,
          cuts=2,
          restarts=1,
          home_shard=1,
          episode=episode if i == 0 else None,
      )
      for i in range(2)
  ]
  group = Group(
      group_id=7, prompt_id="p", prompt=samples[0].prompt, answer="a", samples=samples, first_step=3
  )
  buffer = PartialBuffer()
  buffer.add(group)
  [back] = PartialBuffer.from_state(buffer.to_state())
  for a, b in zip(group.samples, back.samples):
    assert a.to_json() == b.to_json()
    np.testing.assert_array_equal(a.response, b.response)
  assert back.samples[0].episode == episode and back.samples[1].episode is None


def _old_state(meta: dict) -> dict:
  """A one-group buffer as an earlier version saved it: the caller's fields in `meta`."""
  sample = dict(max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0, finish_reason=None)
  sample.update(has_kv=False, kv_version=None, meta=meta)
  groups = [dict(group_id=4, prompt_id=0, answer="1", first_step=0, rewards=None)]
  groups[0].update(reward_info={}, row={}, samples=[sample])
  return {
      "meta_json": np.frombuffer(json.dumps(groups).encode(), np.uint8).copy(),
      "prompts": np.array([1, 2], np.int32),
      "prompt_offsets": np.array([0, 2], np.int64),
      "responses": np.array([9], np.int32),
      "logprobs": np.array([-1.0], np.float32),
      "versions": np.array([2], np.int32),
      "response_offsets": np.array([0, 1], np.int64),
      "rngs": np.array([[3, 4]], np.uint32),
      "kv_offsets": np.array([0], np.int64),
  }


def test_a_buffer_saved_with_untyped_meta_resumes_into_the_named_fields():
  meta = {"group": 4, "index": 1, "cuts": 2, "shard": 1, "env": {"n": 1}, "turns": 1}
  meta.update(obs=[[0, 1]], env_error="step: boom")
  [group] = PartialBuffer.from_state(_old_state(meta))
  [s] = group.samples
  assert (s.group_id, s.index, s.cuts, s.restarts, s.home_shard) == (4, 1, 2, 0, 1)
  assert s.episode == Episode(state={"n": 1}, turns=1, observations=[[0, 1]], error="step: boom")
  assert s.env_error == "step: boom" and s.status is Status.PARTIAL


def test_a_saved_field_this_version_does_not_know_is_refused_by_name():
  with pytest.raises(ValueError, match=r"does not know: \['colour'\]"):
    PartialBuffer.from_state(_old_state({"group": 4, "colour": "red"}))
  # The current format too: a field beside the named ones is refused, not dropped.
  record = _record(np.array([1, 2], np.int32), index=0)
  saved = record.to_json()
  assert SampleRecord(prompt=record.prompt, rng=record.rng, **SampleRecord.fields_from_json(saved))
  with pytest.raises(ValueError, match=r"does not know: \['colour'\]"):
    SampleRecord.fields_from_json({**saved, "colour": "red"})


def test_set_policy_is_the_one_writer_and_questions_change_nothing(sampler_params):
  engine = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=2, max_len=32, sync_every=4))
  prompt = random_prompts(5, [7])[0]
  records = [_record(prompt, index=i) for i in range(3)]
  assert engine.room_for(records) == 2 and engine.room_for(records) == 2
  engine.admit(records[:1])
  counters = engine.counters
  counters.prefills += 100  # a copy: the engine's own count is untouched
  assert engine.counters.prefills == 1
  engine.admit(records[1:2])  # the same prompt: its KV is still cached
  assert engine.counters.prefills == 1
  with pytest.raises(AttributeError):
    engine.params = sampler_params  # pylint: disable=attribute-defined-outside-init
  engine.step()
  engine.snapshot(with_kv=False)
  engine.set_policy(sampler_params, 3)
  assert engine.version == 3
  engine.admit(records[2:])  # new policy: the cached prompt KV is gone
  assert engine.counters.prefills == 2
  engine.step()
  [r] = engine.snapshot(with_kv=False)
  assert r is records[2] and len(r.versions) == 4 and set(r.versions.tolist()) == {3}
