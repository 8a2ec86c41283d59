"""The engine's decode call: pages reserved (preempting where the pool runs out), given
tokens fed, up to sync_every tokens drawn per live slot, the finished samples harvested.

Every live slot first gets the pages it can fill in the call, oldest slots first; where
a shard's pool runs out, its youngest live slot is preempted: its sample goes back to the
host (with its KV in resume mode kv) and waits in take_preempted, never dropped. The
oldest always fits, as the pool holds one max_len sequence per shard. Finished samples
come back in the order they finished; with hold_stopped one that stopped stays held in
its slot (an environment's turn).
"""

from __future__ import annotations

import time

import numpy as np

from april_jax.runtime import distributed
from april_jax.sampler.records import SampleRecord, Status
from april_jax.sampler.speculation.choice import SpeculationChoice


class Decoding:
  """The engine's `step` and `take_preempted` (contract.py), over `parts`
  (engine_parts.EngineParts); it owns the samples preempted since the last take."""

  def __init__(self, parts, stop_ids):
    self.parts, self.stop_ids = parts, stop_ids
    self.preempted: list[SampleRecord] = []  # moved out for pages; callers put them back
    # speculative_auto: each call speculates or not by the measured rates of both
    self.choice = SpeculationChoice() if parts.config.speculative_auto else None

  def num_decoding(self) -> int:
    """Slots that decode at the next step: live, not held at a stop."""
    return self.parts.slots.num_live - len(self.parts.slots.held())

  def step(self, refill: bool) -> list[SampleRecord]:
    """One decode call (SlotEngine.step); the samples that finished."""
    parts = self.parts
    slots, config, counters = parts.slots, parts.config, parts.counters
    self.reserve()
    parts.given.feed(parts)
    if not self.num_decoding():
      return []
    leave_after = min(config.refill_batch, self.num_decoding()) if refill else 0
    decoding = {s for s, r in slots.owned() if r.engine_status is Status.LIVE}
    params, version = parts.policy.params, parts.policy.version
    live = len(decoding)
    speculate = config.speculative_tokens > 0
    if self.choice is not None:
      # Process 0's choice on every process: they must run the same program.
      speculate = bool(distributed.agree(np.array([self.choice.choose(live)], np.int32))[0])
    began = time.perf_counter()
    done, lengths, steps, drawn, stats, finished_at = parts.device.decode(
        params,
        version,
        self.stop_ids,
        leave_after,
        parts.kv.table(),
        speculate=sorted(decoding) if speculate else None,
    )
    if self.choice is not None:
      self.choice.record(live, speculate, int(drawn), time.perf_counter() - began)
    counters.decode_calls += 1
    counters.speculative_calls += int(speculate)
    # The step (or verify pass) each slot finished at: a step draws one token a slot.
    at = np.array(lengths) - slots.lengths if finished_at is None else np.asarray(finished_at)
    slots.lengths[:] = lengths
    counters.decode_steps += int(steps)
    counters.tokens_generated += int(drawn)
    if stats is not None:
      counters.count_drafts(np.asarray(stats))
    # In the order they finished (the step each finished at, then slot): with refill off
    # several finish within one window, and callers rely on completion order.
    finished = sorted(
        ((slot, r) for slot, r in slots.owned() if done[slot] and slot in decoding),
        key=lambda x: (at[x[0]], x[0]),
    )
    parts.read_back(finished, with_kv=False)
    for slot, record in finished:
      stopped = record.response[-1] in config.stop_ids
      if stopped and config.hold_stopped:
        record.hold()
      else:
        parts.release(slot)
        record.finish("stop" if stopped else "length")
        parts.remember(record)
    return [record for _, record in finished]

  def reserve(self) -> None:
    """Pages for every live slot's next decode call, oldest slots first; where a shard
    runs out, its youngest live slot is preempted."""
    slots, kv, given = self.parts.slots, self.parts.kv, self.parts.given
    live = [s for s, r in slots.owned() if r.engine_status is Status.LIVE]
    at = lambda s: slots.owner(s).length if s in given else int(slots.lengths[s])
    windows = {s: kv.window(at(s), int(slots.limits[s])) for s in live}
    kv.grow_ahead(windows, self.parts.read_kv)  # kept pages the grows reach: one batch
    for slot in slots.by_age():
      if slot not in windows or slots.owner(slot) is None:
        continue  # held at a stop (its pages stay), or preempted for an older slot
      while not kv.grow(slot, windows[slot], self.parts.read_kv):
        shard = kv.shard_of(slot)
        victim = slots.youngest(s for s, _ in slots.owned() if kv.shard_of(s) == shard)
        self.preempt(victim)
        if victim == slot:
          break

  def preempt(self, slot: int) -> None:
    """The slot's sample back to the host (with its KV in resume_mode kv); slot freed."""
    parts = self.parts
    record = parts.slots.owner(slot)
    parts.read_back([(slot, record)], with_kv=parts.config.resume_mode == "kv")
    parts.release(slot)
    mask = np.zeros(parts.config.num_slots, bool)
    mask[slot] = True
    parts.device.mark_done(mask)
    self.preempted.append(record)
    parts.counters.preemptions += 1

  def take_preempted(self) -> list[SampleRecord]:
    out, self.preempted = self.preempted, []
    return out
