"""The rollout on its own devices (rollout/async_rollout.py, rollout/publish.py,
rollout/in_flight.py): weights cross meshes a weight at a time into the sampler's layout
there; an update taken in flight lands between two decode calls, and every token after it
carries the version and the behaviour logprob the engine actually used, over the kept KV
(checked against the model run by hand: the old params' KV, the new params' decode) or
recomputed (against a forward of the new params); nothing is lost or doubled; the
batches a checkpoint holds come back exactly."""

import dataclasses
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax import sharding
from april_jax.models import qwen3
from april_jax.rollout import in_flight
from april_jax.rollout.async_rollout import AsyncRollout
from april_jax.rollout.publish import WeightPublisher
from april_jax.rollout.scheduler import RolloutResult
from april_jax.sampler import EngineConfig, SlotEngine
from conftest import sampler_qwen3
from record_builders import random_prompts, sample_records, teacher_forced_logprobs, text_group

CFG = sampler_qwen3()
TEMPERATURE = 1.0


def _meshes():
  """(rollout mesh: devices 0-3 as (2, 1, 2); learner mesh: devices 4-7 as (1, 4, 1))."""
  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip("needs 8 (CPU) devices")
  return (sharding.make_mesh((2, 1, 2), devices[:4]), sharding.make_mesh((1, 4, 1), devices[4:8]))


def _on(mesh, params, rules=sharding.DECODE_RULES):
  return jax.device_put(params, qwen3.param_shardings(CFG, mesh, rules))


def _perturbed(params, scale=0.05, seed=1):
  """Params moved as an update would move them (every weight)."""
  keys = jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params)))
  leaves, treedef = jax.tree.flatten(params)
  moved = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, moved)


# ------------------------------------------------------------------------- publishing
def test_a_publish_lands_in_the_rollout_layout_and_lets_the_old_weights_go(sampler_params):
  rollout_mesh, learner_mesh = _meshes()
  publisher = WeightPublisher(CFG, rollout_mesh, sharding.DECODE_RULES, "float32")
  engine = SlotEngine(CFG, None, EngineConfig(num_slots=4, max_len=32), mesh=rollout_mesh)
  publisher.swap(engine, _on(learner_mesh, sampler_params), 3)
  want = qwen3.param_shardings(CFG, rollout_mesh, sharding.DECODE_RULES)
  got_leaves = jax.tree.leaves(engine.params)
  for got, sh, src in zip(got_leaves, jax.tree.leaves(want), jax.tree.leaves(sampler_params)):
    assert got.sharding.is_equivalent_to(sh, got.ndim)
    assert set(got.sharding.device_set) == set(rollout_mesh.devices.flat)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(src))
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(sampler_params))
  assert engine.version == 3 and publisher.stats.bytes == total and publisher.stats.copies == 1
  old = [weakref.ref(x) for x in got_leaves]
  del got_leaves, got
  moved = _perturbed(sampler_params)
  publisher.swap(engine, _on(learner_mesh, moved), 4)
  gc.collect()
  assert all(r() is None for r in old)  # the engine's old copies are gone: one set held
  assert engine.version == 4 and publisher.stats.bytes == 2 * total
  np.testing.assert_array_equal(
      np.asarray(engine.params["final_norm"]), np.asarray(moved["final_norm"])
  )


# --------------------------------------------------------------------- updates in flight
def _engine_mid_decode(params, resume_mode):
  """An engine on a one-device rollout mesh, its 4 samples 2 decode calls in (not done),
  and an AsyncRollout around it (its thread not started: the test calls its steps)."""
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  publisher = WeightPublisher(CFG, mesh, sharding.DECODE_RULES, "float32")
  engine = SlotEngine(CFG, None, EngineConfig(num_slots=4, max_len=64, sync_every=3), mesh=mesh)
  publisher.swap(engine, params, 0)
  records = sample_records(random_prompts(7, [5, 9, 6, 11]), 24, temperature=TEMPERATURE)
  engine.admit(records)
  for _ in range(2):
    assert not engine.step()
  rollout = AsyncRollout(
      _SchedulerOf(engine), publisher, depth=1, in_flight=True, resume_mode=resume_mode,
      first_batch=0, version=0,
  )  # fmt: skip
  return engine, records, rollout


class _SchedulerOf:
  """What AsyncRollout reads of a scheduler when its thread is not running: the engine."""

  def __init__(self, engine):
    self.engine = engine


def _drain(engine):
  while engine.num_live:
    engine.step()


def _kept_kv_reference(old, new, record, m):
  """The logprobs of the record's tokens m.. as the engine draws them over kept KV: the
  KV of positions before the (m-1)-th response token computed by `old`, every later
  position's by `new` (one decode step per token, the dense cache)."""
  tokens = np.concatenate([record.prompt, record.response]).astype(np.int32)
  P, S = len(record.prompt), 64
  start = P + m - 1  # the position the first step after the swap writes
  _, kv = qwen3.prefill(CFG, old, jnp.asarray(tokens[None, :start]), jnp.array([start]))
  pad = lambda x: jnp.pad(x.transpose(0, 1, 3, 2, 4), ((0, 0),) * 3 + ((0, S - start), (0, 0)))
  cache = qwen3.KVCache(pad(kv.k), pad(kv.v))
  out = []
  for pos in range(start, len(tokens) - 1):
    logits, cache = qwen3.decode_step(CFG, new, jnp.array([tokens[pos]]), jnp.array([pos]), cache)
    logp = jax.nn.log_softmax(logits[0] / TEMPERATURE)
    out.append(float(logp[tokens[pos + 1]]))
  return np.array(out)


@pytest.mark.parametrize("resume_mode", ["kv", "recompute"])
def test_an_update_taken_in_flight_tags_each_token_with_what_drew_it(sampler_params, resume_mode):
  old, new = sampler_params, _perturbed(sampler_params)
  engine, records, rollout = _engine_mid_decode(old, resume_mode)
  engine.snapshot(keep=False)  # the tokens so far onto the records ...
  engine.admit(records, mode="kv")  # ... and back in place, their KV as it was
  before = {r.index: (r.response.copy(), r.logprobs.copy()) for r in records}
  assert all(len(t) == 6 for t, _ in before.values())  # 2 calls of 3 tokens each
  rollout.publish(new, 1)
  rollout._between_calls()  # pylint: disable=protected-access  # what the thread runs
  assert engine.version == 1 and rollout.swaps == 1
  _drain(engine)
  for r in records:
    tokens, logprobs = before[r.index]
    m = len(tokens)
    assert r.finished and len(r.response) == len(r.logprobs) == len(r.versions)
    np.testing.assert_array_equal(r.response[:m], tokens)  # nothing lost or doubled
    np.testing.assert_array_equal(r.logprobs[:m], logprobs)
    assert (r.versions[:m] == 0).all()
    if resume_mode == "kv":  # the oldest params its forward saw: the kept KV's
      assert (r.versions[m:] == 0).all()
      want = _kept_kv_reference(old, new, r, m)
    else:  # recomputed by the new params: theirs alone
      assert (r.versions[m:] == 1).all()
      want = teacher_forced_logprobs(CFG, new, r, TEMPERATURE)[m:]
    np.testing.assert_allclose(r.logprobs[m:], want, atol=2e-5, rtol=0)
    # ... and not the old params' (the update moved them measurably)
    assert np.abs(teacher_forced_logprobs(CFG, old, r, TEMPERATURE)[m:] - want).max() > 1e-3


def test_in_order_mode_draws_a_batch_by_one_version_and_waits_for_it(sampler_params):
  engine, _, rollout = _engine_mid_decode(sampler_params, "kv")
  rollout.in_flight = False
  assert rollout._ready(1) == 0  # pylint: disable=protected-access  # batch 1: version 0
  assert rollout._ready(2) is None  # pylint: disable=protected-access  # waits for 1
  rollout.publish(sampler_params, 1)
  rollout.publish(sampler_params, 2)
  assert rollout._ready(2) == 1  # pylint: disable=protected-access  # 1, though 2 is there
  rollout.in_flight = True
  assert rollout._ready(2) == 2  # pylint: disable=protected-access  # in flight: the newest
  rollout.depth = 0
  assert rollout._ready(3) is None  # pylint: disable=protected-access  # depth 0: waits for 3
  engine.snapshot(keep=False)


# ------------------------------------------------------------- what a checkpoint holds
def test_the_batches_waiting_for_the_learner_come_back_exactly():
  rng = np.random.default_rng(0)

  def group(gid):
    g = text_group(gid, "a", ["ab", "abcde"])
    g.samples = [
        dataclasses.replace(
            s,
            logprobs=rng.normal(size=len(s.response)).astype(np.float32),
            versions=np.arange(len(s.response), dtype=np.int32) // 2 + gid,
        )
        for s in g.samples
    ]
    g.rewards = [1.0, 0.0]
    return g

  results = [
      RolloutResult(groups=[group(1), group(2)], rejected=[group(3)], stats={"new_tokens": 9}),
      RolloutResult(groups=[group(4)], rejected=[], stats={"new_tokens": 4.0}),
  ]
  own = {"meta_json": np.zeros(3, np.uint8)}
  arrays, described = in_flight.to_state(results)
  back_own, back = in_flight.from_state({**own, **arrays}, described)
  assert list(back_own) == ["meta_json"]
  assert [[g.group_id for g in r.groups] for r in back] == [[1, 2], [4]]
  assert [[g.group_id for g in r.rejected] for r in back] == [[3], []]
  assert back[0].stats == {"new_tokens": 9.0}
  for a, b in zip(results, back):
    for ga, gb in zip(a.groups + a.rejected, b.groups + b.rejected):
      assert ga.rewards == gb.rewards and ga.prompt_id == gb.prompt_id
      for sa, sb in zip(ga.samples, gb.samples):
        np.testing.assert_array_equal(sa.response, sb.response)
        np.testing.assert_array_equal(sa.logprobs, sb.logprobs)
        np.testing.assert_array_equal(sa.versions, sb.versions)
  assert in_flight.from_state(own, None) == (own, [])


# --------------------------------------------------------- the thread and the learner
class _Engine:
  """The engine as AsyncRollout sees it: its params and version."""

  def __init__(self):
    self.params, self.version = None, 0

  def set_policy(self, params, version):
    self.params, self.version = params, version


class _Publisher:

  def swap(self, engine, tree, version):
    engine.set_policy(tree, version)


class _Scheduler:
  """Draws batch i at once, noting the version it holds; cuts batch `cut_at` (as
  SIGTERM does) and raises at batch `fail_at`."""

  def __init__(self, cut_at=None, fail_at=None):
    self.engine, self.drawn = _Engine(), []
    self.cut_at, self.fail_at = cut_at, fail_at

  def step(self, batch, cut_now, give_up, train_version, between_calls):
    del give_up
    self.drawn.append((batch, self.engine.version, train_version))
    if batch == self.fail_at:
      raise RuntimeError("the reward server went away")
    if batch == self.cut_at or cut_now():
      return RolloutResult(groups=[], rejected=[], stats={"new_tokens": 3}, cut=True)
    return RolloutResult(groups=[], rejected=[], stats={"batch": batch})


def _started(depth=1, **scheduler):
  s = _Scheduler(**scheduler)
  rollout = AsyncRollout(
      s, _Publisher(), depth=depth, in_flight=False, resume_mode="kv", first_batch=0, version=0
  )
  rollout.start()
  return s, rollout


@pytest.mark.parametrize("depth", [0, 1])
def test_batch_i_is_drawn_by_version_i_minus_depth_and_requests_see_that_version(depth):
  s, rollout = _started(depth)
  seen = []
  for i in range(5):
    assert rollout.take(i).stats == {"batch": i}
    capture = lambda: (s.engine.version, len(rollout.waiting_results()))
    (req,) = rollout.publish(f"params {i + 1}", i + 1, [capture])
    seen.append(req.result())
  rollout.close()
  # Batch j by version max(j - depth, 0), its staleness judged at j (the version training it).
  assert [(j, v, t) for j, v, t in s.drawn[:6]] == [(j, max(j - depth, 0), j) for j in range(6)]
  # At step k's boundary the engine holds version k and batches k .. k + depth - 1 wait.
  assert seen == [(k, depth) for k in range(1, 6)]


def test_a_cut_rollout_parks_and_still_answers_a_checkpoints_request():
  s, rollout = _started(cut_at=2)
  rollout.take(0)
  rollout.publish("params 1", 1)
  rollout.take(1)
  cut = rollout.take(2)
  assert cut.cut and cut.stats["new_tokens"] == 3
  assert rollout.request(lambda: ("captured", s.engine.version)) == ("captured", 1)
  (late,) = rollout.publish("params 2", 2, [lambda: s.engine.version])
  assert late.result() == 2  # an evaluation of version 2 scores version 2
  rollout.close()
  assert [j for j, _, _ in s.drawn] == [0, 1, 2]  # nothing drawn after the cut


def test_a_failed_rollout_fails_the_learners_requests_and_takes_with_its_error():
  _, rollout = _started(fail_at=1)
  rollout.take(0)
  (capture,) = rollout.publish("params 1", 1, [lambda: "a checkpoint of a failed batch"])
  with pytest.raises(RuntimeError, match="reward server went away"):
    capture.result()
  with pytest.raises(RuntimeError, match="reward server went away"):
    rollout.take(1)
  rollout.close()
