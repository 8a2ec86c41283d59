"""The rollout on its own devices, overlapped with the learner: a thread that keeps drawing
batches while the learner trains on the last one.

With mesh.rollout_devices > 0 the engine lives on the rollout mesh and this thread drives
the APRIL scheduler there; the learner (the trainer's own thread, on the learner mesh)
takes each finished batch, trains, and publishes the new decode weights here. Batch i is
the one update i trains (at policy version i):

  depth d      1 by default (batch i is drawn while the learner trains batch i - 1: the
               one-step-off pipeline); 0 when rollout.max_staleness is 0 (batch i waits
               for version i: the colocated schedule on two meshes)
  versions     in_flight_updates=False: batch i is drawn entirely by version
               max(i - d, v0) (v0: the version the run started or resumed at), whatever
               the threads' timing, so a run is reproducible. True: batch i starts with
               the newest version >= i - d, and takes each newer one at the next decode
               call (live slots go on over their kept KV, or recompute it in resume mode
               recompute).
  staleness    the scheduler judges each sample against the version that trains it (i),
               and restarts what would exceed max_staleness (rollout/scheduler.py); the
               rollout waits for version i - d rather than draw further ahead.

Requests (an evaluation, a checkpoint's capture of the rollout's state) run on this
thread at the boundary before batch k + d, where the engine holds exactly version k and
the batches k .. k + d - 1 wait for the learner: the learner names them when it
publishes version k, so none is missed. After a cut (SIGTERM) or an error the thread
parks: it draws nothing more, but still answers requests.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Callable

from april_jax.rollout.publish import WeightPublisher
from april_jax.rollout.scheduler import AprilScheduler, RolloutResult


@dataclasses.dataclass
class Waits:
  """Seconds each side spent waiting for the other, over a run."""

  rollout_s: float = 0.0  # the rollout, for weights it may draw with
  learner_s: float = 0.0  # the learner, for a batch


class _Request:
  """A function to run on the rollout thread at a boundary, and its outcome."""

  def __init__(self, fn: Callable[[], Any]):
    self.fn, self.done = fn, threading.Event()
    self.value, self.error = None, None

  def run(self) -> None:
    try:
      self.value = self.fn()
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e
    self.done.set()

  def result(self):
    self.done.wait()
    if self.error is not None:
      raise self.error
    return self.value


class AsyncRollout:
  """Draws batches on its thread; the learner takes them, publishes weights, asks for
  requests at boundaries."""

  def __init__(
      self,
      scheduler: AprilScheduler,
      publisher: WeightPublisher,
      *,
      depth: int,
      in_flight: bool,
      resume_mode: str,
      first_batch: int,
      version: int,
      waiting: list[RolloutResult] | None = None,
      cut_now: Callable[[], bool] | None = None,
      deliver: Callable[[Any], None] | None = None,
  ):
    self.scheduler, self.engine, self.publisher = scheduler, scheduler.engine, publisher
    self.depth, self.in_flight, self.resume_mode = int(depth), bool(in_flight), resume_mode
    self._floor = int(version)  # no older version exists: the run started here
    self._next = int(first_batch) + len(waiting or [])  # the batch the thread draws next
    self._results = collections.deque(waiting or [])  # finished, not yet taken
    self._taken = int(first_batch)  # the batch the learner takes next
    self._cut_now = cut_now or (lambda: False)
    # Set when the learner is in another process: each batch (the cut one too), or the
    # error that ended the rollout, is handed to it on this thread, in order with the
    # requests' own work, instead of waiting here to be taken.
    self._deliver = deliver
    self._published: dict[int, Any] = {}  # version -> decode weights on the learner mesh
    self._requests: dict[int, list[_Request]] = collections.defaultdict(list)
    self._cond = threading.Condition()
    self._closing = False
    self.parked = False  # drew its last batch (cut, error, or closed)
    self.error: BaseException | None = None
    self._cut: RolloutResult | None = None  # the batch a stop cut, if one did
    self.waits = Waits()
    self.swaps = 0  # weight sets taken, at batch starts and in flight
    self._thread = threading.Thread(target=self._run, name="april-rollout", daemon=True)

  # ----------------------------------------------------------------- learner side
  def start(self) -> None:
    self._thread.start()

  def publish(self, tree, version: int, requests: list[Callable[[], Any]] = ()) -> list[_Request]:
    """Version `version`'s decode weights (on the learner mesh) and the requests to run
    once the rollout holds them, at the boundary before batch version + depth."""
    made = [_Request(fn) for fn in requests]
    with self._cond:
      self._published[int(version)] = tree
      self._requests[int(version)].extend(made)
      self._cond.notify_all()
    return made

  def request(self, fn: Callable[[], Any]) -> Any:
    """Runs `fn` on the rollout thread at its next boundary (now, if it is parked or
    waiting for weights); its value."""
    return self.ask(fn).result()

  def ask(self, fn: Callable[[], Any]) -> _Request:
    """`request` without the wait."""
    made = _Request(fn)
    with self._cond:
      self._requests[-1].append(made)
      self._cond.notify_all()
    return made

  def take(self, index: int) -> RolloutResult | None:
    """Batch `index` once drawn (the learner waits: counted); the cut result (`cut`:
    nothing to train) when a stop cut it, None when the rollout closed first. Re-raises
    the rollout's error."""
    assert index == self._taken, (index, self._taken)
    start = time.perf_counter()
    with self._cond:
      while not self._results and not self.parked:
        self._cond.wait()
      self.waits.learner_s += time.perf_counter() - start
      if self._results:
        self._taken += 1
        result = self._results.popleft()
        self._cond.notify_all()
        return result
      if self.error is not None:
        raise self.error
      return self._cut

  def waiting_results(self) -> list[RolloutResult]:
    """The batches drawn and not yet taken (a checkpoint keeps them), oldest first."""
    return list(self._results)

  @property
  def publish_stats(self):
    """What the weights' copies have cost so far (publish.py)."""
    return self.publisher.stats

  def close(self, failing: bool = False) -> None:
    """Parks the thread and waits for it (its current batch is cut first). `failing`:
    the learner's own error ends the run (no one else to tell, in one process)."""
    del failing
    with self._cond:
      self._closing = True
      self._cond.notify_all()
    if self._thread.is_alive():
      self._thread.join()

  # ----------------------------------------------------------------- rollout side
  def _needed(self, batch: int) -> int:
    return max(batch - self.depth, self._floor)

  def _ready(self, batch: int) -> int | None:
    """The version batch `batch` starts with, if it may start now."""
    need = self._needed(batch)
    have = [v for v in self._published if v >= need] + (
        [self.engine.version] if self.engine.version >= need else []
    )
    if self.in_flight:
      return max(have) if have else None
    return need if need in have else None

  def _run_requests(self, upto: int) -> None:
    """The requests of versions <= upto (and the anytime ones), in version order."""
    for version in sorted(v for v in self._requests if v <= upto):
      for req in self._requests.pop(version):
        req.run()

  def _take_version(self, version: int) -> None:
    """Swaps in a published version (dropping it and older ones from the mailbox)."""
    with self._cond:
      tree = self._published.get(version)
      for v in [v for v in self._published if v <= version]:
        del self._published[v]
    if version != self.engine.version:
      self.publisher.swap(self.engine, tree, version)
      self.swaps += 1

  def _between_calls(self) -> None:
    """In flight: the newest published version, taken before the next decode call."""
    with self._cond:
      newer = [v for v in self._published if v > self.engine.version]
    if not newer:
      return
    self._take_version(max(newer))
    if self.resume_mode == "recompute":  # live slots' KV recomputed by the new weights
      live = self.engine.snapshot(with_kv=False)
      self.engine.admit(live, mode="recompute")

  def _run(self) -> None:
    try:
      while True:
        with self._cond:
          start = time.perf_counter()
          while True:
            self._run_requests(-1)
            version = None if self.parked else self._ready(self._next)
            if self._closing or version is not None or self.parked:
              break
            self._cond.wait()
          if not self.parked:
            self.waits.rollout_s += time.perf_counter() - start
          if self._closing:
            return
        if self.parked:
          self._serve_parked()
          return
        self._take_version(version)
        with self._cond:  # a checkpoint or evaluation at this version's boundary
          self._run_requests(self.engine.version)
        batch = self._next
        stopping = lambda: self._closing or self._cut_now()
        result = self.scheduler.step(
            batch,
            cut_now=stopping,
            give_up=stopping,  # a wait for rewards ends at a stop too
            train_version=batch,
            between_calls=self._between_calls if self.in_flight else None,
        )
        if self._deliver is not None:
          self._deliver(result)
        with self._cond:
          if result.cut:
            self.parked, self._cut = True, result
          else:
            if self._deliver is None:
              self._results.append(result)
            self._next += 1
          self._cond.notify_all()
    except BaseException as e:  # pylint: disable=broad-except
      with self._cond:
        self.error, self.parked = e, True
        self._cond.notify_all()
      if self._deliver is not None:
        self._deliver(e)
      self._serve_parked()

  def _serve_parked(self) -> None:
    """After the last batch: answers requests until closed. A request made at a version
    runs with that version taken (an evaluation then scores it); after an error, every
    request fails with it (no checkpoint of a rollout that failed mid-batch)."""
    with self._cond:
      self.parked = True
      self._cond.notify_all()
      while True:
        for version in sorted(self._requests):
          for req in self._requests.pop(version):
            if self.error is not None:
              req.error = self.error
              req.done.set()
              continue
            if version > self.engine.version and version in self._published:
              self._take_version(version)
            req.run()
        if self._closing:
          return
        self._cond.wait()
