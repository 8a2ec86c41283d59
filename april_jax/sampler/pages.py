"""The host's book of the KV page pool: which pages each slot holds, and which are free.

The device pool is k, v [L, P, K, page, H]. It is split like the slots: with the slots
sharded over D devices of the data axes, slot s lives on shard s // (S / D) and may only
hold pages of that shard, P / D pages each, the last of which is the shard's scratch page
(decode writes the KV of free slots there; no table lists it). Page ids in the table are
local to the shard, so every device reads and writes its own pages only.

A slot's table row lists its pages in order, -1 past the last. The host allocates before
the device needs a page (engine.step reserves the pages a slot can fill within one
decode call), so the device never allocates. The table goes to the device with the next
insert, decode or KV read call after it changed (SlotEngine._table).
"""

from __future__ import annotations

import numpy as np


def pages_for(tokens: int, page_size: int) -> int:
  """Pages that hold `tokens` positions."""
  return -(-max(tokens, 0) // page_size)


class PageBook:
  """Free lists per shard and the page table [S, J] of local page ids."""

  def __init__(self, num_slots: int, pages_per_shard: int, shards: int, page_size: int, width: int):
    if num_slots % shards:
      raise ValueError(f"{num_slots} slots do not split over {shards} shards")
    self.page_size, self.shards = page_size, shards
    self.slots_per_shard = num_slots // shards
    self.usable = pages_per_shard - 1  # the last page of each shard is its scratch page
    self.scratch = pages_per_shard - 1
    self.table = np.full((num_slots, width), -1, np.int32)
    self.held = np.zeros(num_slots, np.int64)  # pages each slot holds
    # Lowest ids first: pages handed out in order, so tests and runs are reproducible.
    self._free = [list(range(self.usable - 1, -1, -1)) for _ in range(shards)]
    self.dirty = True  # the device table is stale

  def shard_of(self, slot: int) -> int:
    return slot // self.slots_per_shard

  def free(self, slot: int | None = None) -> int:
    """Free pages of the shard of `slot` (of all shards when None)."""
    if slot is None:
      return sum(len(f) for f in self._free)
    return len(self._free[self.shard_of(slot)])

  def used(self) -> int:
    return int(self.held.sum())

  def grow(self, slot: int, tokens: int) -> bool:
    """Gives the slot pages for its first `tokens` positions; False (nothing taken) if
    its shard has too few free pages."""
    need = pages_for(tokens, self.page_size) - int(self.held[slot])
    if need <= 0:
      return True
    if need + self.held[slot] > self.table.shape[1]:
      raise ValueError(f"slot {slot}: {tokens} positions exceed the page table's width")
    free = self._free[self.shard_of(slot)]
    if need > len(free):
      return False
    have = int(self.held[slot])
    for j in range(have, have + need):
      self.table[slot, j] = free.pop()
    self.held[slot] = have + need
    self.dirty = True
    return True

  def release(self, slot: int) -> None:
    """Every page of the slot back to its shard's free list."""
    n = int(self.held[slot])
    if n:
      self._free[self.shard_of(slot)].extend(self.table[slot, :n][::-1].tolist())
      self.table[slot, :] = -1
      self.held[slot] = 0
      self.dirty = True

  def pages(self, slot: int, tokens: int) -> np.ndarray:
    """The slot's first pages covering `tokens` positions (local ids)."""
    return self.table[slot, : pages_for(tokens, self.page_size)]
