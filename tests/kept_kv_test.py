"""A snapshot that keeps its KV in the pool (`snapshot(keep=True)`): no KV crosses to the
host while the pages are not needed, the pages count as free, the KV is copied out
before another slot takes them, and every path continues bit for bit alike, through the
XLA path and through the decode kernel (interpreted here; what a GPU runs)."""

import dataclasses
import gc

import jax
import numpy as np
import pytest

from april_jax import sharding
from april_jax.sampler import EngineConfig, SlotEngine
from april_jax.sampler.kept_kv import KeptKV
from april_jax.sampler.pages import PageBook
from conftest import sampler_qwen3
from record_builders import random_prompts, sample_records

CFG = sampler_qwen3()


def _records(lengths, max_new_tokens, seed=0):
  """Fresh records of random prompts of these lengths, drawn at temperature 1."""
  return sample_records(random_prompts(seed, lengths), max_new_tokens, temperature=1.0, seed=seed)


def _drain(engine):
  out = {}
  while engine.num_live:
    out.update({r.index: r for r in engine.step()})
  return out


def _straight(config, params, lengths, seed=0):
  """The samples decoded to the end, never cut."""
  engine = SlotEngine(CFG, params, config)
  for r in _records(lengths, 22, seed=seed):
    engine.admit([r])
  return _drain(engine)


def _cut(config, params, lengths, steps=2, keep=True, seed=0):
  """An engine whose samples decoded `steps` calls, then were snapshotted."""
  engine = SlotEngine(CFG, params, config)
  records = _records(lengths, 22, seed=seed)
  for r in records:
    engine.admit([r])
  for _ in range(steps):
    assert not engine.step()
  return engine, engine.snapshot(with_kv=True, keep=keep)


# ------------------------------------------------------------------------ the book
def test_kept_pages_count_as_free_are_handed_out_last_and_reclaimed_once():
  book = PageBook(num_slots=4, pages_per_shard=9, shards=1, page_size=4, width=8)
  assert book.grow(0, 12) and book.grow(1, 8)  # 3 and 2 pages
  kept = book.table[0, :3].tolist()
  book.keep(0, key=7)
  assert book.free() == 8 - 2 and book.held[0] == 0 and book.used() == 2
  reclaimed = []
  assert book.grow(2, 12, reclaimed.extend)  # the 3 plain free pages
  assert reclaimed == [] and not set(book.table[2, :3].tolist()) & set(kept)
  assert book.grow(3, 4, reclaimed.extend)  # only kept pages are left
  assert reclaimed == [7] and 7 not in book.kept and book.free() == 2
  assert book.table[3, 0] in kept
  book.keep(1, key=8)
  with pytest.raises(ValueError, match="already kept"):
    book.keep(2, key=8)


def test_a_forgotten_keys_pages_are_handed_out_before_any_kept_page():
  book = PageBook(num_slots=4, pages_per_shard=9, shards=1, page_size=4, width=8)
  assert book.grow(0, 12) and book.grow(1, 12) and book.grow(2, 8)  # 3 + 3 + 2 of 8
  book.keep(0, key=1)
  book.keep(1, key=2)
  book.forget(2)  # plain free again, though kept after key 1
  reclaimed = []
  assert book.grow(3, 12, reclaimed.extend)  # 3 pages: key 2's, plain again
  assert reclaimed == [] and list(book.kept) == [1]
  book.release(2)  # 2 more plain pages
  assert book.grow(2, 16, reclaimed.extend)  # 4 pages: the 2 plain ones, then key 1's
  assert reclaimed == [1] and not book.kept  # one call for the key it reached
  assert not book.grow(1, 8, reclaimed.extend) and reclaimed == [1]  # 1 page left: no call


def test_adopt_gives_the_kept_pages_back_in_order_and_frees_any_past_the_need():
  book = PageBook(num_slots=4, pages_per_shard=9, shards=2, page_size=4, width=8)
  assert book.grow(0, 16)  # 4 pages of shard 0 (3 usable left there)
  kept = book.table[0, :4].tolist()
  book.keep(0, key=1)
  assert not book.adopt(2, key=1, tokens=16)  # slot 2 is on the other shard
  assert book.adopt(1, key=1, tokens=8)  # needs 2 pages: the first two kept ones
  assert book.table[1, :2].tolist() == kept[:2] and book.held[1] == 2
  assert book.free(0) == 8 - 2 and not book.kept  # the other two are plain free pages
  with pytest.raises(RuntimeError, match="no reclaim given"):
    book.keep(1, key=2)
    book.grow(0, 32)


def test_copy_out_reads_each_record_through_its_own_pages_in_calls_by_bucket_and_width():
  """KeptKV against a pool of known values: each record's KV is its kept pages' first
  `used` positions, read in one call per length bucket and snapshot_width records, and
  never more records of a shard in one call than the shard has table rows."""
  page, shards, per_shard = 4, 2, 3
  book = PageBook(shards * per_shard, pages_per_shard=9, shards=shards, page_size=page, width=4)
  pool = np.arange(shards * 9 * page, dtype=np.float32).reshape(shards, 9, page)
  calls = []

  def read_kv(slots, kv_len, table):
    calls.append((kv_len, int((slots >= 0).sum())))
    out = np.full((1, len(slots), kv_len, 1, 1), np.nan, np.float32)
    for j, row in enumerate(slots):
      if row >= 0:
        pages = table[row][table[row] >= 0]
        values = pool[book.shard_of(row), pages].reshape(-1)[:kv_len]
        out[0, j, : len(values), 0, 0] = values
    return out, -out

  kept = KeptKV(book, bucket=lambda n: 8 if n <= 8 else 16, snapshot_width=4)
  expected = []
  # Six records of shard 0 (slots 0-2 twice: more than its 3 rows) of bucket 8, then
  # shard 1's: 7 positions (bucket 8) and 13 (bucket 16).
  for i, (slot, used) in enumerate(
      [(0, 3), (1, 4), (2, 1), (0, 2), (1, 4), (2, 3), (3, 7), (4, 13)]
  ):
    assert book.grow(slot, used)
    pages = book.table[slot, : -(-used // page)]
    record = _records([2], 30, seed=i)[0]
    expected.append((record, pool[book.shard_of(slot), pages].reshape(-1)[:used]))
    record.go_live()  # in the slot, as a snapshot finds it
    kept.keep(slot, record, used, kv_version=0)
  assert len(kept) == 8 and book.used() == 0
  kept.copy_out_all(read_kv)
  for record, values in expected:
    np.testing.assert_array_equal(record.kv_k[0, :, 0, 0], values)
    np.testing.assert_array_equal(record.kv_v, -record.kv_k)
    assert record not in kept
  # bucket 8: shard 0's first three and shard 1's, then shard 0's other three
  assert calls == [(8, 4), (8, 3), (16, 1)]
  assert kept.bytes_to_host == 2 * 4 * (3 + 4 + 1 + 2 + 4 + 3 + 7 + 13) and not book.kept


# ---------------------------------------------------------------------- the engine
@pytest.mark.parametrize("decode_attention", ["xla", "pallas"])
def test_kept_partials_continue_in_place_exactly_as_from_host_kv(sampler_params, decode_attention):
  """Through either decode attention (the kernel, interpreted here, is what a GPU runs)."""
  config = EngineConfig(
      num_slots=8, max_len=64, sync_every=3, snapshot_width=4, decode_attention=decode_attention
  )
  lengths = [3, 14, 6, 20, 9, 2]
  straight = _straight(config, sampler_params, lengths)
  kept_engine, kept = _cut(config, sampler_params, lengths)
  host_engine, host = _cut(config, sampler_params, lengths, keep=False)
  assert all(kept_engine.keeps(r) and not r.has_kv for r in kept)
  assert kept_engine.counters.kv_bytes_to_host == 0 < host_engine.counters.kv_bytes_to_host
  # The pages are free for the accounting, as after a plain snapshot.
  assert (
      kept_engine.kv.book.free() == host_engine.kv.book.free() and kept_engine.kv.book.used() == 0
  )
  assert [r.kv_version for r in kept] == [r.kv_version for r in host] == [0] * 6
  kept_engine.admit(kept[::-1], mode="kv")
  host_engine.admit(host[::-1], mode="kv")
  assert kept_engine.counters.kv_bytes_to_device == 0 < host_engine.counters.kv_bytes_to_device
  assert not any(kept_engine.keeps(r) for r in kept)
  from_pool, from_host = _drain(kept_engine), _drain(host_engine)
  for i, r in straight.items():
    np.testing.assert_array_equal(from_pool[i].response, r.response)
    np.testing.assert_array_equal(from_pool[i].response, from_host[i].response)
    np.testing.assert_array_equal(from_pool[i].logprobs, from_host[i].logprobs)
    np.testing.assert_array_equal(from_pool[i].versions, from_host[i].versions)


@pytest.mark.parametrize("decode_attention", ["xla", "pallas"])
def test_kept_kv_is_copied_out_before_another_slot_takes_its_pages(
    sampler_params, decode_attention
):
  # 10 pages of 8: the two cut samples keep 6, and four fresh ones need all 10.
  config = EngineConfig(
      num_slots=4,
      max_len=64,
      sync_every=8,
      page_size=8,
      kv_pages=10,
      decode_attention=decode_attention,
  )
  lengths = [12, 12]
  straight = _straight(config, sampler_params, lengths)
  engine, kept = _cut(config, sampler_params, lengths, steps=1)
  host_engine, host = _cut(config, sampler_params, lengths, steps=1, keep=False)
  fresh = _records([9, 9, 9, 9], 8, seed=9)  # 2 pages each: 4 plain free, then 4 kept
  fresh = [dataclasses.replace(r, index=f"fresh{r.index}") for r in fresh]
  assert engine.room_for(fresh) == host_engine.room_for(fresh) == 4
  reads = engine.counters.kv_reads
  engine.admit(fresh)
  assert not any(engine.keeps(r) for r in kept)  # their pages were needed: copied out
  assert engine.counters.kv_reads == reads + 1  # both in one call: one bucket
  for a, b in zip(kept, host):
    np.testing.assert_array_equal(a.kv_k, b.kv_k)
    np.testing.assert_array_equal(a.kv_v, b.kv_v)
    assert a.kv_version == b.kv_version
  _drain(engine)
  engine.admit(kept, mode="kv")
  resumed = _drain(engine)
  for i, r in straight.items():
    np.testing.assert_array_equal(resumed[i].response, r.response)
    np.testing.assert_allclose(resumed[i].logprobs, r.logprobs, atol=1e-5)
  assert engine.kv.book.used() == 0 and engine.kv.book.free() == 10 and not engine.kv.book.kept


def test_copy_out_kept_gives_what_a_plain_snapshot_copies(sampler_params):
  config = EngineConfig(num_slots=4, max_len=64, sync_every=3)
  engine, kept = _cut(config, sampler_params, [7, 30, 4])
  _, host = _cut(config, sampler_params, [7, 30, 4], keep=False)
  engine.copy_out_kept()
  assert not engine.kv.book.kept and engine.kv.book.free() == engine.kv.book.usable
  for a, b in zip(kept, host):
    assert not engine.keeps(a) and a.kv_k.shape == b.kv_k.shape
    np.testing.assert_array_equal(a.kv_k, b.kv_k)
    np.testing.assert_array_equal(a.kv_v, b.kv_v)
  assert engine.counters.kv_bytes_to_host == sum(r.kv_k.nbytes + r.kv_v.nbytes for r in host)


def test_a_kept_sample_resumed_by_recompute_lets_its_pages_go_uncopied(sampler_params):
  config = EngineConfig(num_slots=4, max_len=64, sync_every=3)
  straight = _straight(config, sampler_params, [5, 9])
  engine, kept = _cut(config, sampler_params, [5, 9])
  engine.admit(kept, mode="recompute")
  assert engine.counters.kv_bytes_to_host == 0 and not engine.kv.book.kept
  resumed = _drain(engine)
  for i, r in straight.items():
    np.testing.assert_array_equal(resumed[i].response, r.response)


def test_kept_samples_go_back_to_their_shard_or_continue_from_a_copy(sampler_params):
  """Slots 0-1 on one device, 2-3 on another. A kept sample goes back to the shard of
  its pages and takes them back in place; one whose shard has no free slot left goes
  to the other shard and continues from a copy of its KV."""
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 (CPU) devices")
  mesh = sharding.make_mesh((2, 1, 1), jax.devices()[:2])
  config = EngineConfig(num_slots=4, max_len=64, sync_every=3)
  make = lambda: _records([5, 9, 7], 22)  # slots 0, 1 (shard 0) and 2 (shard 1)
  straight = SlotEngine(CFG, sampler_params, config, mesh=mesh)
  for r in make():
    straight.admit([r])
  want = _drain(straight)

  def cut():
    engine = SlotEngine(CFG, sampler_params, config, mesh=mesh)
    for r in make():
      engine.admit([r])
    engine.step()
    return engine, engine.snapshot(keep=True)

  engine, (a, b, c) = cut()
  assert [engine.kv.book.kept[r][0] for r in (a, b, c)] == [0, 0, 1]
  assert [r.home_shard for r in (a, b, c)] == [0, 0, 1]
  assert engine.admit([c, a, b], mode="kv") == [2, 0, 1]  # each to its own shard
  assert engine.counters.kv_bytes_to_host == 0 == engine.counters.kv_bytes_to_device
  got = _drain(engine)
  for i, r in want.items():
    np.testing.assert_array_equal(got[i].response, r.response)
    np.testing.assert_allclose(got[i].logprobs, r.logprobs, atol=1e-5)

  engine, (a, b, c) = cut()
  blockers = [
      dataclasses.replace(r, index=f"blocker{r.index}") for r in _records([4, 4], 2, seed=5)
  ]
  engine.admit(blockers)  # slots 0 and 1: shard 0 is full
  assert engine.admit([a, b], mode="kv") == [2, 3]  # on shard 1: copies
  assert not a.has_kv and engine.counters.kv_bytes_to_host > 0 < engine.counters.kv_bytes_to_device
  got = {}
  while any(engine.holds(r) for r in blockers):  # a and b decode on meanwhile
    got.update({r.index: r for r in engine.step()})
  engine.admit([c], mode="kv")  # to shard 0, freed by the blockers: a copy
  got.update(_drain(engine))
  for i, r in want.items():
    np.testing.assert_array_equal(got[i].response, r.response)
    np.testing.assert_allclose(got[i].logprobs, r.logprobs, atol=1e-5)


def test_a_dropped_engine_frees_its_device_state_without_a_collection(sampler_params):
  """The engine holds its parts (the KV manager and its kept KV, the prefill cache),
  which read through the engine only when a call hands them its read: no reference cycle
  may keep the pool alive once the engine is dropped (a run builds engines and drops
  them)."""
  gc.collect()
  before = {id(a) for a in jax.live_arrays()}
  gc.disable()
  try:
    engine, _ = _cut(EngineConfig(num_slots=4, max_len=64, sync_every=3), sampler_params, [3, 5])
    assert len(engine.kv.kept) == 2
    assert {id(a) for a in jax.live_arrays()} - before  # the pool, the page table, ...
    del engine
    assert not {id(a) for a in jax.live_arrays()} - before
  finally:
    gc.enable()
