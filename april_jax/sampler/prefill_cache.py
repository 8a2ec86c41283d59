"""Prompt prefills, shared: one prefill per distinct prompt, the last call's KV held.

A group's samples start as slots free up, one or a few at a time, so the same prompt is
asked for again and again. `PrefillCache.kvs` prefills a list of prompts in calls of one
length bucket (`rows(bucket)` prompts a call), a prompt given twice once, and holds the
KV of the call that has the last prompt on the device (one call's KV, in the memory
plan), so the next request for that prompt reuses it. New params or a new version
(`clear`, by SlotEngine.set_policy) drop it: the held KV is what a new prefill computes.
("Kept" KV, elsewhere, is a snapshotted sample's KV left in the pool: kept_kv.py.)
"""

from __future__ import annotations

from typing import Callable

import numpy as np


class PrefillCache:
  """The last prefill call's KV, held for the prompt it was asked for last."""

  def __init__(self, bucket: Callable[[int], int], rows: Callable[[int], int]):
    """bucket(n) -> T, the length bucket of n tokens; rows(T) -> prompts per call."""
    self._bucket, self._rows = bucket, rows
    self._last = None  # (version, prompt bytes, KV, its row)

  def clear(self) -> None:
    self._last = None

  def kvs(self, prompts: list[np.ndarray], version: int, prefill: Callable):
    """Yields (KV [L, B, T, K, H], [(prompt index, row)]): every prompt's prefilled KV,
    by the policy of `version` (prefill(sequences): one call's KV, the engine's).
    At most two calls' KV are alive at once: the held one and the newest (the caller
    lets each go once inserted)."""
    at: dict[bytes, list[int]] = {}
    for i, p in enumerate(prompts):
      at.setdefault(np.asarray(p, np.int32).tobytes(), []).append(i)
    last = np.asarray(prompts[-1], np.int32).tobytes()
    held = self._last
    if held is not None and held[0] == version and held[1] in at:
      yield held[2], [(i, held[3]) for i in at.pop(held[1])]
    if last in at:
      self._last = held = None  # replaced below: let it go before prefilling
    by_bucket: dict[int, list[bytes]] = {}
    for key, where in at.items():
      by_bucket.setdefault(self._bucket(len(prompts[where[0]])), []).append(key)
    for T, keys in by_bucket.items():
      width = self._rows(T)
      for c in range(0, len(keys), width):
        chunk = keys[c : c + width]
        kv = prefill([prompts[at[key][0]] for key in chunk])
        if last in chunk:
          self._last = (version, last, kv, chunk.index(last))
        yield kv, [(i, row) for row, key in enumerate(chunk) for i in at[key]]
        del kv
