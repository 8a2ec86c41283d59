"""The learner's handle on a rollout that runs in another process (a split run across
processes, docs/async.md): rollout/base.py's interface, as rollout/threaded.py's is in one
process, over a Channel (rollout/channel.py) and a WeightServer
(rollout/remote_weights.py).

The rollout process (rollout/server.py) runs the AsyncRollout itself and sends each
batch as it is drawn; a thread here files them, and the answers to requests, in the
order they were sent. A capture (the rollout's state for a checkpoint) is completed
here with the batches received and not yet trained at the moment it arrived: those are
exactly the ones drawn before its boundary.

Requests are named: "evaluate" (metrics) and "capture" (arrays, host JSON). The batches
a checkpoint holds drawn and not yet trained stay here (`restore`), taken first; the
rollout's process starts drawing after them.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Sequence

from april_jax.errors import InputError
from april_jax.rollout import in_flight
from april_jax.rollout import wire
from april_jax.rollout.async_rollout import Waits
from april_jax.rollout.base import Rollout, check_requests
from april_jax.rollout.buffer import PartialBuffer
from april_jax.rollout.channel import TO_LEARNER, TO_ROLLOUT, Channel
from april_jax.rollout.publish import PublishStats
from april_jax.rollout.remote_weights import WeightServer
from april_jax.rollout.scheduler import RolloutResult
from april_jax.rollout.step_counts import StepCounts

POLL_S = 0.2  # how often a wait looks at a stop, and the receiving thread at a close


class RolloutProcessFailed(RuntimeError):
  """The rollout's process reported an error (its words)."""


class RolloutInputError(InputError):
  """The rollout's process stopped at bad input the user can fix (its words)."""


def abandon() -> None:
  """Tells a rollout process that was never started to close (the learner failed
  first): the first message of its stream."""
  Channel(send_on=TO_ROLLOUT, receive_on=TO_LEARNER).send({"kind": "close"})


class RemoteRollout(Rollout):
  """The rollout in another process. make_weights: the WeightServer, made at start."""

  def __init__(
      self,
      channel: Channel,
      make_weights: Callable[[], WeightServer],
      *,
      cut_now: Callable[[], bool] | None = None,
  ):
    self._channel, self._make_weights, self._weights = channel, make_weights, None
    self._taken = 0
    self._started = False
    self._restored = None  # a checkpoint's rollout state, sent with the start
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
    self._stopping = False  # the rollout's process was asked to stop (its SIGTERM)
    self.error: BaseException | None = None
    self.waits = Waits()
    self.swaps = 0
    self.publish_stats = PublishStats()
    self._step_counts = StepCounts()
    self._thread = threading.Thread(target=self._receive, name="april-learner-rx", daemon=True)

  # ----------------------------------------------------------------------- learner side
  def restore(self, arrays: dict, host: dict) -> tuple[int, int]:
    """The rollout's process takes the buffer and counters when it starts; the batches
    drawn and not yet trained stay here, taken first."""
    own, waiting = in_flight.from_state(arrays, host.get("waiting"))
    self._restored = own, {k: host[k] for k in ("scheduler", "data")}
    self._batches.extend(waiting)
    return PartialBuffer.groups_in(own), len(waiting)

  def start(self, params, version, first_batch, *, warm_up, evaluate_first):
    """Sends version `version`'s weights (and the restored rollout state) to the
    rollout's process, which warms up its engine and starts drawing after the batches
    held here; the evaluation before training when asked (its metrics), else None."""
    del warm_up  # the rollout's process compiles its own programs
    self._weights = self._make_weights()
    self._taken = int(first_batch)
    self._started = True
    self._thread.start()
    offered = self._offer(params, version)
    rid = self._rid() if evaluate_first else None
    arrays, host = self._restored if self._restored is not None else ({}, None)
    header = {
        "kind": "start",
        "weights": offered.to_json(),
        "first_batch": self._taken + len(self._batches),
    }
    header.update(address=self._weights.address, rollout=host, evaluate_first=rid)
    self._channel.send(header, arrays)
    return None if rid is None else self._answer(rid)

  def publish(self, params, version: int, requests: Sequence[str] = ()) -> list[Any]:
    """Version `version`'s weights, and the named requests to run once the rollout holds
    them; their answers. Waits until the rollout pulled the last version offered (or
    parked): the learner's wait."""
    check_requests(requests)
    start = time.perf_counter()
    with self._cond:
      while self._pulled != self._offered and not self.parked and self.error is None:
        self._wait()
      self._raise()
    offered = self._offer(params, version)
    named = [[self._rid(), name] for name in requests]
    self._channel.send({"kind": "publish", "weights": offered.to_json(), "requests": named})
    answers = [self._answer(rid) for rid, _ in named]
    self.waits.learner_s += time.perf_counter() - start
    return answers

  def request(self, name: str) -> Any:
    """Runs a named request at the rollout's next boundary; its answer."""
    check_requests([name])
    start = time.perf_counter()
    rid = self._rid()
    self._channel.send({"kind": "request", "id": rid, "name": name})
    answer = self._answer(rid)
    self.waits.learner_s += time.perf_counter() - start
    return answer

  def step_metrics(self) -> dict[str, float]:
    return self._step_counts.since_last(self.waits, self.swaps, self.publish_stats)

  @property
  def stopping(self) -> bool:
    """Whether the rollout's process was asked to stop (its SIGTERM, told before its cut
    batch): the learner stops at the end of its step."""
    return self._stopping

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
    waits (bounded) for it to say it has. Never started: the rollout's process waits for
    a start, and is told to close instead (`abandon`)."""
    if not self._started:
      abandon()
      return
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
        self._stopping = True
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
