"""The slot engine: a static array of decode slots over one set of (sharded) params.

It keeps the contract contract.py states (admit, step, extend, snapshot, set the
policy), composed of parts, each the one owner of its state (engine_parts.py hands
them around together):
  slots.py          which sample each slot holds, and its host-side length and limits
  kv_manager.py     the KV page pool's book, KV kept in it after a snapshot, placement
  prefill_cache.py  one prefill per prompt, the last call's KV kept for its group
  device_slots.py   the device state (SlotState), the jitted calls that change it
                    (slot_ops.py) and every copy between it and the host
  given_tokens.py   the slots whose given tokens the next step writes into their pages
and of procedures over them: admission.py (admit: fresh prompts, and the ways a partial
sample continues), decoding.py (step: pages reserved with preemption, the decode call,
the harvest), warm_up.py (every program compiled before the run); the engine itself
keeps the policy, its questions, a held turn's actions and the snapshot.

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

import jax.numpy as jnp
import numpy as np

from april_jax import buckets, sharding
from april_jax.models import qwen3
from april_jax.sampler import slot_ops, warm_up
from april_jax.sampler.contract import EngineCounters
from april_jax.sampler.admission import Admission
from april_jax.sampler.decoding import Decoding
from april_jax.sampler.device_slots import DeviceSlots
from april_jax.sampler.speculation.history import DraftHistory
from april_jax.sampler.engine_parts import EngineParts, Policy
from april_jax.sampler.given_tokens import GivenTokens
from april_jax.sampler.engine_config import EngineConfig
from april_jax.sampler.engine_events import Events, positions_read, reported
from april_jax.sampler.kv_manager import KVManager
from april_jax.sampler.prefill_cache import PrefillCache
from april_jax.sampler.records import SampleRecord, Status, check_runnable, given_tokens
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
    self.given = GivenTokens()  # slots whose given tokens the next step feeds
    self.events = Events()  # listeners of its calls (engine_events.py): benchmarks
    self.parts = EngineParts(
        cfg,
        config,
        self.slots,
        self.kv,
        self.prompts,
        self.device,
        self.given,
        self._counters,
        self.events,
        Policy(params, int(version)),
        _history(config),
    )
    self.admission = Admission(self.parts)
    self._stop_ids = jnp.asarray(config.stop_ids, jnp.int32).reshape(-1)
    self.decoding = Decoding(self.parts, self._stop_ids)

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
    return self.parts.policy.params

  @property
  def version(self) -> int:
    return self.parts.policy.version

  def set_policy(self, params, version: int) -> None:
    """Draw with `params`, tagging tokens `version`, from the next call on. Kept prompt
    KV was computed by the old params: it goes."""
    self.parts.policy.params, self.parts.policy.version = params, int(version)
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
    return self.decoding.num_decoding()

  @property
  def num_live(self) -> int:
    return self.slots.num_live

  def pages_used_fraction(self) -> float:
    """Pool pages held by slots / usable pages."""
    return self.kv.used_fraction()

  def bucket(self, n: int) -> int:
    """The length bucket of n tokens; PromptError past the slot capacity."""
    return self.parts.bucket(n)

  def check(self, record: SampleRecord) -> None:
    """Raises PromptError if the record cannot run in a slot."""
    check_runnable(record, self.config.max_len)

  def room_for(self, records: list[SampleRecord]) -> int:
    """How many of `records`, in order, can start now: each needs a free slot, and
    pages on that slot's shard for its KV and one decode call's growth."""
    return len(self.kv.place(self.slots.free(), records))

  # ---------------------------------------------------------------------- warm up
  def warm_up(self) -> int:
    """Compiles every program a run can use (warm_up.py), on the engine's own state as
    no-ops, so the engine must be empty. Returns the number of length buckets."""
    lengths = buckets.all_buckets(self.config.min_bucket, self.config.max_len)
    return warm_up.warm_up(self.parts, self._stop_ids, lengths)

  # ------------------------------------------------------------------------ admit
  def admit(self, records: list[SampleRecord], mode: str | None = None) -> list[int]:
    """Starts the records in free slots (as many as room_for counts: more is an error):
    the partial samples first, then the fresh ones (admission.py says how). Returns
    their slots, in the records' order. mode None: the config's resume_mode."""
    slots = self.admission.admit(records, mode)
    if self.parts.history is not None:  # their prompts' past samples, to draft from
      for slot, record in zip(slots, records):
        self.device.set_history(slot, self.parts.history_rows(record))
    return slots

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
      return self.decoding.step(refill)
    began, before, live = time.perf_counter(), self.slots.lengths.copy(), self.slots.owned()
    try:
      return self.decoding.step(refill)
    finally:
      read = positions_read(before, self.slots.lengths, [slot for slot, _ in live])
      self.events.emit("step", time.perf_counter() - began, kv_positions=read)

  def take_preempted(self) -> list[SampleRecord]:
    """The samples preempted since the last call (oldest first); the caller continues
    them like any partial sample."""
    return self.decoding.take_preempted()

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
    tokens = given_tokens(record, tokens)
    length = record.length
    record.give(tokens, self.version)
    kv_version = int(self.slots.kv_versions[slot])
    self.device.write_rows([record], [slot], [kv_version], [length])
    record.go_live()
    if self.config.feed_given == "prefill":
      self.given.add(slot)

  def suggest(self, record: SampleRecord, tokens) -> None:
    """The response the live sample is guessed to draw, from its first response token
    on (a benchmark's controlled acceptance, or a caller that knows a likely
    continuation): with speculative_tokens > 0, its drafts take them first (drafts.py).
    Only how many tokens a call yields changes, never which; forgotten when the slot
    is freed. ValueError if no slot holds the record."""
    slot = self.slots.slot_of(record)
    if slot is None:
      raise ValueError("the sample is in no slot: suggest needs a live sample")
    tokens = np.asarray(tokens).reshape(-1)
    if tokens.size and not (
        np.issubdtype(tokens.dtype, np.integer)
        and 0 <= tokens.min()
        and tokens.max() < self.cfg.vocab_size
    ):
      raise ValueError(f"suggested tokens must be token ids in [0, {self.cfg.vocab_size})")
    self.device.suggest(slot, len(record.prompt), tokens)

  def set_aside(self, record: SampleRecord) -> None:
    """A sample held at a stop leaves its slot to another while its environment
    answers: its KV stays in its pages, kept for it (keeps), as a snapshot with keep
    leaves a sample; admitted again, it takes them back in place."""
    slot = self._held_slot(record)
    if self.kv.book.shards > 1:
      record.place(self.kv.shard_of(slot))
    self.kv.keep(slot, record, int(self.slots.lengths[slot]) - 1, int(self.slots.kv_versions[slot]))
    self.parts.release(slot)

  def release(self, record: SampleRecord) -> None:
    """Ends a sample that stopped and was held (hold_stopped): finished, slot freed."""
    self.parts.release(self._held_slot(record))
    record.finish("stop")
    self.parts.remember(record)

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
    self.parts.read_back([(slot, r) for slot, r in held if slot not in kept], with_kv)
    self.parts.read_back(stay, with_kv=False)
    for slot, record in stay:  # its pages leave the slot, kept (before the release)
      self.kv.keep(
          slot, record, int(self.slots.lengths[slot]) - 1, int(self.slots.kv_versions[slot])
      )
    for slot, _ in held:
      self.parts.release(slot)
    self.device.mark_done(np.ones(self.config.num_slots, bool))
    return [record for _, record in held]

  def discard(self, record: SampleRecord) -> None:
    """Lets a kept record's pages go without copying its KV out (the caller drops the
    record: it starts over)."""
    self.kv.discard(record)

  def copy_out_kept(self) -> None:
    """Every kept record's KV to the host, its pages then plain free pages (before a
    checkpoint keeps the records)."""
    self.kv.copy_out_all(self.parts.read_kv)


def _history(config: EngineConfig) -> DraftHistory | None:
  """The past samples speculation drafts from (speculative_history), if it speculates."""
  if config.speculative_tokens and config.speculative_history:
    return DraftHistory(config.speculative_history)
  return None
