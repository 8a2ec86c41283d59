"""The slot sampler: parity with transformers, refills, snapshot/restore, budgets, compiles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax import buckets, sampler, sharding
from april_jax.models import hf_io, qwen3
from april_jax.sampler import EngineConfig, PromptError, SlotEngine
from april_jax.sampler.records import Status
from conftest import mesh_or_skip, sampler_qwen3
import hf_oracle
from record_builders import random_prompts, sample_records, teacher_forced_logprobs

CFG = sampler_qwen3()


def _run_to_end(engine, records):
  """Admits records as slots free up; returns finished records by index."""
  queue, out = list(records), {}
  while queue or engine.num_live:
    while queue and engine.num_free:
      engine.admit([queue.pop(0)])
    for r in engine.step():
      out[r.index] = r
  return out


def test_greedy_generate_matches_transformers_token_for_token(hf_model_dir):
  hf_oracle.require("torch", "transformers")
  cfg, params = hf_io.load_pretrained(hf_model_dir)
  prompts = [p.tolist() for p in random_prompts(1, [3, 9, 5, 14, 1, 7], cfg.vocab_size)]
  max_new = 12
  # A stop token that the first prompt really produces (its 4th token), so stops are hit.
  (unstopped,) = hf_oracle.generate(hf_model_dir, prompts[:1], max_new)
  eos = unstopped[3]
  expected = hf_oracle.generate(hf_model_dir, prompts, max_new, eos)
  ours = sampler.generate(
      cfg, params, prompts, max_new_tokens=max_new, num_slots=2, eos_ids=(eos,), sync_every=5
  )
  assert ours == expected
  assert ours[0][-1] == eos and len(ours[0]) == unstopped.index(eos) + 1


def test_refilled_slot_decodes_like_alone(sampler_params):
  prompts = random_prompts(2, [4, 11, 6, 17, 3, 9, 5])
  together = _run_to_end(
      SlotEngine(CFG, sampler_params, EngineConfig(num_slots=2, max_len=48, sync_every=4)),
      sample_records(prompts, 20),
  )
  for i, record in enumerate(sample_records(prompts, 20)):
    alone = _run_to_end(
        SlotEngine(CFG, sampler_params, EngineConfig(num_slots=3, max_len=48)), [record]
    )[i]
    np.testing.assert_array_equal(together[i].response, alone.response)
    np.testing.assert_allclose(together[i].logprobs, alone.logprobs, atol=1e-5)


def _interrupted(params, record, mode, cut_steps, sync_every=3):
  """Decodes `record`, snapshots it after `cut_steps` rounds, restores it elsewhere."""
  engine = SlotEngine(CFG, params, EngineConfig(num_slots=4, max_len=64, sync_every=sync_every))
  engine.admit([record])
  for _ in range(cut_steps):
    assert not engine.step()
  (partial,) = engine.snapshot(with_kv=(mode == "kv"))
  assert not partial.finished and 0 < len(partial.response) < partial.max_new_tokens
  kv_shape = None if partial.kv_k is None else partial.kv_k.shape
  used = partial.length - 1
  # Occupy the old slot so the sample resumes in another one.
  blocker = dataclasses.replace(
      sample_records(random_prompts(9, [5]), 30, seed=7)[0], index="blocker"
  )
  engine.admit([blocker])
  [slot] = engine.admit([partial], mode=mode)
  assert slot != 0
  assert partial.kv_k is None  # the host copy is released once back in a slot
  return {r.index: r for r in _drain(engine)}[0], kv_shape, used


def _drain(engine):
  out = []
  while engine.num_live:
    out += engine.step()
  return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_snapshot_then_restore_continues_exactly(sampler_params, temperature):
  record = lambda: sample_records(random_prompts(3, [7]), 25, temperature=temperature)[0]
  (straight,) = _run_to_end(
      SlotEngine(CFG, sampler_params, EngineConfig(num_slots=4, max_len=64, sync_every=3)),
      [record()],
  ).values()
  kv, kv_shape, used = _interrupted(sampler_params, record(), "kv", cut_steps=2)
  assert kv_shape == (CFG.num_layers, used, CFG.num_kv_heads, CFG.head_dim)  # used length
  np.testing.assert_array_equal(kv.response, straight.response)
  np.testing.assert_allclose(kv.logprobs, straight.logprobs, atol=1e-5)
  recompute, kv_shape, _ = _interrupted(sampler_params, record(), "recompute", cut_steps=2)
  assert kv_shape is None
  np.testing.assert_array_equal(recompute.response, straight.response)
  np.testing.assert_allclose(recompute.logprobs, straight.logprobs, atol=1e-5)
  assert len(straight.response) == 25 and straight.finish_reason == "length"


@pytest.mark.parametrize("mode", ["kv", "recompute"])
def test_batched_resume_of_many_partials_continues_each_exactly(sampler_params, mode):
  """add_partials puts back samples of different lengths (several KV buckets, more
  samples than one call's width) into other slots; each continues as if never stopped."""
  make = lambda: sample_records(
      random_prompts(5, [3, 14, 6, 20, 9, 2]), 22, temperature=1.0, seed=4
  )
  config = EngineConfig(num_slots=8, max_len=64, sync_every=3, snapshot_width=4)
  straight = _run_to_end(SlotEngine(CFG, sampler_params, config), make())
  engine = SlotEngine(CFG, sampler_params, config)
  for r in make():
    engine.admit([r])
  engine.step()
  engine.step()
  partials = engine.snapshot(with_kv=(mode == "kv"))
  assert len(partials) == 6 and len({len(p.response) for p in partials}) == 1
  assert len({engine.bucket(p.length - 1) for p in partials}) > 1  # several KV buckets
  blockers = sample_records(random_prompts(9, [5, 4]), 30, seed=7)
  for b in blockers:
    engine.admit(
        [dataclasses.replace(b, index=f"blocker{b.index}")]
    )  # occupy slots 0 and 1, so every sample lands elsewhere
  slots = engine.admit(partials[::-1], mode=mode)
  assert sorted(slots) == list(range(2, 8))
  assert all(p.kv_k is None for p in partials)
  resumed = {r.index: r for r in _drain(engine)}
  for i, r in straight.items():
    np.testing.assert_array_equal(resumed[i].response, r.response)
    np.testing.assert_allclose(resumed[i].logprobs, r.logprobs, atol=1e-5)
    assert resumed[i].finish_reason == r.finish_reason


def test_without_refill_decoding_runs_through_finishes_and_reports_completion_order(sampler_params):
  config = EngineConfig(num_slots=2, max_len=64, sync_every=8)
  make = lambda: sample_records(random_prompts(2, [4, 4]), 6, temperature=1.0)
  # With refill: back to the host at the first finish.
  engine = SlotEngine(CFG, sampler_params, config)
  early, late = make()
  late, early = dataclasses.replace(late, max_new_tokens=6), dataclasses.replace(
      early, max_new_tokens=3
  )
  engine.admit([late])  # slot 0 finishes last ...
  engine.admit([early])  # ... slot 1 first
  assert engine.step(refill=True) == [early] and engine.counters.decode_steps == 3
  # Without: one window of sync_every steps holds both finishes, reported in their order.
  engine = SlotEngine(CFG, sampler_params, config)
  early, late = make()
  late, early = dataclasses.replace(late, max_new_tokens=6), dataclasses.replace(
      early, max_new_tokens=3
  )
  engine.admit([late])
  engine.admit([early])
  assert engine.step(refill=False) == [early, late] and engine.counters.decode_steps == 6
  assert len(early.response) == 3 and len(late.response) == 6


def test_behavior_logprobs_equal_tempered_log_softmax_of_full_forward(sampler_params):
  temperature = 0.7
  records = _run_to_end(
      SlotEngine(CFG, sampler_params, EngineConfig(num_slots=3, max_len=48, sync_every=4)),
      sample_records(random_prompts(4, [5, 8, 2, 12]), 15, temperature=temperature),
  )
  for r in records.values():
    np.testing.assert_allclose(
        r.logprobs, teacher_forced_logprobs(CFG, sampler_params, r, temperature), atol=1e-4
    )
    np.testing.assert_array_equal(r.versions, 0)


@pytest.mark.parametrize("mode", ["kv", "recompute"])
def test_a_token_is_tagged_current_only_if_current_params_drew_it_over_current_kv(
    sampler_params, mode
):
  """Params A draw 4 tokens; snapshot; params B (version 1) continue the sample. In mode
  kv the new tokens attend to A's KV: they keep A's version. In mode recompute the KV is
  B's: they are tagged 1, and their logged logprobs are B's."""
  params_b = qwen3.init_params(CFG, jax.random.key(5), std=0.35)
  temperature = 1.0
  engine = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=2, max_len=64, sync_every=4))
  engine.admit(sample_records(random_prompts(5, [6]), 20, temperature=temperature)[:1])
  engine.step()
  (partial,) = engine.snapshot(with_kv=(mode == "kv"))
  assert partial.kv_version == (0 if mode == "kv" else None)
  engine.set_policy(params_b, 1)
  engine.admit([partial], mode=mode)
  (done,) = _drain(engine)
  expected_tags = [0] * 4 + [0 if mode == "kv" else 1] * 16
  np.testing.assert_array_equal(done.versions, expected_tags)
  under_b = teacher_forced_logprobs(CFG, params_b, done, temperature)
  current = done.versions == 1
  np.testing.assert_allclose(done.logprobs[current], under_b[current], atol=1e-4)
  # The old tags are earned: those tokens' logged logprobs are not B's.
  assert np.max(np.abs(done.logprobs[~current] - under_b[~current])) > 0.05


def test_new_params_over_a_live_slot_keep_the_kv_s_version(sampler_params):
  engine = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=2, max_len=64, sync_every=4))
  engine.admit(sample_records(random_prompts(5, [6]), 30)[:1])
  engine.step()
  engine.set_policy(sampler_params, 1)  # the slot's KV is still version 0's
  engine.step()
  (partial,) = engine.snapshot(with_kv=False)
  engine.set_policy(sampler_params, 2)
  engine.admit([partial], mode="recompute")  # recomputed: the KV is version 2's
  engine.step()
  (partial,) = engine.snapshot(with_kv=True)
  assert partial.kv_version == 2
  engine.set_policy(sampler_params, 3)
  engine.admit([partial], mode="kv")  # put back: still version 2's KV
  (done,) = _drain(engine)
  np.testing.assert_array_equal(done.versions, [0] * 8 + [2] * 22)


def test_token_budget_holds_across_snapshots_and_restores(sampler_params):
  record = sample_records(random_prompts(6, [9]), 13)[0]
  engine = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=2, max_len=32, sync_every=2))
  engine.admit([record])
  for mode in ("kv", "recompute", "kv", "recompute"):
    engine.step()
    (record,) = engine.snapshot(with_kv=(mode == "kv"))
    engine.admit([record], mode=mode)
  (done,) = _drain(engine)
  assert len(done.response) == 13 and done.finish_reason == "length"
  assert len(done.logprobs) == len(done.versions) == 13


def test_group_prefills_once_and_siblings_differ_by_rng(sampler_params):
  records = sample_records([random_prompts(7, [6])[0]] * 4, 10, temperature=1.0)
  engine = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=4, max_len=32))
  assert engine.admit(records) == [0, 1, 2, 3]
  responses = {tuple(r.response) for r in _drain(engine)}
  assert len(responses) == 4  # same prompt and KV, different draws


def test_a_group_started_one_sample_at_a_time_prefills_its_prompt_once(sampler_params):
  # Two slots for a group of four: its samples start as slots free up, as under APRIL.
  prompt = random_prompts(7, [6])[0]
  whole = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=4, max_len=32))
  whole.admit(sample_records([prompt] * 4, 10, temperature=1.0))
  want = {r.index: r for r in _drain(whole)}
  engine = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=2, max_len=32))
  got = _run_to_end(engine, sample_records([prompt] * 4, 10, temperature=1.0))
  assert whole.counters.prefills == engine.counters.prefills == 1
  for i in range(4):  # the kept KV is the prefill's, bit for bit
    np.testing.assert_array_equal(got[i].response, want[i].response)
    np.testing.assert_array_equal(got[i].logprobs, want[i].logprobs)
  # New weights, or a new policy version: the prompt is prefilled again.
  engine.set_policy(jax.tree.map(lambda x: x * 1.0, sampler_params), engine.version)
  engine.admit(sample_records([prompt], 10))
  engine.set_policy(engine.params, engine.version + 1)
  engine.admit(sample_records([prompt], 10, seed=1))
  assert engine.counters.prefills == 3


def test_prompts_that_start_together_share_prefill_calls_and_each_slot_gets_its_own(sampler_params):
  # Six prompts of two samples each, started in one call: the four of bucket 16 share a
  # prefill call (prefill_width 4), the 32 and the 64 each take one (4 x 64 > max_len).
  prompts = random_prompts(13, [5, 20, 9, 40, 14, 3])
  groups = [sample_records([p] * 2, 12, temperature=0.0, seed=i) for i, p in enumerate(prompts)]
  engine = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=12, max_len=64))
  slots = engine.admit([r for g in groups for r in g])
  assert sorted(slots) == list(range(12))
  assert engine.counters.prefills == 3
  _drain(engine)
  for p, group in zip(prompts, groups):  # each sample decodes its own prompt
    alone = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=2, max_len=64))
    want = alone.admit(sample_records([p], 12, temperature=0.0)) and _drain(alone)[0]
    for r in group:
      np.testing.assert_array_equal(r.response, want.response)
      np.testing.assert_allclose(r.logprobs, want.logprobs, atol=1e-5)


def test_the_last_prompt_of_a_shared_prefill_is_kept_for_the_rest_of_its_group(sampler_params):
  # Five slots for three groups of two: the third group's second sample starts later,
  # from the kept KV of the call that prefilled all three prompts.
  prompts = random_prompts(17, [6, 11, 4])
  groups = [sample_records([p] * 2, 8, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
  engine = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=5, max_len=64))
  engine.admit(groups[0] + groups[1] + groups[2][:1])
  assert engine.counters.prefills == 1
  engine.step()
  engine.admit(groups[2][1:])
  assert engine.counters.prefills == 1
  # A prompt of that call other than the last is prefilled again: only one is kept.
  engine.admit(sample_records([prompts[0]], 8, seed=9))
  assert engine.counters.prefills == 2
  _drain(engine)
  assert all(r.finished and len(r.response) == 8 for g in groups for r in g)


def test_prefill_rows_follow_the_longest_prompt_and_max_len():
  config = EngineConfig(num_slots=2, max_len=256, prompt_len=40, prefill_width=4)
  # Up to the longest prompt's bucket (64), and 4 x 64 tokens <= max_len.
  assert [config.prefill_rows(b) for b in (16, 32, 64, 128)] == [4, 4, 4, 1]
  assert EngineConfig(num_slots=2, max_len=100, prompt_len=40).prefill_rows(64) == 1
  assert EngineConfig(num_slots=2, max_len=256, prefill_width=1).prefill_rows(16) == 1
  for bad in (dict(prompt_len=0), dict(prompt_len=300), dict(prefill_width=0)):
    with pytest.raises(ValueError, match="EngineConfig.(prompt_len|prefill_width)"):
      EngineConfig(num_slots=2, max_len=256, **bad)


def test_a_prefill_call_runs_beside_at_most_one_other_call_s_kv(sampler_params):
  # Prompts started in one call, some after a call whose KV is kept: while each prefill
  # runs, at most one other call's KV is alive (the memory plan's kept line), not the
  # call before it, which is inserted by then.
  engine = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=12, max_len=64))
  prefill, alive = engine.fns.prefill_kv, []
  is_kv = lambda a: a.ndim == 5 and a.shape[0] == CFG.num_layers and a.shape[3:] == (2, 16)

  def counted(p, tokens):
    alive.append(sum(map(is_kv, jax.live_arrays())) // 2)  # k and v
    return prefill(p, tokens)

  engine.fns = dataclasses.replace(engine.fns, prefill_kv=counted)
  engine.admit(sample_records(random_prompts(1, [5]), 4))  # kept
  engine.admit(
      [sample_records([p], 4, seed=i)[0] for i, p in enumerate(random_prompts(2, [5] * 8))]
  )
  engine.admit(
      [sample_records([p], 4, seed=i)[0] for i, p in enumerate(random_prompts(3, [5] * 3))]
  )
  assert len(alive) == 4 and max(alive) <= 1, alive


def test_no_compilation_after_warm_up(sampler_params, compiles):
  engine = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=3, max_len=64, sync_every=3))

  def workload(seed):
    records = sample_records(
        random_prompts(seed, [5, 20, 9, 33, 14, 2]), 18, temperature=1.0, seed=seed
    )
    engine.admit(records[:3])  # a shared prefill (bucket 16) and one alone
    engine.step()
    for mode, keep in (("kv", False), ("kv", True), ("recompute", False)):
      for partial in engine.snapshot(with_kv=(mode == "kv"), keep=keep):
        engine.admit([partial], mode=mode)
      engine.step()
    kept = engine.snapshot(keep=True)
    engine.copy_out_kept()  # as a checkpoint does; then continued from the host copy
    for partial in kept:
      engine.admit([partial], mode="kv")
    return _run_to_end(engine, records[3:])

  workload(0)  # warm-up: every bucket and resume path once
  before, sizes = len(compiles), engine.fns.cache_sizes()
  assert before > 0  # the listener sees compiles
  for seed in (1, 2, 3):
    workload(seed)
  assert len(compiles) == before, compiles[before:]
  assert engine.fns.cache_sizes() == sizes
  # A new engine of the same settings (each `generate` builds one) compiles nothing either.
  engine = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=3, max_len=64, sync_every=3))
  workload(4)
  assert len(compiles) == before, compiles[before:]


@pytest.mark.parametrize("mesh_shape,experts", [(None, 0), ((2, 2, 2), 0), (None, 4)])
def test_warm_up_compiles_everything_a_run_needs(sampler_params, mesh_shape, experts, compiles):
  """...for a dense model, on a mesh, and for a mixture of experts (its routes read back)."""
  mesh = mesh_or_skip(mesh_shape)
  cfg = CFG
  if experts:
    cfg = dataclasses.replace(
        CFG, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=32
    )
    sampler_params = qwen3.init_params(cfg, jax.random.key(0), std=0.35)
  if mesh is not None:
    sampler_params = jax.device_put(sampler_params, qwen3.param_shardings(cfg, mesh))
  # A slot shape no other test uses, so nothing is cached before warm_up.
  engine = SlotEngine(
      cfg, sampler_params, EngineConfig(num_slots=5, max_len=80, sync_every=5), mesh=mesh
  )
  assert engine.warm_up() == len(buckets.all_buckets(16, 80))
  before, sizes = len(compiles), engine.fns.cache_sizes()
  assert before > 0
  engine.admit(sample_records(random_prompts(12, [9, 5]), 19))  # one prefill call
  _drain(engine)
  records = sample_records(random_prompts(11, [3, 30, 12, 61, 7, 20, 45]), 19, temperature=1.0)
  engine.admit(records[:1] * 1)
  for mode in ("kv", "recompute"):
    engine.step()
    for partial in engine.snapshot(with_kv=(mode == "kv")):
      engine.admit([partial], mode=mode)
  engine.admit(records[1:2] * 1)
  engine.step()
  engine.admit(engine.snapshot(with_kv=True), mode="kv")  # batched resume path
  _drain(engine)
  _run_to_end(engine, records[2:])
  assert compiles[before:] == []
  # Nor traced: a sample's host KV goes in as device arrays, as a prefill's KV does.
  assert engine.fns.cache_sizes() == sizes


def test_bad_prompts_raise_naming_the_prompt_or_are_counted_when_skipped(sampler_params):
  with pytest.raises(PromptError, match="prompt 1: empty prompt"):
    sampler.generate(CFG, sampler_params, [[1, 2], []], max_new_tokens=4)
  with pytest.raises(PromptError, match="prompt 0: prompt of 40 tokens.*max_len=32"):
    sampler.generate(CFG, sampler_params, [[1] * 40, [3]], max_new_tokens=4, max_len=32)
  records = sampler.generate(
      CFG,
      sampler_params,
      [[1] * 40, [], [5, 6]],
      max_new_tokens=4,
      max_len=32,
      on_invalid="skip",
      return_records=True,
  )
  assert [r.status for r in records] == [Status.REJECTED, Status.REJECTED, Status.FINISHED]
  assert records[2].finish_reason == "length"
  assert len(records[2].response) == 4


def test_sharded_generate_equals_unsharded_with_slots_over_data_kv_heads_over_the_rest(
    sampler_params,
):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 (CPU) devices")
  # The sampler's rules: slots over data, KV heads (2 here) over fsdp x tensor.
  mesh = sharding.make_mesh((2, 2, 1), jax.devices()[:4])
  sharded_params = jax.device_put(sampler_params, qwen3.param_shardings(CFG, mesh))
  prompts = [p.tolist() for p in random_prompts(8, [3, 7, 12, 5, 9, 4])]
  plain = sampler.generate(CFG, sampler_params, prompts, max_new_tokens=10, num_slots=4)
  ours = sampler.generate(CFG, sharded_params, prompts, max_new_tokens=10, num_slots=4, mesh=mesh)
  assert ours == plain
  engine = SlotEngine(CFG, sharded_params, EngineConfig(num_slots=4, max_len=32), mesh=mesh)
  spec = engine.state.kv.k.sharding.spec  # [L, S, K, M, H]
  assert spec[1] == "data" and spec[2] == "fsdp"


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_bfloat16_params_decode_over_a_cache_of_either_dtype(sampler_params, kv_dtype):
  """model.dtype=bfloat16 with the default float32 KV cache (or a bf16 one) decodes, and
  greedily agrees with the float32 model on most tokens."""
  params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), sampler_params)
  prompts = random_prompts(11, [5, 9, 3, 7])
  outs16 = sampler.generate(
      CFG, params16, prompts, max_new_tokens=12, num_slots=4, kv_dtype=kv_dtype
  )
  outs32 = sampler.generate(CFG, sampler_params, prompts, max_new_tokens=12, num_slots=4)
  assert [len(o) for o in outs16] == [12] * 4
  first_tokens_equal = np.mean([a[0] == b[0] for a, b in zip(outs16, outs32)])
  assert first_tokens_equal >= 0.75


@pytest.mark.parametrize("mode", ["kv", "recompute"])
def test_an_exhausted_pool_preempts_and_loses_nothing(sampler_params, mode):
  # 4 slots of 64 positions, pages of 8; the pool holds 10 pages (80 positions), so
  # four samples growing to 60 tokens cannot all stay: the youngest are preempted,
  # continued later, and every response equals the one decoded with a full pool.
  prompts = [p.tolist() for p in random_prompts(7, [5, 9, 3, 12, 7, 4])]
  kw = dict(max_new_tokens=48, num_slots=4, max_len=64, temperature=0.7, seed=3)
  full = sampler.generate(CFG, sampler_params, prompts, page_size=8, return_records=True, **kw)
  tight = sampler.generate(
      CFG, sampler_params, prompts, page_size=8, kv_pages=10, return_records=True, **kw
  )
  assert [r.response.tolist() for r in tight] == [r.response.tolist() for r in full]
  np.testing.assert_allclose(
      np.concatenate([r.logprobs for r in tight]),
      np.concatenate([r.logprobs for r in full]),
      rtol=1e-5,
      atol=1e-5,
  )
  assert all(len(r.response) == 48 or r.finish_reason == "stop" for r in tight)


def test_generate_with_a_pool_that_preempts_fresh_and_started_slots_equals_a_full_pool(
    sampler_params,
):
  """Six slots, 18 prompts, 12 pages of 8: a slot preempted before its first token comes
  back beside started ones (a fresh sample again), and every response is the one a pool
  with room for all draws."""
  rng = np.random.default_rng(17)
  prompts = [p.tolist() for p in random_prompts(17, rng.integers(2, 12, 18))]
  kw = dict(max_new_tokens=int(rng.integers(20, 50)), num_slots=6, max_len=64, sync_every=8)
  kw.update(page_size=8, temperature=0.7, seed=17, return_records=True)
  tight = sampler.generate(CFG, sampler_params, prompts, kv_pages=12, **kw)
  full = sampler.generate(CFG, sampler_params, prompts, **kw)
  for a, b in zip(tight, full):
    np.testing.assert_array_equal(a.response, b.response)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  assert sum(len(r.response) for r in tight) == 378


def test_an_exhausted_pool_counts_preemptions_and_frees_every_page(sampler_params):
  config = EngineConfig(num_slots=4, max_len=64, sync_every=8, page_size=8, kv_pages=10)
  engine = SlotEngine(CFG, sampler_params, config)
  records = sample_records(random_prompts(8, [6, 6, 6, 6]), max_new_tokens=50, temperature=0.0)
  out = {}
  queue = list(records)
  while queue or engine.num_live:
    while queue and engine.room_for([queue[0]]):
      r = queue.pop(0)
      engine.admit([r])
    for r in engine.step(refill=bool(queue)):
      out[r.index] = r
    queue[:0] = engine.take_preempted()
  assert engine.counters.preemptions > 0
  assert sorted(out) == [0, 1, 2, 3] and all(len(r.response) == 50 for r in out.values())
  assert engine.kv.book.used() == 0 and engine.kv.book.free() == 10  # every usable page


def test_a_sample_given_twice_or_already_held_takes_no_second_slot(sampler_params):
  engine = SlotEngine(CFG, sampler_params, EngineConfig(num_slots=4, max_len=32, page_size=8))
  a, b = sample_records(random_prompts(9, [5, 5]), max_new_tokens=8)
  b = dataclasses.replace(b, prompt=a.prompt)  # one group: the same prompt
  with pytest.raises(ValueError, match="one slot only"):
    engine.admit([a, a])
  assert engine.num_free == 4 and engine.kv.book.used() == 0
  engine.admit([a, b])
  with pytest.raises(ValueError, match="one slot only"):
    engine.admit([a])
  assert engine.num_free == 2 and engine.num_live == 2
  done = []
  while engine.num_live:
    done += engine.step()
  assert sorted(map(id, done)) == sorted([id(a), id(b)]) and engine.num_free == 4


def test_a_pool_that_cannot_hold_one_sequence_is_refused_by_name():
  with pytest.raises(ValueError, match="kv_pages=7 cannot hold one sequence of max_len=64"):
    EngineConfig(num_slots=4, max_len=64, page_size=8, kv_pages=7)
  with pytest.raises(ValueError, match="page_size must be a power of two"):
    EngineConfig(num_slots=4, max_len=64, page_size=12)
