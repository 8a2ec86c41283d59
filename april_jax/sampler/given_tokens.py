"""Given tokens waiting to be written into their slots' pages, and the feed calls that
write them.

A slot holds given tokens past its KV when it was extended (an environment's
observation appended to a held sample) or resumed with KV for fewer positions than its
tokens. With feed_given "prefill" the next engine step writes them by chunked prefills
(slot_ops.feed, split as feeding.py says) before it decodes; each slot then stands at its
record's length, its last given token pending. This part owns which slots wait.
"""

from __future__ import annotations

import time

import numpy as np

from april_jax.sampler import feeding


class GivenTokens:
  """The slots whose given tokens the next step feeds."""

  def __init__(self):
    self._slots: set[int] = set()

  def __contains__(self, slot: int) -> bool:
    return slot in self._slots

  def add(self, slot: int) -> None:
    self._slots.add(slot)

  def discard(self, slot: int) -> None:
    self._slots.discard(slot)

  def feed(self, parts) -> None:
    """Every waiting slot's given tokens into its pages (the pages are the step's, from
    its reservation); the slots' host lengths follow. parts: engine_parts.EngineParts."""
    slots, config, counters = parts.slots, parts.config, parts.counters
    todo = {s: (int(slots.lengths[s]), slots.owner(s).length) for s in self._slots}
    self._slots.clear()
    W = config.insert_width
    params = parts.policy.params
    for T, pieces in feeding.calls(todo, config.feed_len, parts.bucket, W):
      rows = feeding.rows(len(pieces), W)
      at, ends = np.full(rows, -1, np.int32), np.zeros(rows, np.int32)
      for j, (slot, end) in enumerate(pieces):
        at[j], ends[j] = slot, end
        counters.tokens_fed += end - int(slots.lengths[slot])
        slots.lengths[slot] = end
      began = time.perf_counter()
      parts.device.feed(params, at, ends, T, parts.kv.table())
      if parts.events.listening:
        parts.events.emit("feed", time.perf_counter() - began, rows=rows, bucket=T)
      counters.feed_rows += rows
      counters.feeds += 1
