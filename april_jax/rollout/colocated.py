"""The rollout on the learner's own devices (mesh.rollout_devices = 0, the default): the
engine decodes the learner's params, and a batch is drawn when the trainer takes it, so
every trained token was drawn by the current params (rollout/base.py's interface)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from april_jax.rollout.base import Rollout, check_requests


class ColocatedRollout(Rollout):
  """side: the rollout's parts (rollout/side.py RolloutSide). cut_now: whether a stop cuts
  the batch being drawn; give_up: whether a wait for rewards ends at once (one process
  only: several must wait for the same rewards)."""

  def __init__(self, side, *, cut_now: Callable[[], bool], give_up: Callable[[], bool] | None):
    self.side = side
    self._cut = threading.Event()  # cut(): a stop of the rollout's own
    self._cut_now = lambda: self._cut.is_set() or cut_now()
    self._give_up = give_up
    self._waiting: list = []  # drawn before the checkpoint resumed from, not yet trained

  def restore(self, arrays: dict, host: dict) -> tuple[int, int]:
    self._waiting = self.side.restore(arrays, host)
    return len(self.side.scheduler.buffer), len(self._waiting)

  def start(self, params, version, first_batch, *, warm_up, evaluate_first):
    del first_batch  # a batch is drawn when taken
    self.side.engine.set_policy(params, version)
    if warm_up:
      self.side.engine.warm_up()
    return self.side.evaluate() if evaluate_first else None

  def take(self, index: int):
    if self._waiting:
      return self._waiting.pop(0)
    assert self.side.engine.version == index, (self.side.engine.version, index)
    return self.side.scheduler.step(index, cut_now=self._cut_now, give_up=self._give_up)

  def publish(self, params, version: int, requests: Sequence[str] = ()) -> list[Any]:
    check_requests(requests)
    self.side.engine.set_policy(params, version)
    return [self.request(name) for name in requests]

  def request(self, name: str) -> Any:
    check_requests([name])
    if name == "evaluate":
      return self.side.evaluate()
    return self.side.capture(self._waiting)

  def cut(self) -> None:
    """The next batch drawn is cut at once (a run's SIGTERM cuts the one being drawn
    through cut_now)."""
    self._cut.set()

  def close(self, failing: bool = False) -> None:
    del failing
    for close in self.side.closers():
      close()
