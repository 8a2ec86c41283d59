"""The rollout on devices of its own in the learner's process (mesh.rollout_devices > 0 on
one process): the AsyncRollout's thread (rollout/async_rollout.py) draws while the
learner trains, behind rollout/base.py's interface. The weights cross from the learner's
mesh to the rollout's through the side's publisher (rollout/publish.py)."""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

from april_jax.rollout.async_rollout import AsyncRollout
from april_jax.rollout.base import Rollout, check_requests
from april_jax.rollout.step_counts import StepCounts


class ThreadedRollout(Rollout):
  """side: the rollout's parts (rollout/side.py RolloutSide, with a publisher); depth,
  in_flight and resume_mode as AsyncRollout takes them; cut_now: whether a stop cuts the
  batch being drawn (the thread looks at it itself)."""

  def __init__(self, side, *, depth: int, in_flight: bool, resume_mode: str, cut_now):
    self.side, self.publisher = side, side.publisher
    self._depth, self._in_flight, self._resume_mode = depth, in_flight, resume_mode
    self._cut = threading.Event()  # cut(): a stop of the rollout's own
    self._cut_now = lambda: self._cut.is_set() or cut_now()
    self._waiting: list = []  # drawn before the checkpoint resumed from, handed to the thread
    self._thread: AsyncRollout | None = None
    self._step_counts = StepCounts()

  def restore(self, arrays: dict, host: dict) -> tuple[int, int]:
    self._waiting = self.side.restore(arrays, host)
    return len(self.side.scheduler.buffer), len(self._waiting)

  def start(self, params, version, first_batch, *, warm_up, evaluate_first):
    side = self.side
    self.publisher.swap(side.engine, params, version)
    if warm_up:
      side.engine.warm_up()
    metrics = side.evaluate() if evaluate_first else None
    self._thread = AsyncRollout(
        side.scheduler,
        self.publisher,
        depth=self._depth,
        in_flight=self._in_flight,
        resume_mode=self._resume_mode,
        first_batch=first_batch,
        version=version,
        waiting=self._waiting,
        cut_now=self._cut_now,
    )
    self._waiting = []
    self._thread.start()
    return metrics

  def take(self, index: int):
    return self._thread.take(index)

  def publish(self, params, version: int, requests: Sequence[str] = ()) -> list[Any]:
    check_requests(requests)
    start = time.perf_counter()
    made = self._thread.publish(params, version, [self._service(name) for name in requests])
    answers = [r.result() for r in made]
    self._thread.waits.learner_s += time.perf_counter() - start  # the learner waits
    return answers

  def request(self, name: str) -> Any:
    check_requests([name])
    start = time.perf_counter()
    answer = self._thread.request(self._service(name))
    self._thread.waits.learner_s += time.perf_counter() - start
    return answer

  def _service(self, name: str):
    """A request's work, run on the rollout's thread at its boundary."""
    if name == "evaluate":
      return self.side.evaluate
    return lambda: self.side.capture(self._thread.waiting_results())

  def cut(self) -> None:
    """The batch being drawn is cut, and the thread parks (a run's SIGTERM reaches it
    through cut_now too)."""
    self._cut.set()

  def step_metrics(self) -> dict[str, float]:
    t = self._thread
    return self._step_counts.since_last(t.waits, t.swaps, t.publish_stats)

  def close(self, failing: bool = False) -> None:
    if self._thread is not None:
      self._thread.close(failing=failing)
    for close in self.side.closers():
      close()
