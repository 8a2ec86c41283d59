"""The rollout as the learner sees it: one interface, whatever runs it and wherever.

A run's trainer holds one `Rollout` and never asks which it is:

  ColocatedRollout  (rollout/colocated.py) the engine decodes on the learner's own
                    devices; a batch is drawn when the trainer takes it
  ThreadedRollout   (rollout/threaded.py) the engine on devices of its own in this
                    process, drawing on a thread while the learner trains
                    (rollout/async_rollout.py)
  RemoteRollout     (rollout/remote_rollout.py) the same thread in the rollout's own
                    process (rollout/server.py), reached through messages

Batch i is the one update i trains. The calls, in a run's order:

  restore(arrays, host)      a checkpoint's rollout state (rollout/side.py `capture`), before
                             start: the partial buffer, the scheduler's counters, the data
                             position and the batches drawn and not yet trained; (groups
                             in the partial buffer, batches drawn to train)
  start(params, version, first_batch, *, warm_up, evaluate_first)
                             the rollout starts with the decode weights of `version`; batch
                             `first_batch` is taken next. warm_up: compile the sampler
                             first. evaluate_first: the evaluation's metrics, before any
                             batch is drawn (else None)
  take(i)                    batch i (a scheduler RolloutResult): the ones the checkpoint
                             holds drawn first; its `cut` one when a stop cut it; None when
                             the rollout closed before one
  publish(params, version, requests)
                             the decode weights after `version` updates, and the requests
                             to answer once the rollout holds them; their answers
  request(name)              a request answered at the rollout's next boundary
  cut()                      a stop: the batch being drawn is cut (what it drew stays in
                             the partial buffer) and nothing more is drawn
  step_metrics()             the async/* counts since the last call ({} colocated)
  stopping                   whether the rollout's own side was asked to stop (its SIGTERM)
  close(failing)             the end: the thread or process told, the reward and episode
                             workers closed. failing: the learner's own error ends the run

Requests, by name: "evaluate" (pass@1 and avg@k on the held-out items: metrics) and
"capture" (the state a checkpoint keeps: arrays, host JSON, the batches drawn and not yet
trained included). tests/rollout_conformance_test.py holds the three to one script.
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

REQUESTS = ("evaluate", "capture")


class Rollout(abc.ABC):
  """See the module docstring."""

  @abc.abstractmethod
  def restore(self, arrays: dict, host: dict) -> tuple[int, int]:
    """A checkpoint's rollout state, before `start`: (groups in the partial buffer,
    batches drawn and not yet trained)."""

  @abc.abstractmethod
  def start(
      self, params, version: int, first_batch: int, *, warm_up: bool, evaluate_first: bool
  ) -> dict[str, float] | None:
    """Starts rolling out with `version`'s decode weights; the evaluation's metrics when
    evaluate_first, else None."""

  @abc.abstractmethod
  def take(self, index: int):
    """Batch `index`, its cut one, or None (see the module docstring)."""

  @abc.abstractmethod
  def publish(self, params, version: int, requests: Sequence[str] = ()) -> list[Any]:
    """The weights after `version` updates; the requests' answers, in order."""

  @abc.abstractmethod
  def request(self, name: str) -> Any:
    """A request's answer, at the rollout's next boundary."""

  @abc.abstractmethod
  def cut(self) -> None:
    """A stop: the batch being drawn is cut and nothing more is drawn."""

  def step_metrics(self) -> dict[str, float]:
    """The async/* counts since the last call."""
    return {}

  @property
  def stopping(self) -> bool:
    """Whether the rollout's own side was asked to stop."""
    return False

  @abc.abstractmethod
  def close(self, failing: bool = False) -> None:
    """Ends the rollout and closes its workers."""


def check_requests(requests: Sequence[str]) -> None:
  unknown = [name for name in requests if name not in REQUESTS]
  if unknown:
    raise ValueError(f"unknown rollout requests {unknown}; known: {list(REQUESTS)}")
