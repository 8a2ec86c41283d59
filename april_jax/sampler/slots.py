"""Which sample each decode slot holds, and where its decoding stands on the host.

The engine's slot registry: a slot is free or owned by one SampleRecord, which is live
(decoding) or held at a stop (EngineConfig.hold_stopped: its environment's turn). For
each owned slot it keeps the length as of the last read back, the version of its KV,
its limit (prompt + budget) and its admission order (preemption takes the youngest).
The device's SlotState holds the slots' tokens and KV; this is the host's view of who
is where.
"""

from __future__ import annotations

import numpy as np

from april_jax.sampler.records import SampleRecord, Status


class Slots:
  """num_slots slots, each free or owned by one record."""

  def __init__(self, num_slots: int):
    self.num_slots = num_slots
    self._owner: list[SampleRecord | None] = [None] * num_slots
    self._slot_of: dict[SampleRecord, int] = {}
    self.lengths = np.zeros(num_slots, np.int64)  # as of the last read back
    self.kv_versions = np.zeros(num_slots, np.int64)  # as of the last read back
    self.limits = np.zeros(num_slots, np.int64)  # prompt + budget
    self._age = np.zeros(num_slots, np.int64)  # admission order
    self._admissions = 0

  def owner(self, slot: int) -> SampleRecord | None:
    return self._owner[slot]

  def slot_of(self, record: SampleRecord) -> int | None:
    return self._slot_of.get(record)

  def holds(self, record: SampleRecord) -> bool:
    return record in self._slot_of

  def free(self) -> list[int]:
    """Free slots, lowest first."""
    return [s for s, r in enumerate(self._owner) if r is None]

  def owned(self) -> list[tuple[int, SampleRecord]]:
    """(slot, record) of every owned slot, by slot."""
    return [(s, r) for s, r in enumerate(self._owner) if r is not None]

  def held(self) -> list[int]:
    """Slots held at a stop."""
    return [s for s, r in self.owned() if r.engine_status is Status.HELD]

  @property
  def num_live(self) -> int:
    return len(self._slot_of)

  @property
  def num_free(self) -> int:
    return self.num_slots - len(self._slot_of)

  def admit(self, slot: int, record: SampleRecord) -> None:
    """The record takes the free slot (its pages already given), youngest of all."""
    if self._owner[slot] is not None or record in self._slot_of:
      raise ValueError("a sample can be in one slot only: it is given twice or already held")
    self.limits[slot] = len(record.prompt) + record.max_new_tokens
    self._age[slot] = self._admissions
    self._admissions += 1

  def own(self, slot: int, record: SampleRecord, length: int) -> None:
    """The record is live in the slot (admitted), decoding at `length`."""
    self._owner[slot] = record
    self._slot_of[record] = slot
    self.lengths[slot] = length
    record.go_live()

  def release(self, slot: int) -> SampleRecord:
    """The slot is free; returns the record it held (no longer the engine's)."""
    record = self._owner[slot]
    self._owner[slot] = None
    del self._slot_of[record]
    if record.engine_status in (Status.LIVE, Status.HELD):  # (a kept one stays kept)
      record.leave_engine()
    return record

  def by_age(self) -> list[int]:
    """Owned slots, oldest admission first."""
    return sorted((s for s, _ in self.owned()), key=lambda s: self._age[s])

  def youngest(self, slots) -> int:
    """The youngest admission among `slots`."""
    return max(slots, key=lambda s: self._age[s])
