"""What an engine tells its listeners as it works (the contract's `listen`): the calls a
benchmark times or counts, each with its wall seconds and what it did. A listener
observes; it changes nothing, and an engine with none pays for nothing.

  step               seconds; kv_positions: the KV positions its decode steps read
  start_fresh        seconds (admitting fresh samples: their prefills and inserts)
  continue_partials  seconds (admitting partial samples: kept, host KV or prefilled again)
  snapshot           seconds
  prefill            seconds; lengths: the sequences one prefill call computed
  feed               seconds; rows, bucket: one chunked prefill of given tokens
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import numpy as np

EVENTS = ("step", "start_fresh", "continue_partials", "snapshot", "prefill", "feed")
Listener = Callable[..., None]  # listener(event, seconds, **facts)


class Events:
  """An engine's listeners, and how it tells them."""

  def __init__(self):
    self._listeners: list[Listener] = []

  @property
  def listening(self) -> bool:
    return bool(self._listeners)

  def listen(self, listener: Listener) -> None:
    self._listeners.append(listener)

  def emit(self, event: str, seconds: float, **facts) -> None:
    for listener in self._listeners:
      listener(event, seconds, **facts)


def reported(event: str):
  """A method of an engine (which has `events`) whose calls are told as `event`."""

  def wrap(method):
    @functools.wraps(method)
    def call(engine, *args, **kwargs):
      if not engine.events.listening:
        return method(engine, *args, **kwargs)
      began = time.perf_counter()
      try:
        return method(engine, *args, **kwargs)
      finally:
        engine.events.emit(event, time.perf_counter() - began)

    return call

  return wrap


def positions_read(before: np.ndarray, after: np.ndarray, live: list[int]) -> int:
  """KV positions the decode steps of the `live` slots read, from their lengths before and
  after: a slot at length s that grows by g reads s, s + 1, ..., s + g - 1 positions."""
  grown, start = np.maximum(after - before, 0)[live], before[live]
  return int((grown * start + grown * (grown - 1) // 2).sum())
