"""Routing replay: the sampler records each token's experts (a Qwen3-MoE model's) and they
reach the learner whole, through preemption in both modes, APRIL's partial buffer and a
checkpoint's arrays; the learner replays them, so a bfloat16 rollout's route flips do not
move its logprobs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax import sampler, sharding
from april_jax.data import PromptItem
from april_jax.models import moe, qwen3
from april_jax.rl import batch as batch_lib
from april_jax.rl.update import Learner
from april_jax.rollout import AprilScheduler, RewardRunner, RolloutSettings
from april_jax.rollout.buffer import PartialBuffer
from april_jax.rollout.group import Group
from april_jax.sampler import EngineConfig, SlotEngine
from april_jax.sampler.records import Status
from april_jax.settings.train import TrainSettings
from conftest import mesh_or_skip, tiny_qwen3
from record_builders import random_prompts

CFG = tiny_qwen3(
    vocab_size=96, head_dim=16, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=16
)


@pytest.fixture(scope="module")
def params():
  return qwen3.init_params(CFG, jax.random.key(0), std=0.35)


def _forward_routes(params, record) -> np.ndarray:
  """The experts a full forward pass gives the record's positions 0 .. P+R-2 (those
  whose KV the sampler wrote), [n, Ls, k]."""
  tokens = np.concatenate([record.prompt, record.response])[:-1]
  _, seen = qwen3.hidden_states(CFG, params, jnp.asarray(tokens)[None], moe_out=True)
  return np.asarray(seen.experts[0])


def _same_routes(params, records) -> float:
  """The fraction of token-layers whose recorded top-k set is the forward pass's; every
  record's routes cover exactly its written positions."""
  same = total = 0
  for r in records:
    assert r.routes is not None and r.routes.shape == (r.length - 1,) + CFG.route_shape
    ours = np.sort(r.routes.astype(np.int32), -1)
    theirs = np.sort(_forward_routes(params, r), -1)
    same += int(np.all(ours == theirs, axis=-1).sum())
    total += ours.shape[0] * ours.shape[1]
  return same / total


@pytest.mark.parametrize("mode", ["kv", "recompute"])
def test_preempted_samples_keep_the_routes_of_every_position(params, mode):
  """A pool of 10 pages of 8 for 4 slots growing to 50 tokens: the youngest are
  preempted (their routes read back with their tokens), continued later in `mode`, and
  each finished record holds the routes of all its positions, as a forward pass of its
  tokens chooses them."""
  prompts = [p.tolist() for p in random_prompts(7, [5, 9, 3, 12, 7, 4])]
  kw = dict(max_new_tokens=40, num_slots=4, max_len=64, temperature=0.7, seed=3)
  kw.update(page_size=8, kv_pages=10, resume_mode=mode, return_records=True)
  records = sampler.generate(CFG, params, prompts, **kw)
  assert sum(len(r.response) for r in records) > 150
  assert _same_routes(params, records) > 0.995  # float32 decode against a forward pass


def test_speculative_verify_passes_record_the_routes_of_the_tokens_they_keep(params):
  """Drafts checked K = 4 at a time: a pass writes routes at every drafted position, and
  the rejected ones lie past the new length, rewritten by the next pass."""
  prompts = [p.tolist() for p in random_prompts(5, [5, 9, 3, 12])]
  kw = dict(max_new_tokens=30, num_slots=4, max_len=48, temperature=0.7, seed=2)
  records = sampler.generate(CFG, params, prompts, speculative_tokens=4, return_records=True, **kw)
  assert _same_routes(params, records) > 0.995


def _scheduler(params, seed=0):
  config = EngineConfig(num_slots=6, max_len=48, sync_every=4, stop_ids=tuple(range(3, 9)))
  engine = SlotEngine(CFG, params, config)
  counter = iter(range(10**6))

  def source():
    i = next(counter)
    prompt = np.random.default_rng([seed, i]).integers(4, CFG.vocab_size, 3 + i % 4)
    return PromptItem(prompt_id=i, tokens=prompt, answer="")

  settings = RolloutSettings(
      batch_size=1, n_samples_per_prompt=3, over_sampling_batch_size=2, max_response_len=30
  )
  rewards = RewardRunner(
      lambda text, answer: float(len(text)), decode=lambda ids: "x" * len(ids), processes=False
  )
  return AprilScheduler(engine, settings, source, rewards, seed=seed)


def test_routes_survive_apriles_buffer_and_a_checkpoints_arrays(params):
  scheduler = _scheduler(params)
  carried = []
  for step in range(3):
    result = scheduler.step(step)
    trained = [s for g in result.groups for s in g.samples]
    carried += [s for s in trained if s.cuts > 0]
    assert _same_routes(params, trained) > 0.995
    buffered = [s for g in scheduler.buffer for s in g.samples if s.routes is not None]
    restored = PartialBuffer.from_state(scheduler.buffer.to_state())
    again = {(s.group_id, s.index): s for g in restored for s in g.samples}
    for s in buffered:
      np.testing.assert_array_equal(again[(s.group_id, s.index)].routes, s.routes)
  assert carried  # some trained samples were cut at a step's end and continued


def _groups(records, n):
  for i, r in enumerate(records):
    object.__setattr__(r, "group_id", i // n)
  return [
      Group(i, i, records[i * n].prompt, "", records[i * n : (i + 1) * n], 0, [1.0, 0.0] * (n // 2))
      for i in range(len(records) // n)
  ]


def test_a_batch_marks_positions_without_routes_unrecorded(params):
  records = sampler.generate(
      CFG, params, [[5, 6, 7], [8, 9]], max_new_tokens=6, num_slots=2, return_records=True
  )
  object.__setattr__(records[1], "routes", None)  # as a record from before routes were kept
  batch = batch_lib.TrainBatch.from_groups(_groups(records, 2), 0, route_shape=CFG.route_shape)
  n = len(records[0].routes)
  np.testing.assert_array_equal(batch.routes[0, :n], records[0].routes)
  assert (batch.routes[0, n:] == moe.UNRECORDED).all() and (batch.routes[1] == moe.UNRECORDED).all()


def test_replay_keeps_a_bfloat16_rollouts_logprobs_where_its_routes_flipped(params):
  """A bfloat16 sampler against a float32 learner: rounding flips some tokens' experts.
  Replaying the recorded ones, the learner's logprobs at those tokens are as close to the
  sampler's as anywhere (bfloat16's own error); computing its own, they are far off."""
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  prompts = [p.tolist() for p in random_prompts(3, [5, 9, 3, 12, 7, 4, 6, 8])]
  records = sampler.generate(
      CFG, bf16, prompts, max_new_tokens=40, num_slots=8, temperature=1.0, seed=1,
      kv_dtype="bfloat16", return_records=True,
  )  # fmt: skip
  rows = batch_lib.TrainBatch.from_groups(
      _groups(records, 4), 0, route_shape=CFG.route_shape
  ).rows()
  train = dataclasses.replace(TrainSettings(), logprob_chunk=16)
  logp = {}
  for replay in (True, False):
    learner = Learner(
        CFG, jax.tree.map(jnp.copy, params), train, 1.0, total_updates=1, routing_replay=replay
    )
    logp[replay] = learner.logprobs(learner.params, rows)
  _, seen = qwen3.hidden_states(CFG, params, jnp.asarray(rows["tokens"]), moe_out=True)
  own = np.sort(np.asarray(seen.experts), -1)
  recorded = np.sort(rows["routes"].astype(np.int32), -1)
  drawn = rows["mask"] > 0
  flipped = np.any(own != recorded, axis=(-1, -2)) & drawn  # the token's own position
  assert flipped.sum() >= 3
  error = {k: np.abs(v - rows["behavior"]) for k, v in logp.items()}
  noise = error[True][drawn & ~flipped].mean()
  print(
      f"{int(flipped.sum())} of {int(drawn.sum())} drawn tokens' routes flipped; |learner - "
      f"sampler| logprob there: replayed {error[True][flipped].mean():.3f}, own routes "
      f"{error[False][flipped].mean():.3f}; elsewhere, replayed {noise:.3f}"
  )
  assert error[True][flipped].mean() < 2 * noise + 0.01
  assert error[False][flipped].mean() > 5 * error[True][flipped].mean()


def test_a_sharded_sampler_draws_and_records_what_one_device_does(params):
  """Slots over `data`, KV heads and experts' widths over the rest (the sampler's rules)
  on 8 devices: the same tokens and the same routes."""
  mesh = mesh_or_skip((2, 2, 2))
  placed = jax.device_put(params, qwen3.param_shardings(CFG, mesh, sharding.DECODE_RULES))
  prompts = [p.tolist() for p in random_prompts(8, [3, 7, 12, 5, 9, 4])]
  kw = dict(max_new_tokens=12, num_slots=4, temperature=0.7, seed=5, return_records=True)
  plain = sampler.generate(CFG, params, prompts, **kw)
  ours = sampler.generate(CFG, placed, prompts, mesh=mesh, **kw)
  for a, b in zip(ours, plain):
    np.testing.assert_array_equal(a.response, b.response)
    np.testing.assert_array_equal(a.routes, b.routes)


def test_observations_fed_between_turns_have_their_routes(params):
  """Two-turn episodes: a sample stops at a stop token and is held; an observation is
  given and fed into its pages in one chunked prefill; the finished record's routes cover
  the observation's positions as a forward pass over the whole episode chooses them."""
  stops = tuple(range(3, 12))
  config = EngineConfig(
      num_slots=3, max_len=96, sync_every=4, stop_ids=stops, hold_stopped=True, feed_given="prefill"
  )
  engine = SlotEngine(CFG, params, config)
  prompts = np.random.default_rng(1).integers(12, CFG.vocab_size, (4, 6))
  queue = [
      sampler.SampleRecord(prompt=p, max_new_tokens=60, rng=k, temperature=0.0, index=i)
      for i, (p, k) in enumerate(zip(prompts, sampler.sample_keys(0, len(prompts))))
  ]
  turns, done, given = {}, [], 0
  while queue or engine.num_live:
    if queue and engine.num_free:
      engine.admit(queue[: engine.num_free])
      queue = [r for r in queue if not engine.holds(r)]
    for r in engine.step():
      if r.status is not Status.HELD:
        done.append(r)
        continue
      turns[r.index] = turns.get(r.index, 0) + 1
      obs = np.random.default_rng(r.index).integers(12, CFG.vocab_size, 7)
      if turns[r.index] >= 2 or r.budget_left < len(obs) + 1:
        engine.release(r)
        done.append(r)
      else:
        engine.extend(r, obs)
        given += len(obs)
  assert len(done) == 4 and given > 0 and engine.counters.feeds > 0
  assert _same_routes(params, done) > 0.995
