"""The host's book of the KV page pool: which pages each slot holds, and which are free.

The device pool is k, v [L, P, K, page, H]. It is split like the slots: with the slots
sharded over D devices of the data axes, slot s lives on shard s // (S / D) and may only
hold pages of that shard, P / D pages each, the last of which is the shard's scratch page
(decode writes the KV of free slots there; no table lists it). Page ids in the table are
local to the shard, so every device reads and writes its own pages only.

A slot's table row lists its pages in order, -1 past the last. The host allocates before
the device needs a page (engine.step reserves the pages a slot can fill within one
decode call), so the device never allocates. The table goes to the device with the next
insert, decode or KV read call after it changed (KVManager.table, kv_manager.py).

Kept pages: a slot's pages can leave it and stay as they are for a key (`keep`): a
sample snapshotted at a step's end keeps its KV where it lies. They count as free
(`free` and every decision that reads it are what a `release` would give), are handed
out after every other free page (they are the front of the free list; a plain free page
goes to its back), and `grow`'s `reclaim(keys)` runs for the keys whose pages it is
about to hand out, so the caller copies them out first. `adopt` gives them back to a
slot in place.
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
    self.kept: dict = {}  # key (hashable) -> (shard, its pages in order)
    self._kept_page: list[dict] = [{} for _ in range(shards)]  # page -> key

  def shard_of(self, slot: int) -> int:
    return slot // self.slots_per_shard

  def free(self, slot: int | None = None) -> int:
    """Free pages of the shard of `slot` (of all shards when None)."""
    if slot is None:
      return sum(len(f) for f in self._free)
    return len(self._free[self.shard_of(slot)])

  def used(self) -> int:
    return int(self.held.sum())

  def grow(self, slot: int, tokens: int, reclaim=None) -> bool:
    """Gives the slot pages for its first `tokens` positions; False (nothing taken) if
    its shard has too few free pages. Before kept pages are handed out, reclaim(keys)
    runs once for their keys (whose pages all become plain free pages)."""
    need = pages_for(tokens, self.page_size) - int(self.held[slot])
    if need <= 0:
      return True
    if need + self.held[slot] > self.table.shape[1]:
      raise ValueError(f"slot {slot}: {tokens} positions exceed the page table's width")
    shard = self.shard_of(slot)
    free = self._free[shard]
    if need > len(free):
      return False
    have = int(self.held[slot])
    keys = self.kept_within(shard, need)
    if keys:
      if reclaim is None:
        raise RuntimeError(f"slot {slot} needs pages kept for {len(keys)} keys: no reclaim given")
      reclaim(keys)
      self.forget(*keys)
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

  def kept_within(self, shard: int, n: int) -> list:
    """Keys with kept pages among the next n pages the shard hands out, in that order
    (kept pages are the front of the free list: taken only once the rest are)."""
    kept = [self._kept_page[shard].get(p) for p in self._free[shard][-n:]] if n > 0 else []
    return list(dict.fromkeys(k for k in kept if k is not None))

  def keep(self, slot: int, key) -> None:
    """The slot's pages leave it, free for the accounting, their contents kept for `key`
    until they are reclaimed (grow), adopted or forgotten."""
    if key in self.kept:
      raise ValueError(f"pages are already kept for key {key}")
    n, shard = int(self.held[slot]), self.shard_of(slot)
    pages = self.table[slot, :n].tolist()
    self._free[shard][:0] = pages[::-1]  # handed out after every other free page
    self.kept[key] = (shard, pages)
    for page in pages:
      self._kept_page[shard][page] = key
    self.table[slot, :] = -1
    self.held[slot] = 0
    self.dirty = True

  def forget(self, *keys) -> None:
    """The keys' kept pages become plain free pages (at the back of the free list, in
    the keys' order), each shard's list remade once."""
    self._unkeep(keys)

  def _unkeep(self, keys, adopted: set[int] = frozenset()) -> None:
    """forget, but the pages in `adopted` leave the free list (adopt hands them out)."""
    back: dict[int, list[int]] = {}  # shard -> the pages going to its back, in order
    taken: dict[int, set[int]] = {}  # shard -> the pages leaving their place
    for key in keys:
      shard, pages = self.kept.pop(key)
      for page in pages:
        del self._kept_page[shard][page]
      back.setdefault(shard, []).extend(p for p in pages[::-1] if p not in adopted)
      taken.setdefault(shard, set()).update(pages)
    for shard, pages in back.items():
      free = self._free[shard]
      free[:] = [p for p in free if p not in taken[shard]] + pages

  def adopt(self, slot: int, key, tokens: int, reclaim=None) -> bool:
    """Gives an empty slot the pages kept for `key` (at most the pages for `tokens`
    positions; any more become plain free pages), then grows it to `tokens`. False if
    the slot is on another shard or its shard lacks the pages (nothing changes)."""
    shard, pages = self.kept[key]
    if shard != self.shard_of(slot) or self.held[slot]:
      return False
    pages = pages[: pages_for(tokens, self.page_size)]
    if pages_for(tokens, self.page_size) > len(self._free[shard]):
      return False
    self._unkeep([key], adopted=set(pages))
    self.table[slot, : len(pages)] = pages
    self.held[slot] = len(pages)
    self.dirty = True
    return self.grow(slot, tokens, reclaim)
