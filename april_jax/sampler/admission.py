"""Starting samples in free slots: the engine's admission, over its parts (engine_parts.py).

A fresh sample's prompt is prefilled once for every sample that shares it (across calls
too, while it is in the last prefill call: prefill_cache.py), in calls of up to
prefill_width prompts of one length bucket, its KV copied into each sample's slot (each
slot owns its pages; docs/what_fits.md says why pages are not shared). A partial sample
continues in one of four ways:
  in place      its KV kept in the pool after a snapshot: it takes its pages back and
                only its row is written (mode kv)
  host KV       its KV copied out to the host: put back, snapshot_width per call, or
                alone as a prefill's KV goes in (mode kv)
  recomputed    prompt and response prefilled again (mode recompute, or no KV)
and its tokens past its KV, if it was given some, wait for the next step's feed
(given_tokens.py). Each sample keeps its own budget, key and sampling params.
"""

from __future__ import annotations

import time

import numpy as np

from april_jax.models import qwen3
from april_jax.sampler.engine_config import RESUME_MODES
from april_jax.sampler.engine_events import reported
from april_jax.sampler.records import SampleRecord, check_runnable
from april_jax.sampler.rows import kv_positions, kv_version_of


class Admission:
  """The engine's `admit` (contract.py), over `parts` (engine_parts.EngineParts)."""

  def __init__(self, parts):
    self.parts = parts
    self.events = parts.events  # the calls it reports (engine_events.reported)

  def admit(self, records: list[SampleRecord], mode: str | None = None) -> list[int]:
    """Starts the records in free slots (as many as room_for counts: more is an error):
    the partial samples first, then the fresh ones. Returns their slots, in the
    records' order. mode None: the config's resume_mode."""
    config = self.parts.config
    mode = config.resume_mode if mode is None else mode
    if mode not in RESUME_MODES:
      raise ValueError(f"resume mode must be one of {RESUME_MODES}, got {mode!r}")
    for r in records:
      check_runnable(r, config.max_len)
    partial = [r for r in records if r.started]
    fresh = [r for r in records if not r.started]
    slot_of = dict(zip(partial, self._continue_partials(partial, mode) if partial else []))
    slot_of.update(zip(fresh, self._start_fresh(fresh) if fresh else []))
    return [slot_of[r] for r in records]

  def _take_slots(self, records: list[SampleRecord], resume_kv: bool):
    """Free slots for the records, each with pages for its KV and one decode call; with
    resume_kv a kept record takes its own pages back where it can. Returns the slots
    and {record: its KV positions} for those taken back."""
    slots, kv = self.parts.slots, self.parts.kv
    if len(set(records)) < len(records) or any(slots.holds(r) for r in records):
      raise ValueError("a sample can be in one slot only: it is given twice or already held")
    taken = kv.place(slots.free(), records)
    if len(taken) < len(records):
      raise RuntimeError(
          f"{len(records)} samples do not fit: {slots.num_free} slots and "
          f"{kv.book.free()} pages free (check room_for first)"
      )
    in_place = kv.give_pages(taken, records, resume_kv, self.parts.read_kv)
    for slot, r in zip(taken, records):
      slots.admit(slot, r)
    return taken, in_place

  @reported("start_fresh")
  def _start_fresh(self, records: list[SampleRecord]) -> list[int]:
    """Fresh samples into slots, their prompts prefilled (PrefillCache: once each)."""
    slots, _ = self._take_slots(records, False)
    version = self.parts.policy.version
    prompts = [r.prompt for r in records]
    for kv, rows in self.parts.prompts.kvs(prompts, version, self.prefill):
      self._insert_shared(kv, version, [(slots[i], records[i], row) for i, row in rows])
      del kv  # inserted: the next prefill call's output need not sit beside it
    for slot, r in zip(slots, records):
      self._own(slot, r, r.length)
    return slots

  @reported("continue_partials")
  def _continue_partials(self, records: list[SampleRecord], mode: str) -> list[int]:
    """Partial samples into slots: kept ones in place, others from their host KV (mode
    kv, snapshot_width per call) or prefilled again."""
    slots, in_place = self._take_slots(records, mode == "kv")
    pairs = list(zip(slots, records))
    self._resume_in_place([(slot, r, in_place[r]) for slot, r in pairs if r in in_place])
    pairs = [(slot, r) for slot, r in pairs if r not in in_place]
    with_kv = [(slot, r) for slot, r in pairs if mode == "kv" and r.has_kv]
    rest = [(slot, r) for slot, r in pairs if not (mode == "kv" and r.has_kv)]
    self._insert_host_kv(with_kv)
    version = self.parts.policy.version
    for slot, r in rest:
      kv = self.prefill([np.concatenate([r.prompt, r.response])])
      self._insert_shared(kv, version, [(slot, r, 0)], r.length)
      self._own(slot, r, r.length)
    return slots

  def _insert_host_kv(self, items: list[tuple[int, SampleRecord]]) -> None:
    """Samples whose KV is on the host back into their slots, grouped by KV length
    bucket, snapshot_width per insert call."""
    device, W = self.parts.device, self.parts.config.snapshot_width
    by_bucket: dict[int, list[tuple[int, SampleRecord]]] = {}
    for slot, r in items:
      by_bucket.setdefault(self.parts.bucket(max(kv_positions(r), 1)), []).append((slot, r))
    for kv_len, group in by_bucket.items():
      if len(group) == 1:  # one sample: its own KV alone, as a prefill's insert takes it
        slot, r = group[0]
        kv = device.one_host_kv(r, kv_len)
        self._insert_shared(kv, kv_version_of(r), [(slot, r, 0)], kv_positions(r) + 1)
        continue
      for i in range(0, len(group), W):
        chunk = [r for _, r in group[i : i + W]]
        lengths = [kv_positions(r) + 1 for r in chunk]
        versions = [kv_version_of(r) for r in chunk]
        slots = [slot for slot, _ in group[i : i + W]]
        kv, rows = device.host_kv(chunk, kv_len), list(range(len(chunk)))
        device.insert(kv, W, slots, chunk, versions, lengths, rows, self.parts.kv.table())
    for slot, r in items:
      self._own(slot, r, kv_positions(r) + 1)

  def _resume_in_place(self, items: list[tuple[int, SampleRecord, int]]) -> None:
    """Kept samples back into the slots that took their pages back (slot, record, KV
    positions): only their rows are written, insert_width slots per call."""
    if not items:
      return
    slots, records, used = zip(*items)
    lengths = [n + 1 for n in used]
    self.parts.device.write_rows(records, slots, [kv_version_of(r) for r in records], lengths)
    for slot, record, length in zip(slots, records, lengths):
      self._own(slot, record, length)

  def _own(self, slot: int, record: SampleRecord, length: int) -> None:
    """The sample is live in its slot; its host KV copy is released. Tokens past
    `length` are given: the next step feeds them (feed_given "prefill")."""
    record.drop_kv()
    self.parts.slots.own(slot, record, length)
    if length < record.length and self.parts.config.feed_given == "prefill":
      self.parts.given.add(slot)

  def _insert_shared(self, kv, kv_version: int, items, length: int | None = None) -> None:
    """KV [L, R, T, K, H] into slots (DeviceSlots.insert_shared, through the page table)."""
    self.parts.device.insert_shared(kv, kv_version, items, self.parts.kv.table(), length)

  def prefill(self, sequences: list[np.ndarray]) -> qwen3.KVCache:
    """One prefill call: the KV [L, B, T, K, H] of sequences of one length bucket T,
    row i the i-th; B = 1 for one sequence, else prefill_rows(T) (rows past the
    sequences are padding)."""
    parts = self.parts
    T = parts.bucket(max(len(t) for t in sequences))
    padded = np.zeros((1 if len(sequences) == 1 else parts.config.prefill_rows(T), T), np.int32)
    for i, tokens in enumerate(sequences):
      padded[i, : len(tokens)] = tokens
    parts.counters.prefills += 1
    began = time.perf_counter()
    params = parts.policy.params
    kv = parts.device.fns.prefill_kv(params, padded)
    if parts.events.listening:
      parts.events.emit("prefill", time.perf_counter() - began, lengths=[len(t) for t in sequences])
    return kv
