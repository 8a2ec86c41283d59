"""The parts a SlotEngine is made of, handed together to the procedures that use them.

Each part owns its state (slots.py, kv_manager.py, prefill_cache.py, device_slots.py,
given_tokens.py). The procedures over them (admission.py; decoding.py, which also keeps
the samples it preempted; the engine's held turns and snapshot) change the slots' host
lengths and the other parts through the parts' own methods. The policy (`Policy`: the params
and the version their tokens are tagged with) is written by the engine's set_policy
alone. No part refers back to the engine: a dropped engine frees its device state
without waiting for a collection.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from april_jax import buckets
from april_jax.models import qwen3
from april_jax.sampler.contract import EngineCounters
from april_jax.sampler.device_slots import DeviceSlots
from april_jax.sampler.speculation.history import DraftHistory
from april_jax.sampler.engine_config import EngineConfig
from april_jax.sampler.engine_events import Events
from april_jax.sampler.given_tokens import GivenTokens
from april_jax.sampler.kv_manager import KVManager
from april_jax.sampler.prefill_cache import PrefillCache
from april_jax.sampler.records import PromptError, SampleRecord
from april_jax.sampler.slots import Slots


@dataclasses.dataclass
class Policy:
  """The params an engine decodes with and the version its tokens are tagged with."""

  params: Any
  version: int


def bucket(n: int, config: EngineConfig) -> int:
  """The length bucket of n tokens (buckets.py), refused past the slot capacity."""
  if n > config.max_len:
    raise PromptError(f"{n} tokens exceed the slot capacity max_len={config.max_len}")
  return buckets.bucket(n, config.min_bucket, config.max_len)


@dataclasses.dataclass(frozen=True)
class EngineParts:
  """One engine's parts (each the one owner of its state) and its policy's reader."""

  cfg: qwen3.Qwen3Config
  config: EngineConfig
  slots: Slots
  kv: KVManager
  prompts: PrefillCache
  device: DeviceSlots
  given: GivenTokens
  counters: EngineCounters
  events: Events
  policy: Policy
  history: DraftHistory | None = None  # finished samples to draft from (speculation)

  def bucket(self, n: int) -> int:
    return bucket(n, self.config)

  def read_kv(self, slots, kv_len: int, table=None):
    """Host (k, v) [L, W, kv_len, K, H] of page-table rows `slots` (-1: none), through
    the book's table or a call's own `table` (kept KV: kv_manager.py)."""
    table = self.kv.table() if table is None else self.kv.on_devices(table)
    return self.device.read_kv(slots, kv_len, table)

  def read_back(self, items: list[tuple[int, SampleRecord]], with_kv: bool) -> None:
    """The slots' responses (and KV of the positions written: all but the pending token
    and any given tokens not yet fed; a Qwen3-MoE model's routes there) into their
    records (DeviceSlots' transfers)."""
    read = self.device.read_rows([slot for slot, _ in items])
    for (slot, record), (tokens, logprobs, versions, kv_version) in zip(items, read):
      record.read_back(tokens, logprobs, versions)  # given tokens not fed yet included
      self.slots.kv_versions[slot] = int(kv_version)
      if with_kv:
        record.set_kv_version(int(kv_version))
    used = [(slot, int(self.slots.lengths[slot]) - 1) for slot, _ in items]
    if self.cfg.num_experts:  # the experts the slots' forward passes chose (routing replay)
      for (_, record), routes in zip(items, self.device.read_routes(used, self.bucket)):
        record.add_routes(routes)
    if with_kv:
      for (_, record), (k, v) in zip(
          items, self.device.read_kvs(used, self.bucket, self.kv.table())
      ):
        record.set_kv(k, v, record.kv_version)

  def remember(self, record: SampleRecord) -> None:
    """A finished sample's tokens kept for its prompt's later samples to draft from. A
    history that fails is counted (draft_failures), never the step's failure: drafts
    only change how fast tokens come."""
    if self.history is not None:
      try:
        self.history.add(record)
      except Exception:  # pylint: disable=broad-except
        self.counters.draft_failures += 1

  def history_rows(self, record: SampleRecord) -> list:
    """The record's prompt's past samples to draft from (none if the history fails:
    counted, as in remember)."""
    if self.history is None:
      return []
    try:
      return self.history.rows(record.prompt)
    except Exception:  # pylint: disable=broad-except
      self.counters.draft_failures += 1
      return []

  def release(self, slot: int) -> None:
    """The slot free again: no sample, no pages, nothing to feed."""
    self.given.discard(slot)
    self.device.forget_drafts(slot)
    self.slots.release(slot)
    self.kv.release(slot)
