"""Snapshotted samples whose KV stays in the pool's pages (SlotEngine.snapshot(keep=True)).

A step-end snapshot with `keep` leaves each unfinished sample's KV where it lies instead
of copying it to the host. Its pages count as free, so every decision about slots, pages
and preemption is what a plain snapshot gives, but they are handed out after every other
free page (pages.PageBook.keep). The KV is copied out only when its pages are about to be
handed to another slot (the book's `reclaim`), when the sample continues from its KV in
a slot on another shard than its pages (let_go), or when every kept sample must live on
the host (a checkpoint: copy_out_all). A kept sample put back with its KV takes its pages
back in place (take_back), and the engine rewrites only its slot's rows: no copy either
way. The attention sums never depend on which physical pages a slot holds, so either
path continues a sample bit for bit alike.

    kept = KeptKV(book, bucket, snapshot_width)
    kept.keep(slot, record, used, kv_version)  # at a snapshot, before the slot is released
    kept.copy_out_ahead(need, read, spare)   # before a batch of grows: copies together
    used = kept.take_back(slot, record, window, read)   # the sample back in place
    kept.let_go([record], read)         # it continues elsewhere: from a host copy
    kept.discard(record)                # it starts over: pages freed, nothing copied
    kept.copy_out_all(read)             # before a checkpoint

`read` is the engine's read of pool KV (ReadKV), given with each call that may copy
KV out: this object holds no reference back to the engine. The kv manager
(kv_manager.py) is its only caller.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from april_jax.sampler import pages
from april_jax.sampler.records import SampleRecord, Status

# read_kv(slots [W] (-1: none), kv_len, table [S, J]) -> host (k, v), each
# [L, W, kv_len, K, H]: the KV of the table's rows `slots`.
ReadKV = Callable[[np.ndarray, int, np.ndarray], tuple[np.ndarray, np.ndarray]]


class KeptKV:
  """The records whose KV is kept in the pool, with the KV positions each used. The
  book's keys for kept pages are the records themselves."""

  def __init__(self, book: pages.PageBook, bucket: Callable[[int], int], snapshot_width: int):
    self.book, self._bucket, self._width = book, bucket, snapshot_width
    self._used: dict[SampleRecord, int] = {}
    self.bytes_to_host = 0  # KV copied out of kept pages

  def __contains__(self, record: SampleRecord) -> bool:
    return record in self._used

  def __len__(self) -> int:
    return len(self._used)

  def keep(self, slot: int, record: SampleRecord, used: int, kv_version: int) -> None:
    """The slot's pages stay as they are for the record (its first `used` positions, of
    `kv_version`)."""
    self._used[record] = used
    self.book.keep(slot, record)
    record.keep(kv_version)

  def pages_of(self, record: SampleRecord) -> int:
    """Pages kept for the record (0 if none)."""
    return len(self.book.kept[record][1]) if record in self else 0

  def on_shard(self, record: SampleRecord, shard: int) -> bool:
    """Whether the record's kept pages are on `shard`."""
    return self.book.kept[record][0] == shard

  def take_back(self, slot: int, record: SampleRecord, window: int, read: ReadKV) -> int:
    """The record's pages to the empty slot, grown to `window` positions; returns the KV
    positions it used. The slot must be on the pages' shard, with room for the window."""
    if not self.book.adopt(slot, record, window, self.reclaim(read)):
      raise RuntimeError(f"slot {slot} could not take back the pages kept for its sample")
    record.leave_engine()
    return self._used.pop(record)

  def reclaim(self, read: ReadKV) -> Callable[[list[SampleRecord]], None]:
    """The book's `reclaim` for a grow: copies out the records whose pages it takes."""
    return lambda records: self.copy_out(records, read)

  def copy_out_ahead(self, grows, read: ReadKV, spare=frozenset()) -> None:
    """Copies out together the kept KV in the pages the coming grows will take (grows:
    (shard, pages it adds; none if <= 0) each), but for the records in `spare` (about
    to take their own pages back), so the grows do not copy one record at a time.
    Whatever a grow still reaches it copies out itself (copy_out is the book's reclaim)."""
    need: dict[int, int] = {}  # shard -> pages
    for shard, n in grows:
      need[shard] = need.get(shard, 0) + max(n, 0)
    keys = [k for shard, n in need.items() for k in self.book.kept_within(shard, n)]
    self._let_go([k for k in keys if k not in spare], read)

  def let_go(self, records: list[SampleRecord], read: ReadKV | None) -> None:
    """The records' pages become plain free pages, their KV copied out first (with
    `read`; None: not copied)."""
    self._let_go([r for r in records if r in self], read)

  def discard(self, record: SampleRecord) -> None:
    """Lets the record's pages go without copying its KV (it starts over)."""
    self.let_go([record], None)

  def copy_out_all(self, read: ReadKV) -> None:
    """Every kept record's KV to the host, its pages then plain free pages."""
    self._let_go(list(self._used), read)

  def _let_go(self, keys: list[SampleRecord], read: ReadKV | None) -> None:
    if read is not None:
      self.copy_out(keys, read)
    for key in keys:
      self._used.pop(key, None)
      if key.engine_status is Status.KEPT:
        key.leave_engine()
    self.book.forget(*keys)

  def copy_out(self, keys: list[SampleRecord], read: ReadKV) -> None:
    """Kept records' KV to the host, from their pages (before they are handed out):
    records of one length bucket share read calls, snapshot_width per call, each read
    through a row of its pages' shard in a table of the call's own."""
    W, per_shard = self._width, self.book.slots_per_shard
    by_bucket: dict[int, list[int]] = {}
    for key in keys:
      by_bucket.setdefault(self._bucket(max(self._used[key], 1)), []).append(key)
    for kv_len, pending in by_bucket.items():
      while pending:
        table, slots, chunk = self.book.table.copy(), np.full(W, -1, np.int32), []
        rows_used: dict[int, int] = {}  # shard -> rows of it taken in this call
        for key in list(pending):
          shard, kept_pages = self.book.kept[key]
          if len(chunk) == W or rows_used.get(shard, 0) == per_shard:
            continue
          row = shard * per_shard + rows_used.get(shard, 0)
          rows_used[shard] = rows_used.get(shard, 0) + 1
          table[row] = -1
          table[row, : len(kept_pages)] = kept_pages
          slots[len(chunk)] = row
          chunk.append(key)
          pending.remove(key)
        k, v = read(slots, kv_len, table)
        for j, record in enumerate(chunk):
          used = self._used.pop(record)
          record.leave_engine()
          record.set_kv(k[:, j, :used].copy(), v[:, j, :used].copy(), record.kv_version)
          self.bytes_to_host += record.kv_k.nbytes + record.kv_v.nbytes
