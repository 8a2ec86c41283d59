"""The slot engine: a static array of decode slots over one set of (sharded) params.

It keeps the contract contract.py states (admit, step, extend, snapshot, set the
policy), out of four parts, each the one owner of its state:
  slots.py          which sample each slot holds, and its host-side length and limits
  kv_manager.py     the KV page pool's book, KV kept in it after a snapshot, placement
  prefill_cache.py  one prefill per prompt, the last call's KV kept for its group
  device_slots.py   the device state (SlotState), the jitted calls that change it
                    (slot_ops.py) and every copy between it and the host

    engine = SlotEngine(cfg, params, EngineConfig(num_slots=64, max_len=4096))
    engine.admit(records)               # fresh: one prefill per prompt; partial: its KV
    finished = engine.step()            # up to sync_every tokens per live slot
    engine.extend(record, tokens)       # with hold_stopped: a held slot goes on after
                                        # tokens it is given (an environment's turn),
                                        # written into its pages by one chunked prefill
    partials = engine.snapshot(keep=True)   # unfinished samples out, KV left in pages
    engine.set_policy(new_params, version + 1)

Sequence lengths for prefill and KV copies are bucketed (powers of two from
`min_bucket`, capped at `max_len`), so a long run compiles a fixed, small set of
programs. A token is tagged with the oldest version its forward pass saw: a sample put
back with its KV (mode kv) keeps its KV's version, a recomputed or fresh one takes the
policy's version (see state.py).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from april_jax import buckets, sharding
from april_jax.models import qwen3
from april_jax.sampler import feeding, slot_ops
from april_jax.sampler.contract import EngineCounters
from april_jax.sampler.device_slots import DeviceSlots
from april_jax.sampler.engine_config import RESUME_MODES, EngineConfig
from april_jax.sampler.engine_events import Events, positions_read, reported
from april_jax.sampler.kv_manager import KVManager
from april_jax.sampler.prefill_cache import PrefillCache
from april_jax.sampler.records import PromptError, SampleRecord, Status, check_runnable
from april_jax.sampler.rows import kv_positions, kv_version_of, rows_from_records
from april_jax.sampler.slots import Slots


class SlotEngine:
  """A static array of decode slots over one set of (sharded) params (contract.py)."""

  def __init__(
      self,
      cfg: qwen3.Qwen3Config,
      params,
      config: EngineConfig,
      mesh=None,
      rules=sharding.DECODE_RULES,
      version: int = 0,
  ):
    self.cfg, self.config = cfg, config
    self._params, self._version = params, version
    fns = slot_ops.device_fns(cfg, config.device_settings(), mesh, tuple(rules))
    if fns.pages_per_shard - 1 < config.pages_per_sequence:
      raise ValueError(
          f"EngineConfig.kv_pages={config.kv_pages} gives each of {fns.shards} slot "
          f"shards {fns.pages_per_shard - 1} pages: too few for one sequence of "
          f"max_len={config.max_len} ({config.pages_per_sequence} pages)"
      )
    table_sharding = None if fns.state_sharding is None else fns.state_sharding.page_table
    self.kv = KVManager(config, fns.pages_per_shard, fns.shards, table_sharding)
    self.slots = Slots(config.num_slots)
    bucket = functools.partial(buckets.bucket, min_bucket=config.min_bucket, cap=config.max_len)
    self.prompts = PrefillCache(bucket, config.prefill_rows)
    self._counters = EngineCounters()  # kept KV's copies to the host counted by kv.kept
    self.device = DeviceSlots(cfg, config, fns, self._counters)
    self._stop_ids = jnp.asarray(config.stop_ids, jnp.int32).reshape(-1)
    self._buckets = buckets.all_buckets(config.min_bucket, config.max_len)
    self._preempted: list[SampleRecord] = []  # moved out for pages; callers put them back
    self._to_feed: set[int] = set()  # slots whose given tokens the next step prefills
    self.events = Events()  # listeners of its calls (engine_events.py): benchmarks

  @property
  def fns(self):
    """The jitted calls (slot_ops.DeviceFns) its device state is changed by."""
    return self.device.fns

  @fns.setter
  def fns(self, fns) -> None:
    self.device.fns = fns

  @property
  def state(self):
    """The slots' device state (SlotState), for callers that wait on it."""
    return self.device.state

  def listen(self, listener) -> None:
    """`listener(event, seconds, **facts)` after each call engine_events.EVENTS names."""
    self.events.listen(listener)

  # ---------------------------------------------------------------------- policy
  @property
  def params(self):
    return self._params

  @property
  def version(self) -> int:
    return self._version

  def set_policy(self, params, version: int) -> None:
    """Draw with `params`, tagging tokens `version`, from the next call on. Kept prompt
    KV was computed by the old params: it goes."""
    self._params, self._version = params, int(version)
    self.prompts.clear()

  # -------------------------------------------------------------------- questions
  @property
  def counters(self) -> EngineCounters:
    """What the engine has done over its life (a copy)."""
    c = self._counters
    return dataclasses.replace(c, kv_bytes_to_host=c.kv_bytes_to_host + self.kv.kept.bytes_to_host)

  def holds(self, record: SampleRecord) -> bool:
    """Whether the record is in a slot now."""
    return self.slots.holds(record)

  def keeps(self, record: SampleRecord) -> bool:
    """Whether the record's KV is kept in the pool (snapshot with keep)."""
    return self.kv.keeps(record)

  @property
  def num_free(self) -> int:
    return self.slots.num_free

  @property
  def num_decoding(self) -> int:
    """Slots that decode at the next step: live, not held at a stop."""
    return self.slots.num_live - len(self.slots.held())

  @property
  def num_live(self) -> int:
    return self.slots.num_live

  def pages_used_fraction(self) -> float:
    """Pool pages held by slots / usable pages."""
    return self.kv.used_fraction()

  def bucket(self, n: int) -> int:
    if n > self.config.max_len:
      raise PromptError(f"{n} tokens exceed the slot capacity max_len={self.config.max_len}")
    return buckets.bucket(n, self.config.min_bucket, self.config.max_len)

  def check(self, record: SampleRecord) -> None:
    """Raises PromptError if the record cannot run in a slot."""
    check_runnable(record, self.config.max_len)

  def room_for(self, records: list[SampleRecord]) -> int:
    """How many of `records`, in order, can start now: each needs a free slot, and
    pages on that slot's shard for its KV and one decode call's growth."""
    return len(self.kv.place(self.slots.free(), records))

  # ---------------------------------------------------------------------- warm up
  def warm_up(self) -> int:
    """Compiles every program a run can use: per length bucket, prefill and its insert
    (one prompt, and prefill_rows prompts where that is more), the insert of restored
    KV, the KV extract and (hold_stopped) the feed of given tokens; then decode. Runs on the engine's own state, as no-ops (no
    memory for a second state), so the engine must be empty. Returns the number of
    buckets."""
    if self.num_live:
      raise RuntimeError("warm_up needs an empty engine")
    for b in self._buckets:
      self._warm_bucket(b)
    device = self.device
    device.decode(self.params, self.version, self._stop_ids, 1, self.kv.table())
    device.mark_done(np.zeros(self.config.num_slots, bool))
    no_slots = np.full(self.config.insert_width, -1, np.int32)
    jax.block_until_ready(device.fns.extract_rows(device.state, no_slots))
    rows = rows_from_records([], self.config.insert_width, self.config.max_len, [])
    device.state = device.fns.write_rows(device.state, rows, no_slots)
    return len(self._buckets)

  def _warm_bucket(self, b: int) -> None:
    """Compiles the prefill, insert and KV programs of one length bucket."""
    cfg, W, Wr = self.cfg, self.config.insert_width, self.config.snapshot_width
    for rows in sorted({1, self.config.prefill_rows(b)}):
      kv = self.fns.prefill_kv(self.params, np.zeros((rows, b), np.int32))
      self.device.insert(kv, W, [], [], [], [], [], self.kv.table())
    no_rows = np.full(Wr, -1, np.int32)
    jax.block_until_ready(self.fns.extract_kv(self.device.state, no_rows, b, self.kv.table()))
    zeros = np.zeros((cfg.num_layers, Wr, b, cfg.num_kv_heads, cfg.head_dim), self.config.kv_dtype)
    kv = self.device.on_device(qwen3.KVCache(zeros, zeros))
    self.device.insert(kv, Wr, [], [], [], [], [], self.kv.table())
    feeds = self.config.hold_stopped and self.config.feed_given == "prefill"
    if feeds and b <= self.bucket(min(self.config.feed_len, self.config.max_len)):
      for rows in sorted({feeding.rows(n, W) for n in range(1, W + 1)}):
        none, zero = np.full(rows, -1, np.int32), np.zeros(rows, np.int32)
        self.device.feed(self.params, none, zero, b, self.kv.table())

  # ------------------------------------------------------------------------ admit
  def admit(self, records: list[SampleRecord], mode: str | None = None) -> list[int]:
    """Starts the records in free slots (as many as room_for counts: more is an error):
    the partial samples first, then the fresh ones. Returns their slots, in the
    records' order.

    A fresh sample's prompt is prefilled once for every sample that shares it (across
    calls too, while it is in the last prefill call: prefill_cache.py), in calls of up
    to prefill_width prompts of one length bucket, its KV copied into each sample's
    slot (each slot owns its pages; docs/what_fits.md says why pages are not shared).
    A partial continues from its KV in mode kv (in place if its KV is kept in the pool,
    else from the host, snapshot_width per call), or is prefilled again, prompt and
    response (mode recompute, or a sample without KV). mode None: the config's
    resume_mode. Each sample keeps its own budget, key and sampling params."""
    mode = self.config.resume_mode if mode is None else mode
    if mode not in RESUME_MODES:
      raise ValueError(f"resume mode must be one of {RESUME_MODES}, got {mode!r}")
    for r in records:
      self.check(r)
    partial = [r for r in records if r.started]
    fresh = [r for r in records if not r.started]
    slot_of = dict(zip(partial, self._continue_partials(partial, mode) if partial else []))
    slot_of.update(zip(fresh, self._start_fresh(fresh) if fresh else []))
    return [slot_of[r] for r in records]

  def _take_slots(self, records: list[SampleRecord], resume_kv: bool):
    """Free slots for the records, each with pages for its KV and one decode call; with
    resume_kv a kept record takes its own pages back where it can. Returns the slots
    and {record: its KV positions} for those taken back."""
    if len(set(records)) < len(records) or any(self.slots.holds(r) for r in records):
      raise ValueError("a sample can be in one slot only: it is given twice or already held")
    slots = self.kv.place(self.slots.free(), records)
    if len(slots) < len(records):
      raise RuntimeError(
          f"{len(records)} samples do not fit: {self.num_free} slots and "
          f"{self.kv.book.free()} pages free (check room_for first)"
      )
    in_place = self.kv.give_pages(slots, records, resume_kv, self._read_kv)
    for slot, r in zip(slots, records):
      self.slots.admit(slot, r)
    return slots, in_place

  @reported("start_fresh")
  def _start_fresh(self, records: list[SampleRecord]) -> list[int]:
    """Fresh samples into slots, their prompts prefilled (PrefillCache: once each)."""
    slots, _ = self._take_slots(records, False)
    for kv, rows in self.prompts.kvs([r.prompt for r in records], self.version, self._prefill):
      self._insert_shared(kv, self.version, [(slots[i], records[i], row) for i, row in rows])
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
    for slot, r in rest:
      kv = self._prefill([np.concatenate([r.prompt, r.response])])
      self._insert_shared(kv, self.version, [(slot, r, 0)], r.length)
      self._own(slot, r, r.length)
    return slots

  def _insert_host_kv(self, items: list[tuple[int, SampleRecord]]) -> None:
    """Samples whose KV is on the host back into their slots, grouped by KV length
    bucket, snapshot_width per insert call."""
    by_bucket: dict[int, list[tuple[int, SampleRecord]]] = {}
    for slot, r in items:
      by_bucket.setdefault(self.bucket(max(kv_positions(r), 1)), []).append((slot, r))
    W = self.config.snapshot_width
    for kv_len, group in by_bucket.items():
      if len(group) == 1:  # one sample: its own KV alone, as a prefill's insert takes it
        self._insert_one_host_kv(*group[0], kv_len)
        continue
      for i in range(0, len(group), W):
        chunk = [r for _, r in group[i : i + W]]
        lengths = [kv_positions(r) + 1 for r in chunk]
        versions = [kv_version_of(r) for r in chunk]
        slots = [slot for slot, _ in group[i : i + W]]
        kv, rows = self.device.host_kv(chunk, kv_len), list(range(len(chunk)))
        self.device.insert(kv, W, slots, chunk, versions, lengths, rows, self.kv.table())
    for slot, r in items:
      self._own(slot, r, kv_positions(r) + 1)

  def _insert_one_host_kv(self, slot: int, r: SampleRecord, kv_len: int) -> None:
    """One sample's host KV [L, 1, kv_len, K, H] into its slot (insert_width per call, as
    a prefill's KV goes in: no rows of padding cross to the device)."""
    kv = self.device.one_host_kv(r, kv_len)
    self._insert_shared(kv, kv_version_of(r), [(slot, r, 0)], kv_positions(r) + 1)

  def _resume_in_place(self, items: list[tuple[int, SampleRecord, int]]) -> None:
    """Kept samples back into the slots that took their pages back (slot, record, KV
    positions): only their rows are written, insert_width slots per call."""
    if not items:
      return
    slots, records, used = zip(*items)
    lengths = [n + 1 for n in used]
    self.device.write_rows(records, slots, [kv_version_of(r) for r in records], lengths)
    for slot, record, length in zip(slots, records, lengths):
      self._own(slot, record, length)

  def _own(self, slot: int, record: SampleRecord, length: int) -> None:
    """The sample is live in its slot; its host KV copy is released. Tokens past
    `length` are given: the next step feeds them (feed_given "prefill")."""
    record.drop_kv()
    self.slots.own(slot, record, length)
    if length < record.length and self.config.feed_given == "prefill":
      self._to_feed.add(slot)

  def _insert_shared(self, kv, kv_version: int, items, length: int | None = None) -> None:
    """KV [L, R, T, K, H] into slots (DeviceSlots.insert_shared, through the page table)."""
    self.device.insert_shared(kv, kv_version, items, self.kv.table(), length)

  def _prefill(self, sequences: list[np.ndarray]) -> qwen3.KVCache:
    """One prefill call: the KV [L, B, T, K, H] of sequences of one length bucket T,
    row i the i-th; B = 1 for one sequence, else prefill_rows(T) (rows past the
    sequences are padding)."""
    T = self.bucket(max(len(t) for t in sequences))
    padded = np.zeros((1 if len(sequences) == 1 else self.config.prefill_rows(T), T), np.int32)
    for i, tokens in enumerate(sequences):
      padded[i, : len(tokens)] = tokens
    self._counters.prefills += 1
    began = time.perf_counter()
    kv = self.fns.prefill_kv(self.params, padded)
    if self.events.listening:
      self.events.emit("prefill", time.perf_counter() - began, lengths=[len(t) for t in sequences])
    return kv

  # ----------------------------------------------------------------- decode, harvest
  def step(self, refill: bool = True) -> list[SampleRecord]:
    """Runs up to sync_every decode steps; returns the samples that finished.

    With `refill` (a sample waits for a free slot) decoding stops once `refill_batch`
    slots have finished, so they are refilled together; without it, the sync_every
    steps run unless every slot finishes, saving host round trips when nothing could
    use a freed slot. First every live slot gets the pages it can fill in this call;
    where the pool runs out the youngest are preempted (take_preempted).
    """
    if not self.events.listening:
      return self._step(refill)
    began, before, live = time.perf_counter(), self.slots.lengths.copy(), self.slots.owned()
    try:
      return self._step(refill)
    finally:
      read = positions_read(before, self.slots.lengths, [slot for slot, _ in live])
      self.events.emit("step", time.perf_counter() - began, kv_positions=read)

  def _step(self, refill: bool) -> list[SampleRecord]:
    self._reserve()
    self._feed_given()
    if not self.num_decoding:
      return []
    leave_after = min(self.config.refill_batch, self.num_decoding) if refill else 0
    decoding = {s for s, r in self.slots.owned() if r.engine_status is Status.LIVE}
    done, lengths, steps, drawn = self.device.decode(
        self.params, self.version, self._stop_ids, leave_after, self.kv.table()
    )
    grown = np.array(lengths) - self.slots.lengths  # a live slot gains one token per step
    self.slots.lengths[:] = lengths
    self._counters.decode_steps += int(steps)
    self._counters.tokens_generated += int(drawn)
    # In the order they finished (the step each finished at, then slot): with refill off
    # several finish within one window, and callers rely on completion order.
    finished = sorted(
        ((slot, r) for slot, r in self.slots.owned() if done[slot] and slot in decoding),
        key=lambda x: (grown[x[0]], x[0]),
    )
    self._read_back(finished, with_kv=False)
    for slot, record in finished:
      stopped = record.response[-1] in self.config.stop_ids
      if stopped and self.config.hold_stopped:
        record.hold()
      else:
        self._release(slot)
        record.finish("stop" if stopped else "length")
    return [record for _, record in finished]

  def _reserve(self) -> None:
    """Pages for every live slot's next decode call, oldest slots first. Where a shard
    runs out, its youngest live slot is preempted (never dropped: see take_preempted);
    the oldest always fits, as the pool holds one max_len sequence per shard."""
    slots, kv = self.slots, self.kv
    live = [s for s, r in slots.owned() if r.engine_status is Status.LIVE]
    at = lambda s: slots.owner(s).length if s in self._to_feed else int(slots.lengths[s])
    windows = {s: kv.window(at(s), int(slots.limits[s])) for s in live}
    kv.grow_ahead(windows, self._read_kv)  # kept pages the grows reach: one batch
    for slot in slots.by_age():
      if slot not in windows or slots.owner(slot) is None:
        continue  # held at a stop (its pages stay), or preempted for an older slot
      while not kv.grow(slot, windows[slot], self._read_kv):
        shard = kv.shard_of(slot)
        victim = slots.youngest(s for s, _ in slots.owned() if kv.shard_of(s) == shard)
        self._preempt(victim)
        if victim == slot:
          break

  def _preempt(self, slot: int) -> None:
    """The slot's sample back to the host (with its KV in resume_mode kv); slot freed."""
    record = self.slots.owner(slot)
    self._read_back([(slot, record)], with_kv=self.config.resume_mode == "kv")
    self._release(slot)
    mask = np.zeros(self.config.num_slots, bool)
    mask[slot] = True
    self.device.mark_done(mask)
    self._preempted.append(record)
    self._counters.preemptions += 1

  def take_preempted(self) -> list[SampleRecord]:
    """The samples preempted since the last call (oldest first); the caller continues
    them like any partial sample."""
    out, self._preempted = self._preempted, []
    return out

  def _held_slot(self, record: SampleRecord) -> int:
    """The slot holding `record` at a stop (hold_stopped); ValueError if none does."""
    slot = self.slots.slot_of(record)
    if slot is None or record.engine_status is not Status.HELD:
      raise ValueError("the sample is not held in a slot at a stop")
    return slot

  def extend(self, record: SampleRecord, tokens: np.ndarray) -> None:
    """Continues a sample that stopped and was held (hold_stopped) after `tokens`, which
    it is given rather than draws (an environment's observation): they join its
    response with logprob 0 and the policy's version, and the next step writes them
    into the slot's pages (feed_given: one chunked prefill, or its decode steps one a
    token) before it draws again. The sample must have room for them and one more
    token."""
    slot = self._held_slot(record)
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if record.budget_left < len(tokens) + 1:
      raise ValueError(
          f"{len(tokens)} given tokens leave no room in the sample's budget "
          f"({record.budget_left} tokens left)"
      )
    length = record.length
    record.give(tokens, self.version)
    kv_version = int(self.slots.kv_versions[slot])
    self.device.write_rows([record], [slot], [kv_version], [length])
    record.go_live()
    if self.config.feed_given == "prefill":
      self._to_feed.add(slot)

  def _feed_given(self) -> None:
    """The given tokens of the slots that have some (extended, or resumed with KV for
    fewer positions than their tokens) into their pages by chunked prefills
    (slot_ops.feed, split as feeding.py says): each then stands at its record's length,
    its last given token pending. The pages are the step's (_reserve)."""
    todo = {s: (int(self.slots.lengths[s]), self.slots.owner(s).length) for s in self._to_feed}
    self._to_feed.clear()
    W = self.config.insert_width
    for T, pieces in feeding.calls(todo, self.config.feed_len, self.bucket, W):
      rows = feeding.rows(len(pieces), W)
      slots, ends = np.full(rows, -1, np.int32), np.zeros(rows, np.int32)
      for j, (slot, end) in enumerate(pieces):
        slots[j], ends[j] = slot, end
        self._counters.tokens_fed += end - int(self.slots.lengths[slot])
        self.slots.lengths[slot] = end
      began = time.perf_counter()
      self.device.feed(self.params, slots, ends, T, self.kv.table())
      if self.events.listening:
        self.events.emit("feed", time.perf_counter() - began, rows=rows, bucket=T)
      self._counters.feed_rows += rows
      self._counters.feeds += 1

  def set_aside(self, record: SampleRecord) -> None:
    """A sample held at a stop leaves its slot to another while its environment
    answers: its KV stays in its pages, kept for it (keeps), as a snapshot with keep
    leaves a sample; admitted again, it takes them back in place."""
    slot = self._held_slot(record)
    if self.kv.book.shards > 1:
      record.place(self.kv.shard_of(slot))
    self.kv.keep(slot, record, int(self.slots.lengths[slot]) - 1, int(self.slots.kv_versions[slot]))
    self._release(slot)

  def release(self, record: SampleRecord) -> None:
    """Ends a sample that stopped and was held (hold_stopped): finished, slot freed."""
    self._release(self._held_slot(record))
    record.finish("stop")

  @reported("snapshot")
  def snapshot(self, with_kv: bool = True, keep: bool = False) -> list[SampleRecord]:
    """Every unfinished sample back to the host (with its KV if asked); slots freed.
    With `keep` (and with_kv) the KV stays in the slots' pages, kept for the records
    (keeps): a slot held at a stop still copies its KV out."""
    held = self.slots.owned()
    if self.kv.book.shards > 1:  # a checkpoint keeps it: a resumed run places alike
      for slot, r in held:
        r.place(self.kv.shard_of(slot))
    stay = [(s, r) for s, r in held if keep and with_kv and r.engine_status is not Status.HELD]
    kept = {slot for slot, _ in stay}
    self._read_back([(slot, r) for slot, r in held if slot not in kept], with_kv)
    self._read_back(stay, with_kv=False)
    for slot, record in stay:  # its pages leave the slot, kept (before the release)
      self.kv.keep(
          slot, record, int(self.slots.lengths[slot]) - 1, int(self.slots.kv_versions[slot])
      )
    for slot, _ in held:
      self._release(slot)
    self.device.mark_done(np.ones(self.config.num_slots, bool))
    return [record for _, record in held]

  def discard(self, record: SampleRecord) -> None:
    """Lets a kept record's pages go without copying its KV out (the caller drops the
    record: it starts over)."""
    self.kv.discard(record)

  def copy_out_kept(self) -> None:
    """Every kept record's KV to the host, its pages then plain free pages (before a
    checkpoint keeps the records)."""
    self.kv.copy_out_all(self._read_kv)

  def _release(self, slot: int) -> None:
    self._to_feed.discard(slot)
    self.slots.release(slot)
    self.kv.release(slot)

  def _read_back(self, items: list[tuple[int, SampleRecord]], with_kv: bool) -> None:
    """The slots' responses (and KV of the positions written: all but the pending token
    and any given tokens not yet fed) into their records (DeviceSlots' transfers)."""
    read = self.device.read_rows([slot for slot, _ in items])
    for (slot, record), (tokens, logprobs, versions, kv_version) in zip(items, read):
      record.read_back(tokens, logprobs, versions)  # given tokens not fed yet included
      self.slots.kv_versions[slot] = int(kv_version)
      if with_kv:
        record.set_kv_version(int(kv_version))
    if with_kv:
      used = [(slot, int(self.slots.lengths[slot]) - 1) for slot, _ in items]
      for (_, record), (k, v) in zip(
          items, self.device.read_kvs(used, self.bucket, self.kv.table())
      ):
        record.set_kv(k, v, record.kv_version)

  def _read_kv(self, slots: np.ndarray, kv_len: int, table: np.ndarray | None = None):
    """Host (k, v) [L, W, kv_len, K, H] of page-table rows `slots` (-1: none), through
    the book's table or a call's own `table` (kept KV: kv_manager.py)."""
    table = self.kv.table() if table is None else self.kv.on_devices(table)
    return self.device.read_kv(slots, kv_len, table)
