"""Speculative decoding: the accept rule, where drafts come from, and that every sample
draws the tokens plain decoding draws (float32), through refills, stops, preemption,
snapshots, given tokens, unmerged LoRA and a mesh, with fewer decode calls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.models import lora, qwen3
from april_jax.sampler import EngineConfig, SampleRecord, SlotEngine
from april_jax.sampler.speculation import decode as speculative
from april_jax.sampler.speculation import drafts
from april_jax.sampler.speculation.history import DraftHistory
from april_jax.sampler.records import Status
from april_jax.sampler.speculation.choice import SpeculationChoice, live_bucket
from conftest import mesh_or_skip, sampler_qwen3

CFG = sampler_qwen3()
STOPS = (3, 17)


# ------------------------------------------------------------------ the accept rule
def _accepted(draft, drawn, count, stops=(9,)):
  draft, drawn = jnp.array([draft]), jnp.array([drawn])
  e = drafts.accepted(draft, drawn, jnp.array([count]), jnp.isin(drawn, jnp.array(stops)))
  return int(e[0])


def test_drafts_that_agree_keep_every_draw_and_the_one_after_them():
  assert _accepted([4, 5, 6], [4, 5, 6, 7], 3) == 3  # 4 tokens: 3 drafts + the next draw


@pytest.mark.parametrize("wrong_at", [0, 1, 2])
def test_the_first_disagreement_is_kept_as_drawn_and_ends_the_pass(wrong_at):
  draft = [4, 5, 6]
  drawn = [4, 5, 6, 7]
  drawn[wrong_at] = 40
  assert _accepted(draft, drawn, 3) == wrong_at


def test_a_drawn_stop_token_ends_the_pass_even_where_the_draft_guessed_it():
  assert _accepted([4, 9, 6], [4, 9, 6, 7], 3) == 1  # the stop is kept, nothing after it
  assert _accepted([9, 5, 6], [9, 5, 6, 7], 3) == 0


def test_drafts_past_the_count_are_never_taken():
  # The budget (or the pages) allowed one draft: the second, though right, is not used.
  assert _accepted([4, 5, 6], [4, 5, 6, 7], 1) == 1
  assert _accepted([4, 5, 6], [4, 5, 6, 7], 0) == 0


# ------------------------------------------------------------------- draft sources
def _row(tokens, M=16):
  out = np.zeros(M, np.int32)
  out[: len(tokens)] = tokens
  return out


def _propose(rows, lengths, groups, K=3, ngram=3, suggested=None, history=()):
  """drafts.propose over rows of 16 tokens; history: per slot, its rows (or none)."""
  tokens = jnp.array(np.stack([_row(r) for r in rows]))
  S, M = tokens.shape
  H = max([len(h) for h in history], default=0)
  hist, hist_len = np.full((S, H, M), -1, np.int32), np.zeros((S, H), np.int32)
  for s, slot_rows in enumerate(history):
    for i, row in enumerate(slot_rows):
      hist[s, i, : len(row)], hist_len[s, i] = row, len(row)
  sug = np.full((S, M), -1, np.int32) if suggested is None else suggested
  inputs = drafts.DraftInputs(jnp.array(sug), jnp.array(hist), jnp.array(hist_len))
  d = drafts.propose(tokens, jnp.array(lengths), jnp.array(groups), inputs, K, ngram)
  return np.asarray(d.tokens), np.asarray(d.count), np.asarray(d.source)


def test_own_tokens_continue_the_longest_latest_match_of_the_suffix():
  # Suffix "1 2 3": matched at positions 0-2 (then 7) and 4-6 (then 8); the later wins.
  tokens, count, source = _propose([[1, 2, 3, 7, 1, 2, 3, 8, 5, 1, 2, 3]], [12], [-1])
  assert tokens[0].tolist() == [8, 5, 1] and count[0] == 3
  assert drafts.SOURCES[source[0] - 1] == "own"
  # A three-token match beats a later one-token match.
  tokens, count, _ = _propose([[1, 2, 3, 6, 3, 4, 1, 2, 3]], [9], [-1])
  assert tokens[0, 0] == 6 and count[0] == 3


def test_a_match_near_the_row_s_end_drafts_only_what_follows_it():
  # "5 6" ends at position 1, and only positions 2-3 follow it in the row: two drafts.
  tokens, count, _ = _propose([[5, 6, 5, 6]], [4], [-1])
  assert count[0] == 2 and tokens[0, :2].tolist() == [5, 6]


def test_a_group_row_drafts_when_the_own_row_has_no_match_and_other_groups_never_do():
  rows = [[1, 2, 3, 4], [1, 2, 3, 4, 8, 9, 10, 11], [3, 4, 7, 7, 7, 7]]
  # Slot 0 ("... 3 4") finds "3 4" in slot 1's row (same group) and takes "8 9 10";
  # slot 2, of another group, holds "3 4 7 7 ..." but is not searched.
  tokens, count, source = _propose(rows, [4, 8, 6], [5, 5, 6])
  assert tokens[0].tolist() == [8, 9, 10] and count[0] == 3
  assert drafts.SOURCES[source[0] - 1] == "group"
  _, count, source = _propose(rows, [4, 8, 6], [5, 7, 6])
  assert count[0] == 0 and source[0] == 0


def test_history_rows_draft_and_a_longer_match_beats_an_own_row_tie():
  # Slot 0 ends "4 5 6"; its own row holds "5 6" then 1, its history "4 5 6" then 7 8 9.
  tokens, count, source = _propose([[5, 6, 1, 4, 5, 6]], [6], [-1], history=[[[4, 5, 6, 7, 8, 9]]])
  assert tokens[0].tolist() == [7, 8, 9] and count[0] == 3
  assert drafts.SOURCES[source[0] - 1] == "history"
  # An equally long match in the own row wins over the history's.
  tokens, _, source = _propose([[4, 5, 6, 1, 4, 5, 6]], [7], [-1], history=[[[4, 5, 6, 7]]])
  assert tokens[0, 0] == 1 and drafts.SOURCES[source[0] - 1] == "own"


def test_suggested_tokens_come_first_up_to_the_first_unset_position():
  sug = np.full((1, 16), -1, np.int32)
  sug[0, 4:6] = [30, 31]  # positions 4, 5 suggested, 6 not
  tokens, count, source = _propose([[1, 2, 1, 2]], [4], [-1], suggested=sug)
  assert tokens[0, :2].tolist() == [30, 31] and count[0] == 2
  assert drafts.SOURCES[source[0] - 1] == "suggested"


# --------------------------------------------------- same tokens as plain decoding
def _engine(params, K, mesh=None, **kw):
  config = dict(num_slots=4, max_len=96, sync_every=4, stop_ids=STOPS, page_size=8) | kw
  return SlotEngine(CFG, params, EngineConfig(**config, speculative_tokens=K), mesh=mesh)


def _grouped(n=6, budget=60, seed=0, offset=0, **kw):
  """n samples in groups of two (group ids offset + i // 2), each group's prompt a
  phrase of 4 random tokens three times, so own-row matches are found."""
  rng = np.random.default_rng(seed)
  phrase = [rng.integers(20, CFG.vocab_size, 4) for _ in range(-(-n // 2))]
  keys = np.random.default_rng(seed + 1).integers(0, 2**32, (n, 2), dtype=np.uint32)
  return [
      SampleRecord(
          prompt=np.tile(phrase[i // 2], 3).astype(np.int32),
          max_new_tokens=budget,
          rng=keys[i],
          index=offset + i,
          group_id=offset + i // 2,
          **kw,
      )
      for i in range(n)
  ]


def _drain(engine, records, cut_every=0, mode="kv"):
  """Runs the records through the engine, refilling freed slots; with cut_every, every
  that many steps each unfinished sample is snapshotted and put back (mode). Returns
  the records by index."""
  queue, out, steps = list(records), {}, 0
  while queue or engine.num_live:
    if queue and engine.num_free:
      n = engine.room_for(queue)
      engine.admit(queue[:n])
      queue = queue[n:]
    for r in engine.step():
      out[r.index] = r
    queue = engine.take_preempted() + queue
    steps += 1
    if cut_every and steps % cut_every == 0 and engine.num_live:
      queue = engine.snapshot(with_kv=mode == "kv") + queue
  return out


def _assert_same_draws(a, b):
  assert sorted(a) == sorted(b)
  for i in a:
    np.testing.assert_array_equal(a[i].response, b[i].response)
    np.testing.assert_allclose(a[i].logprobs, b[i].logprobs, atol=1e-5)
    np.testing.assert_array_equal(a[i].versions, b[i].versions)
    assert a[i].finish_reason == b[i].finish_reason


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, top_k=20)],
)
def test_speculation_draws_the_tokens_plain_decoding_draws(sampler_params, sampling):
  plain = _engine(sampler_params, 0)
  spec = _engine(sampler_params, 4)
  a = _drain(plain, _grouped(**sampling))
  b = _drain(spec, _grouped(**sampling))
  _assert_same_draws(a, b)
  c, d = plain.counters, spec.counters
  assert d.tokens_generated == c.tokens_generated
  assert sum(d.drafted.values()) > 0  # the repeated phrases gave drafts
  assert 0 <= sum(d.accepted.values()) <= sum(d.drafted.values())
  if sampling["temperature"] == 0.0:  # greedy text repeats itself: drafts are taken
    assert sum(d.accepted.values()) > 0 and d.decode_steps < c.decode_steps
  assert spec.kv.book.used() == 0 and spec.num_live == 0


def test_right_suggestions_make_several_tokens_a_pass_and_wrong_ones_change_nothing(sampler_params):
  truth = _drain(_engine(sampler_params, 0), _grouped())
  plain_steps = sum(len(r.response) for r in truth.values())
  for wrong_rate, seed in ((0.0, 1), (0.3, 2), (1.0, 3)):
    spec = _engine(sampler_params, 4)
    records = _grouped()
    rng = np.random.default_rng(seed)
    spec.admit(records[:4])
    queue, out = records[4:], {}
    for r in records[:4]:
      spec.suggest(r, _corrupted(truth[r.index].response, wrong_rate, rng))
    while queue or spec.num_live:
      for r in spec.step():
        out[r.index] = r
      if queue and spec.num_free:
        spec.admit([queue[0]])
        spec.suggest(queue[0], _corrupted(truth[queue[0].index].response, wrong_rate, rng))
        queue = queue[1:]
    _assert_same_draws(truth, out)
    c = spec.counters
    if wrong_rate == 0.0:
      # Every suggested draft is right up to the sample's end: 5 tokens a pass at best.
      assert c.accepted["suggested"] == c.drafted["suggested"] > 0
      assert c.tokens_generated / c.decode_steps > 2.0
    if wrong_rate == 1.0:
      assert c.accepted["suggested"] == 0
    assert c.tokens_generated == plain_steps


def _corrupted(tokens, rate, rng):
  """tokens with each replaced by another token at `rate`."""
  tokens = np.array(tokens)
  wrong = rng.random(len(tokens)) < rate
  tokens[wrong] = (tokens[wrong] + 1 + rng.integers(0, CFG.vocab_size - 1, wrong.sum())) % (
      CFG.vocab_size
  )
  return tokens


@pytest.mark.parametrize("mode", ["kv", "recompute"])
def test_preemption_and_snapshots_keep_the_same_draws(sampler_params, mode):
  truth = _drain(_engine(sampler_params, 0), _grouped())
  # A pool of 16 pages of 8: four samples growing past 70 tokens cannot all stay.
  tight = _engine(sampler_params, 3, kv_pages=16, resume_mode=mode)
  _assert_same_draws(truth, _drain(tight, _grouped()))
  assert tight.counters.preemptions > 0
  cut = _engine(sampler_params, 3)
  _assert_same_draws(truth, _drain(cut, _grouped(), cut_every=3, mode=mode))


def _episodes(engine, records, turns=2):
  """Each sample's stops answered with an observation of 6 tokens (given, never
  drafted), `turns` times; the records by index."""
  queue, out, turn = list(records), {}, {}
  while queue or engine.num_live:
    if queue and engine.num_free:
      n = min(engine.num_free, len(queue))
      engine.admit(queue[:n])
      queue = queue[n:]
    for r in engine.step():
      if r.status is not Status.HELD:
        out[r.index] = r
        continue
      turn[r.index] = turn.get(r.index, 0) + 1
      obs = (np.arange(6) * 7 + int(r.response.sum())) % 50 + 20  # never a stop token
      if turn[r.index] > turns or r.budget_left < len(obs) + 1:
        engine.release(r)
        out[r.index] = r
      else:
        engine.extend(r, obs.astype(np.int32))
  return out


@pytest.mark.parametrize("feed_given", ["prefill", "decode"])
def test_given_tokens_of_a_multi_turn_episode_keep_the_same_draws(sampler_params, feed_given):
  kw = dict(hold_stopped=True, feed_given=feed_given)
  truth = _episodes(_engine(sampler_params, 0, **kw), _grouped(budget=80))
  spec = _engine(sampler_params, 4, **kw)
  ours = _episodes(spec, _grouped(budget=80))
  _assert_same_draws(truth, ours)
  assert any((r.logprobs == 0).any() for r in ours.values())  # observations were given


def test_unmerged_lora_adapters_keep_the_same_draws(sampler_params):
  spec = lora.LoraSpec(4, 8.0, lora.TARGETS)
  adapters = lora.init(CFG, spec, jax.random.key(5))
  for i, ab in enumerate(adapters["layers"].values()):
    ab["b"] = 0.05 * jax.random.normal(jax.random.key(i), ab["b"].shape, jnp.float32)
  params = lora.decode_view(sampler_params, lora.decode_adapters(adapters, spec, jnp.float32))
  _assert_same_draws(_drain(_engine(params, 0), _grouped()), _drain(_engine(params, 4), _grouped()))


def test_on_a_mesh_speculation_draws_what_one_device_draws(sampler_params):
  mesh = mesh_or_skip((2, 2, 2))
  sharded = jax.device_put(sampler_params, qwen3.param_shardings(CFG, mesh))
  truth = _drain(_engine(sampler_params, 0), _grouped())
  spec = _engine(sharded, 4, mesh=mesh)
  _assert_same_draws(truth, _drain(spec, _grouped()))
  assert sum(spec.counters.drafted.values()) > 0
  # 10 slots over 2 shards, 12 samples: passes of 10 rows while 9 or 10 are live, then
  # of 8 (fewer than the slots, which lie on both shards).
  wide = _engine(sharded, 4, mesh=mesh, num_slots=10)
  truth = _drain(_engine(sampler_params, 0, num_slots=10), _grouped(n=12))
  _assert_same_draws(truth, _drain(wide, _grouped(n=12)))


def test_a_verify_pass_computes_the_narrowest_width_that_holds_the_live_slots():
  assert speculative.widths(256) == [8, 16, 32, 64, 128, 256]
  assert speculative.widths(12) == [8, 12] and speculative.widths(3) == [3]
  assert [speculative.width_for(n, 12) for n in (1, 8, 9, 12)] == [8, 8, 12, 12]


def test_after_warm_up_speculation_compiles_nothing(sampler_params, compiles):
  # 10 slots: verify widths 8 and 10, both compiled by warm-up.
  engine = SlotEngine(
      CFG,
      sampler_params,
      EngineConfig(num_slots=10, max_len=72, sync_every=3, stop_ids=STOPS, speculative_tokens=2),
  )
  engine.warm_up()
  before = len(compiles)
  _drain(engine, _grouped(n=14), cut_every=2)  # 10 live, then fewer: both widths
  assert compiles[before:] == []


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("speculative_tokens", -1, r"speculative_tokens must be in \[0, 32\].*got -1"),
        ("speculative_tokens", 33, r"speculative_tokens must be in \[0, 32\].*got 33"),
        ("speculative_ngram", 0, r"speculative_ngram must be in \[1, 8\], got 0"),
        ("speculative_history", -1, r"speculative_history must be in \[0, 16\].*got -1"),
    ],
)
def test_bad_speculation_settings_are_refused_by_name(field, value, message):
  with pytest.raises(ValueError, match=message):
    EngineConfig(num_slots=2, max_len=32, **{field: value})


def test_the_sample_must_be_in_a_slot_to_be_suggested_tokens(sampler_params):
  engine = _engine(sampler_params, 2)
  record = _grouped()[0]
  with pytest.raises(ValueError, match="suggest needs a live sample"):
    engine.suggest(record, [1, 2, 3])


def test_a_prompt_s_past_samples_draft_for_its_later_ones(sampler_params):
  """Greedy samples of the same prompts a second time: their prompts' first samples,
  remembered, draft all of the second ones; the tokens are still plain decoding's."""
  first, again = _grouped(temperature=0.0), _grouped(temperature=0.0, offset=100)
  truth = _drain(_engine(sampler_params, 0), first + again)
  engine = _engine(sampler_params, 4, speculative_history=2)
  ours = _drain(engine, _grouped(temperature=0.0))
  c0 = dict(engine.counters.accepted)
  ours |= _drain(engine, _grouped(temperature=0.0, offset=100))
  _assert_same_draws(truth, ours)
  c = engine.counters
  from_history = c.accepted["history"] - c0.get("history", 0)
  assert from_history > 0
  assert len(engine.parts.history) == 3  # three prompts remembered


# ------------------------------------------------------------------ speculative_auto
def test_the_choice_measures_both_modes_then_takes_the_faster_and_probes_the_other():
  choice = SpeculationChoice(probe_every=4, decay=0.5)
  assert choice.choose(3) is True  # unmeasured: speculation first
  choice.record(3, True, tokens=40, seconds=1.0)  # 40 / 3 tokens a second a slot
  assert choice.choose(4) is False  # 4 shares 3's bucket: plain is unmeasured
  choice.record(4, False, tokens=8, seconds=1.0)
  picks = [choice.choose(3) for _ in range(8)]
  # Calls 3..10 of the bucket: the faster (speculation), the other every 4th call.
  assert picks == [True, False, True, True, True, False, True, True]
  # Acceptance drops: speculation's rate decays below plain's, and plain is chosen.
  for _ in range(4):
    choice.record(3, True, tokens=3, seconds=1.0)
  assert choice.rates[(4, True)] < choice.rates[(4, False)]
  assert choice.choose(3) is False
  # Another count of live slots is measured on its own.
  assert choice.choose(20) is True and live_bucket(20) == 32


def test_auto_draws_the_tokens_plain_decoding_draws_and_compiles_both_at_warm_up(
    sampler_params, compiles
):
  plain = _drain(_engine(sampler_params, 0), _grouped(temperature=0.0))
  engine = _engine(sampler_params, 3, speculative_auto=True)
  engine.warm_up()
  before = len(compiles)
  _assert_same_draws(plain, _drain(engine, _grouped(temperature=0.0)))
  assert compiles[before:] == []
  c = engine.counters
  assert 0 < c.speculative_calls  # it tried speculating
  assert engine.decoding.choice.rates  # and measured


def test_auto_needs_drafts_to_speculate_with():
  with pytest.raises(
      ValueError, match=r"speculative_auto .* needs EngineConfig.speculative_tokens >= 1"
  ):
    EngineConfig(num_slots=2, max_len=32, speculative_auto=True)


def test_without_refill_samples_come_back_in_the_pass_they_finished_at(sampler_params):
  # A (9 tokens, every draft right) finishes at the second pass; B (6 tokens, every
  # draft wrong) at the sixth: A first, though it gained more tokens in the call.
  kw = dict(num_slots=2, max_len=48, sync_every=8, page_size=8)
  a, b = _grouped(n=2, budget=9, temperature=0.0)
  b = _grouped(n=2, budget=6, temperature=0.0, offset=10)[1]
  truth = _drain(
      SlotEngine(CFG, sampler_params, EngineConfig(**kw)), _grouped(n=2, budget=9, temperature=0.0)
  )
  engine = SlotEngine(CFG, sampler_params, EngineConfig(**kw, speculative_tokens=4))
  engine.admit([a, b])
  engine.suggest(a, truth[0].response)
  engine.suggest(b, (truth[1].response[:6] + 1) % CFG.vocab_size)
  finished = engine.step(refill=False)
  assert [r.index for r in finished] == [a.index, b.index]
  assert len(a.response) == 9 and len(b.response) == 6
  np.testing.assert_array_equal(a.response, truth[0].response)


def test_a_failing_history_is_counted_and_the_samples_draw_as_ever(sampler_params, monkeypatch):
  def broken(*_):
    raise OSError("the history failed")

  monkeypatch.setattr(DraftHistory, "add", broken)
  monkeypatch.setattr(DraftHistory, "rows", broken)
  truth = _drain(_engine(sampler_params, 0), _grouped())
  engine = _engine(sampler_params, 4, speculative_history=2)
  _assert_same_draws(truth, _drain(engine, _grouped()))
  assert engine.counters.draft_failures == 12  # 6 admissions, 6 finished samples


def test_suggested_tokens_outside_the_vocabulary_are_refused(sampler_params):
  engine = _engine(sampler_params, 2)
  record = _grouped()[0]
  engine.admit([record])
  for bad in ([1, CFG.vocab_size], [-3], [1.5]):
    with pytest.raises(ValueError, match=rf"token ids in \[0, {CFG.vocab_size}\)"):
      engine.suggest(record, bad)
