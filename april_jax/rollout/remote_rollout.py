"""The learner's handle on a rollout that runs in another process (a split run across
processes, docs/async.md): what rollout/async_rollout.py's AsyncRollout is to the
trainer in one process, over a Channel (rollout/channel.py) and a WeightServer
(rollout/remote_weights.py).

The rollout process (rollout_server.py) runs the AsyncRollout itself and sends each
batch as it is drawn; a thread here files them, and the answers to requests, in the
order they were sent. A capture (the rollout's state for a checkpoint) is completed
here with the batches received and not yet trained at the moment it arrived: those are
exactly the ones drawn before its boundary.

Requests are named: "evaluate" (metrics) and "capture" (arrays, host JSON).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

from april_jax.errors import InputError
from april_jax.rollout import in_flight
from april_jax.rollout import wire
from april_jax.rollout.async_rollout import Waits
from april_jax.rollout.channel import TO_LEARNER, TO_ROLLOUT, Channel
from april_jax.rollout.publish import PublishStats
from april_jax.rollout.remote_weights import WeightServer
from april_jax.rollout.scheduler import RolloutResult

POLL_S = 0.2  # how often a wait looks at a stop, and the receiving thread at a close


class RolloutProcessFailed(RuntimeError):
  """The rollout's process reported an error (its words)."""


class RolloutInputError(InputError):
  """The rollout's process stopped at bad input the user can fix (its words)."""


def abandon() -> None:
  """Tells a rollout process that was never started to close (the learner failed
  first): the first message of its stream."""
  Channel(send_on=TO_ROLLOUT, receive_on=TO_LEARNER).send({"kind": "close"})


class _Pending:
  """A request's answer, once it comes."""

  def __init__(self, owner: "RemoteRollout", rid: int):
    self._owner, self._rid = owner, rid

  def result(self):
    return self._owner._answer(self._rid)


class RemoteRollout:
  """take / publish / request / close, as AsyncRollout's, for a rollout in another
  process."""

  def __init__(
      self,
      channel: Channel,
      weights: WeightServer,
      *,
      first_batch: int,
      cut_now: Callable[[], bool] | None = None,
  ):
    self._channel, self._weights = channel, weights
    self._taken = int(first_batch)
    self._cut_now = cut_now or (lambda: False)
    self._cond = threading.Condition()
    self._batches: collections.deque[RolloutResult] = collections.deque()
    self._answers: dict[int, Any] = {}
    self._next_rid = 0
    self._offered: int | None = None  # the last version offered ...
    self._pulled: int | None = None  # ... and the last one the rollout pulled
    self._cut: RolloutResult | None = None
    self._sent_cut = False
    self._closing = False
    self.parked = False
    self.stopping = False  # the rollout's process was asked to stop (its SIGTERM)
    self.error: BaseException | None = None
    self.waits = Waits()
    self.swaps = 0
    self.publish_stats = PublishStats()
    self._thread = threading.Thread(target=self._receive, name="april-learner-rx", daemon=True)

  # ----------------------------------------------------------------------- learner side
  def start(self, tree, version: int, *, rollout=None, evaluate_first: bool = False):
    """Sends version `version`'s weights (and a checkpoint's rollout state, `rollout`:
    (arrays, host JSON)) to the rollout, which starts drawing; the evaluation before
    training when asked (its metrics), else None."""
    self._thread.start()
    offered = self._offer(tree, version)
    rid = self._rid() if evaluate_first else None
    arrays, host = rollout if rollout is not None else ({}, None)
    header = {"kind": "start", "weights": offered.to_json(), "first_batch": self._taken}
    header.update(address=self._weights.address, rollout=host, evaluate_first=rid)
    self._channel.send(header, arrays)
    return None if rid is None else self._answer(rid)

  def publish(self, tree, version: int, requests: list[str] = ()) -> list[_Pending]:
    """Version `version`'s weights, and the named requests to run once the rollout holds
    them. Waits until the rollout pulled the last version offered (or parked)."""
    with self._cond:
      while self._pulled != self._offered and not self.parked and self.error is None:
        self._wait()
      self._raise()
    offered = self._offer(tree, version)
    named = [[self._rid(), name] for name in requests]
    self._channel.send({"kind": "publish", "weights": offered.to_json(), "requests": named})
    return [_Pending(self, rid) for rid, _ in named]

  def request(self, name: str) -> Any:
    """Runs a named request at the rollout's next boundary; its answer."""
    rid = self._rid()
    self._channel.send({"kind": "request", "id": rid, "name": name})
    return self._answer(rid)

  def take(self, index: int) -> RolloutResult | None:
    """Batch `index` once it came; the cut result when a stop cut the rollout (a stop here
    asks the rollout to cut first)."""
    assert index == self._taken, (index, self._taken)
    start = time.perf_counter()
    with self._cond:
      while not self._batches and not self.parked and self.error is None:
        self._wait()
      self.waits.learner_s += time.perf_counter() - start
      if self._batches:
        self._taken += 1
        return self._batches.popleft()
      self._raise()
      return self._cut

  def cut(self) -> None:
    """Asks the rollout to cut its batch and park (a stop), once."""
    if not self._sent_cut:
      self._sent_cut = True
      self._channel.send({"kind": "cut"})

  def waiting_results(self) -> list[RolloutResult]:
    return list(self._batches)

  def close(self, failing: bool = False, timeout_s: float = 60.0) -> None:
    """Tells the rollout to close (`failing`: the learner's own error ends the run), and
    waits (bounded) for it to say it has."""
    if self._thread.is_alive():
      try:
        self._channel.send({"kind": "close", "failed": bool(failing)})
      except Exception:  # pylint: disable=broad-except  # the peer is gone: nothing to close
        pass
    with self._cond:
      deadline = time.monotonic() + timeout_s
      while self._thread.is_alive() and not self._closing and time.monotonic() < deadline:
        self._cond.wait(POLL_S)
      self._closing = True
    self._thread.join(timeout=2 * POLL_S + 5)

  # ---------------------------------------------------------------------------- inside
  def _rid(self) -> int:
    with self._cond:
      self._next_rid += 1
      return self._next_rid

  def _offer(self, tree, version: int):
    offered = self._weights.offer(tree, version)
    with self._cond:
      self._offered = int(version)
    return offered

  def _wait(self) -> None:
    """One wait for the rollout (the lock held); a stop here cuts the rollout first, as
    the rollout's thread in one process would see it at its next call."""
    if self._cut_now():
      self.cut()
    self._cond.wait(POLL_S)

  def _raise(self) -> None:
    if self.error is not None:
      raise self.error

  def _answer(self, rid: int):
    with self._cond:
      while rid not in self._answers and self.error is None:
        self._wait()
      if rid in self._answers:
        value = self._answers.pop(rid)
        if isinstance(value, BaseException):
          raise value
        return value
      self._raise()

  def _receive(self) -> None:
    try:
      while True:
        with self._cond:
          if self._closing:
            return
        message = self._channel.receive(POLL_S * 5)
        if message is not None and self._file(*message):
          return
    except BaseException as e:  # pylint: disable=broad-except  # the peer's loss, most likely
      with self._cond:
        self.error = self.error or e
        self._cond.notify_all()

  def _file(self, header: dict, arrays: dict) -> bool:
    """Files one message; True when it was the last (the rollout closed)."""
    kind = header["kind"]
    with self._cond:
      self._counts(header)
      if kind == "batch":
        result = wire.batch_of(header, arrays)
        if result.cut:
          self._cut, self.parked = result, True
        else:
          self._batches.append(result)
      elif kind == "stopping":
        self.stopping = True
      elif kind == "pulled":
        self._pulled = int(header["version"])
      elif kind == "answer":
        self._answers[int(header["id"])] = self._value(header, arrays)
      elif kind == "error":
        if header.get("input"):
          self.error = RolloutInputError(f"the rollout's process: {header['message']}")
        else:
          self.error = RolloutProcessFailed(f"the rollout's process failed: {header['message']}")
        self.parked = True
      elif kind == "closed":
        self._closing = True
      self._cond.notify_all()
      return kind == "closed"

  def _value(self, header: dict, arrays: dict):
    if "error" in header:
      return RolloutProcessFailed(f"the rollout's process failed: {header['error']}")
    if header["name"] != "capture":
      return header["value"]
    # The batches received and not yet trained were drawn before the capture's boundary.
    waiting, described = in_flight.to_state(list(self._batches))
    return {**arrays, **waiting}, {**header["value"], "waiting": described}

  def _counts(self, header: dict) -> None:
    """The rollout's own counts, sent with every message."""
    counts = header.get("counts")
    if counts:
      self.waits.rollout_s = counts["rollout_wait_s"]
      self.swaps = counts["swaps"]
      self.publish_stats.copies = counts["copies"]
      self.publish_stats.bytes = counts["bytes"]
      self.publish_stats.seconds = counts["publish_s"]
