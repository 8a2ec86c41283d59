"""The KV pool's host side: pages, kept KV and placement, owned by one object.

The engine's slots hold their KV in a page pool (pages.py). This manager owns the page
book and the KV kept in it after a snapshot (kept_kv.py), and answers the engine's
questions about them: where a sample may start (`place`: a free slot on a shard with
pages for it, its home shard first), how many pages a slot needs for one decode call
(`window`), pages for a batch of starting samples (`give_pages`, a kept sample taking
its own pages back in place), pages for the live slots' next call (`grow`), and the
page table a device call takes (`table`). KV is read out of the pool only by the
engine's device calls: every method that may copy kept KV out is given the engine's
read function (`read`) with the call, so nothing here calls back into the engine.

    kv = KVManager(config, pages_per_shard, shards, table_sharding)
    slots = kv.place(free_slots, records)          # in order, as far as they fit
    in_place = kv.give_pages(slots, records, resume_kv, read)
    ok = kv.grow(slot, kv.window(length, limit), read)
    kv.keep(slot, record, used, kv_version); kv.release(slot); kv.copy_out_all(read)
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from april_jax import buckets
from april_jax.sampler import kept_kv, pages
from april_jax.sampler.engine_config import EngineConfig
from april_jax.sampler.records import SampleRecord


class KVManager:
  """The page book, the kept KV, and the rules that place samples on pages."""

  def __init__(self, config: EngineConfig, pages_per_shard: int, shards: int, table_sharding=None):
    self.config = config
    self.book = pages.PageBook(
        config.num_slots,
        pages_per_shard,
        shards,
        config.page_size,
        pages.pages_for(config.max_len, config.page_size),
    )
    bucket = functools.partial(buckets.bucket, min_bucket=config.min_bucket, cap=config.max_len)
    self.kept = kept_kv.KeptKV(self.book, bucket, config.snapshot_width)
    self._table_sharding = table_sharding
    self._table_arg = None  # the page table as last passed to a device call

  # ------------------------------------------------------------------- questions
  def shard_of(self, slot: int) -> int:
    return self.book.shard_of(slot)

  def window(self, length: int, limit: int) -> int:
    """Positions a slot at `length` may write within one decode call (its KV then
    covers them): the pending token's and sync_every - 1 more, never past limit - 1.
    With speculation, speculative_tokens more: room for a pass's drafts (a slot that
    used its window stops for the call; speculative.py)."""
    reach = self.config.sync_every + self.config.speculative_tokens
    return int(min(length - 1 + reach, limit - 1))

  def record_window(self, record: SampleRecord) -> int:
    return self.window(record.length, len(record.prompt) + record.max_new_tokens)

  def pages(self, positions: int) -> int:
    """Pages that hold `positions` positions."""
    return pages.pages_for(positions, self.config.page_size)

  def keeps(self, record: SampleRecord) -> bool:
    """Whether the record's KV is kept in the pool (a snapshot with keep)."""
    return record in self.kept

  def used_fraction(self) -> float:
    """Pool pages held by slots / usable pages."""
    return self.book.used() / max(self.book.usable * self.book.shards, 1)

  def place(self, free_slots: list[int], records: list[SampleRecord]) -> list[int]:
    """Slots for the records, in order, as far as they fit: each takes the lowest free
    slot on a shard with pages for its KV and one decode call's growth, the shard it
    was snapshotted from first (its home_shard, with more than one shard: where its
    kept pages are). Placing a list in parts, in order, gives what placing it whole
    does."""
    free: dict[int, list[int]] = {}  # shard -> its free slots, lowest first
    for slot in free_slots:
      free.setdefault(self.book.shard_of(slot), []).append(slot)
    left = {shard: self.book.free(slots[0]) for shard, slots in free.items()}
    out = []
    for r in records:
      need = self.pages(self.record_window(r))
      fits = [shard for shard, slots in free.items() if slots and left[shard] >= need]
      if not fits:
        break
      home = r.home_shard
      shard = home if home in fits else min(fits, key=lambda shard: free[shard][0])
      out.append(free[shard].pop(0))
      left[shard] -= need
    return out

  # --------------------------------------------------------------------- changes
  def give_pages(
      self, slots: list[int], records: list[SampleRecord], resume_kv: bool, read
  ) -> dict[SampleRecord, int]:
    """Pages for each record's slot (placed by `place`) for its KV and one decode call.
    With resume_kv a kept record takes its own pages back where it can; returns those
    records' KV positions. Any other kept record given here lets its pages go (its KV
    copied out if it continues from its KV)."""
    kept = self.kept
    # Kept records that cannot take their pages back let them go first, those that
    # continue from their KV copied out together (a slot on another shard than its pages).
    kept.let_go(
        [
            r
            for slot, r in zip(slots, records)
            if r in kept and not (resume_kv and kept.on_shard(r, self.book.shard_of(slot)))
        ],
        read if resume_kv else None,
    )
    windows = [self.record_window(r) for r in records]
    if len(kept):
      grows = [
          (self.book.shard_of(slot), self.pages(window) - kept.pages_of(r))
          for slot, r, window in zip(slots, records, windows)
      ]
      kept.copy_out_ahead(grows, read, set(records))
    in_place = {}
    for slot, r, window in zip(slots, records, windows):
      if r in kept:
        in_place[r] = kept.take_back(slot, r, window, read)
      else:
        self.book.grow(slot, window, kept.reclaim(read))
    return in_place

  def grow_ahead(self, windows: dict[int, int], read) -> None:
    """Before the live slots grow to their windows (slot -> positions): the kept KV in
    the pages they will reach, copied out in one batch."""
    if len(self.kept):
      self.kept.copy_out_ahead(
          (
              (self.book.shard_of(s), self.pages(w) - int(self.book.held[s]))
              for s, w in windows.items()
          ),
          read,
      )

  def grow(self, slot: int, positions: int, read) -> bool:
    """Pages for the slot's first `positions` positions; False if its shard lacks them."""
    return self.book.grow(slot, positions, self.kept.reclaim(read))

  def keep(self, slot: int, record: SampleRecord, used: int, kv_version: int) -> None:
    """The slot's pages stay as they are for the record (its first `used` positions, of
    `kv_version`)."""
    self.kept.keep(slot, record, used, kv_version)

  def release(self, slot: int) -> None:
    self.book.release(slot)

  def discard(self, record: SampleRecord) -> None:
    """A kept record's pages go, its KV not copied (it starts over)."""
    self.kept.discard(record)

  def copy_out_all(self, read) -> None:
    """Every kept record's KV to the host; its pages then plain free pages."""
    self.kept.copy_out_all(read)

  def table(self):
    """The page table for an insert, decode or KV read call (insert and decode make it
    the state's): the host's, passed with the call rather than uploaded by a device call
    of its own. On a mesh it is put on the devices once per change; without one the
    host's copy (remade once per change) goes with each call. Never the state's own
    buffer, which insert and decode donate."""
    if self.book.dirty:  # (a new book starts dirty)
      self._table_arg = self.book.table.copy()  # the host edits its table in place
      if self._table_sharding is not None:
        self._table_arg = jax.device_put(self._table_arg, self._table_sharding)
      self.book.dirty = False
    return self._table_arg

  def on_devices(self, table: np.ndarray):
    """A table of a call's own (kept KV read through other rows), placed like the book's."""
    if self._table_sharding is None:
      return table
    return jax.device_put(table, self._table_sharding)
