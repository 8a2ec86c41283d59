"""An engine on the host alone, for the drivers' logic tests: the contract's calls
(sampler/contract.py) over plain Python, no JAX program, so a scheduler or episode test
runs in milliseconds. engine_conformance_test.py holds it and SlotEngine to the same
promises.

Token t of a sample is a hash of its key and t (`draw`), so a sample draws the same
tokens whatever its slot, its neighbours or its cuts; every drawn token has logprob -1
and the version tag the contract's rule gives (the oldest of the drawing version and its
KV's). Its KV is a placeholder array of the right length: a snapshot with KV, a kept
sample and a checkpointed one carry it as SlotEngine's do. It has no page pool: it never
preempts, and room_for counts free slots.
"""

from __future__ import annotations

import numpy as np

from april_jax.sampler.contract import EngineCounters
from april_jax.sampler.engine_config import RESUME_MODES, EngineConfig
from april_jax.sampler.engine_events import Events
from april_jax.sampler.records import SampleRecord, Status, check_runnable, given_tokens


def draw(rng: np.ndarray, t: int, vocab_size: int) -> int:
  """Token t of the sample with key `rng`: a hash of the two, in [0, vocab_size)."""
  mixed = (int(rng[0]) * 0x9E3779B1 + int(rng[1]) * 0x85EBCA77 + (t + 1) * 0xC2B2AE3D) % 2**32
  mixed ^= mixed >> 15
  mixed = (mixed * 0x2C1B3C6D) % 2**32
  return int((mixed ^ (mixed >> 12)) % vocab_size)


class _Slot:
  """A sample in a slot: its tokens since it was read back, and its KV's version."""

  def __init__(self, record: SampleRecord, kv_version: int, age: int):
    self.record = record
    self.kv_version = kv_version
    self.age = age
    self.tokens: list[int] = []
    self.logprobs: list[float] = []
    self.versions: list[int] = []

  @property
  def response_len(self) -> int:
    """Its response's tokens, read back or not."""
    return len(self.record.response) + len(self.tokens)


class FakeEngine:
  """The Engine contract on the host (module docstring)."""

  def __init__(self, config: EngineConfig, vocab_size: int = 32, params=None, version: int = 0):
    self.config = config
    self.vocab_size = vocab_size
    self._params, self._version = params, version
    self._counters = EngineCounters()
    self._slots: list[_Slot | None] = [None] * config.num_slots
    self._kept: dict[SampleRecord, int] = {}  # kept sample -> its KV's version
    self._admissions = 0
    self.events = Events()

  # ------------------------------------------------------------------ questions
  @property
  def params(self):
    return self._params

  @property
  def version(self) -> int:
    return self._version

  @property
  def counters(self) -> EngineCounters:
    return EngineCounters(**vars(self._counters))

  @property
  def num_live(self) -> int:
    return sum(s is not None for s in self._slots)

  @property
  def num_free(self) -> int:
    return self.config.num_slots - self.num_live

  @property
  def num_decoding(self) -> int:
    return sum(s is not None and s.record.status is Status.LIVE for s in self._slots)

  def holds(self, record: SampleRecord) -> bool:
    return self._slot_of(record) is not None

  def keeps(self, record: SampleRecord) -> bool:
    return record in self._kept

  def pages_used_fraction(self) -> float:
    return self.num_live / self.config.num_slots

  # -------------------------------------------------------------------- actions
  def listen(self, listener) -> None:
    self.events.listen(listener)

  def set_policy(self, params, version: int) -> None:
    self._params, self._version = params, int(version)

  def warm_up(self) -> int:
    if self.num_live:
      raise RuntimeError("warm_up needs an empty engine")
    return 0

  def check(self, record: SampleRecord) -> None:
    check_runnable(record, self.config.max_len)

  def room_for(self, records: list[SampleRecord]) -> int:
    return min(self.num_free, len(records))

  def admit(self, records: list[SampleRecord], mode: str | None = None) -> list[int]:
    mode = self.config.resume_mode if mode is None else mode
    if mode not in RESUME_MODES:
      raise ValueError(f"resume mode must be one of {RESUME_MODES}, got {mode!r}")
    for r in records:
      self.check(r)
    if len(set(records)) < len(records) or any(self.holds(r) for r in records):
      raise ValueError("a sample can be in one slot only: it is given twice or already held")
    if len(records) > self.num_free:
      raise RuntimeError(f"{len(records)} samples do not fit: {self.num_free} slots free")
    order = [r for r in records if r.started] + [r for r in records if not r.started]
    slot_of = {}
    for record in order:
      slot_of[record] = slot = self._slots.index(None)
      if record in self._kept:  # its KV back in place
        kv_version = self._kept.pop(record)
        record.leave_engine()
      elif record.started and mode == "kv" and record.has_kv:
        kv_version = record.kv_version
        self._counters.kv_bytes_to_device += record.kv_k.nbytes + record.kv_v.nbytes
      else:  # a fresh prompt, or a partial prefilled again
        kv_version = self._version
        self._counters.prefills += 1
      record.drop_kv()
      self._slots[slot] = _Slot(record, kv_version, self._admissions)
      self._admissions += 1
      record.go_live()
    if any(r.started for r in records):
      self.events.emit("continue_partials", 0.0)
    if not all(r.started for r in records):
      self.events.emit("start_fresh", 0.0)
    return [slot_of[r] for r in records]

  def step(self, refill: bool = True) -> list[SampleRecord]:
    decoding = [s for s in self._slots if s is not None and s.record.status is Status.LIVE]
    if not decoding:
      return []
    leave_after = min(self.config.refill_batch, len(decoding)) if refill else len(decoding)
    finished: list[tuple[int, int, _Slot]] = []  # (step, slot, ...)
    steps = positions = 0  # positions: KV positions read, as SlotEngine counts them
    while steps < self.config.sync_every and len(finished) < leave_after:
      steps += 1
      for slot in decoding:
        if any(s is slot for _, _, s in finished):
          continue
        token = draw(slot.record.rng, slot.response_len, self.vocab_size)
        positions += len(slot.record.prompt) + slot.response_len
        slot.kv_version = min(slot.kv_version, self._version)
        slot.tokens.append(token)
        slot.logprobs.append(-1.0)
        slot.versions.append(slot.kv_version)
        self._counters.tokens_generated += 1
        if token in self.config.stop_ids or slot.response_len == slot.record.max_new_tokens:
          finished.append((steps, self._slots.index(slot), slot))
    self._counters.decode_steps += steps
    self.events.emit("step", 0.0, kv_positions=positions)
    out = []
    for _, index, slot in sorted(finished, key=lambda x: (x[0], x[1])):
      record = slot.record
      self._read_back(slot)
      stopped = int(record.response[-1]) in self.config.stop_ids
      if stopped and self.config.hold_stopped:
        record.hold()
      else:
        self._slots[index] = None
        record.leave_engine()
        record.finish("stop" if stopped else "length")
      out.append(record)
    return out

  def take_preempted(self) -> list[SampleRecord]:
    return []

  def extend(self, record: SampleRecord, tokens) -> None:
    slot = self._held(record)
    tokens = given_tokens(record, tokens)
    record.give(tokens, self._version)
    slot.kv_version = min(slot.kv_version, self._version)
    self._counters.tokens_fed += len(tokens)
    record.go_live()

  def release(self, record: SampleRecord) -> None:
    self._held(record)
    self._free(record)
    record.finish("stop")

  def set_aside(self, record: SampleRecord) -> None:
    slot = self._held(record)
    self._keep(slot)
    self._slots[self._slots.index(slot)] = None

  def snapshot(self, with_kv: bool = True, keep: bool = False) -> list[SampleRecord]:
    out = []
    for index, slot in enumerate(self._slots):
      if slot is None:
        continue
      self._read_back(slot)
      self._slots[index] = None
      if keep and with_kv and slot.record.status is not Status.HELD:
        self._keep(slot)  # its KV stays where it is
      else:
        slot.record.leave_engine()
        if with_kv:
          self._copy_out(slot.record, slot.kv_version)
      out.append(slot.record)
    self.events.emit("snapshot", 0.0)
    return out

  def discard(self, record: SampleRecord) -> None:
    if self._kept.pop(record, None) is not None:
      record.leave_engine()

  def copy_out_kept(self) -> None:
    for record, kv_version in list(self._kept.items()):
      del self._kept[record]
      record.leave_engine()
      self._copy_out(record, kv_version)

  # ------------------------------------------------------------------ internals
  def _slot_of(self, record: SampleRecord) -> _Slot | None:
    return next((s for s in self._slots if s is not None and s.record is record), None)

  def _held(self, record: SampleRecord) -> _Slot:
    slot = self._slot_of(record)
    if slot is None or record.status is not Status.HELD:
      raise ValueError("the sample is not held in a slot at a stop")
    return slot

  def _free(self, record: SampleRecord) -> None:
    self._slots[self._slots.index(self._slot_of(record))] = None
    record.leave_engine()

  def _keep(self, slot: _Slot) -> None:
    slot.record.keep(slot.kv_version)
    self._kept[slot.record] = slot.kv_version

  def _read_back(self, slot: _Slot) -> None:
    record = slot.record
    record.read_back(
        np.concatenate([record.response, np.asarray(slot.tokens, np.int32)]),
        np.concatenate([record.logprobs, np.asarray(slot.logprobs, np.float32)]),
        np.concatenate([record.versions, np.asarray(slot.versions, np.int32)]),
    )
    slot.tokens, slot.logprobs, slot.versions = [], [], []

  def _copy_out(self, record: SampleRecord, kv_version: int) -> None:
    used = record.length - 1  # every position but the pending token's
    placeholder = np.zeros((1, used, 1, 1), np.float32)
    record.set_kv(placeholder, placeholder.copy(), kv_version)
    self._counters.kv_bytes_to_host += 2 * placeholder.nbytes
