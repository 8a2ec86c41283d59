"""The rollout's process of a split run across processes (mesh.rollout_devices > 0, the
rollout's devices on processes of their own; docs/async.md).

It builds the rollout's half of the run (rollout/side.py) on its devices, waits for the
learner's start (the first weights, a checkpoint's rollout state), and runs the
AsyncRollout (rollout/async_rollout.py) there: every batch, as it is drawn, goes to
the learner; every published version is pulled between two decode calls; requests
(an evaluation, a capture for a checkpoint) run at their boundary and their answers
follow, all in one ordered stream (rollout/channel.py). The learner's process writes
every file of the run; this one writes only what user code prints.

Messages from the learner: start, publish (weights and requests), request, cut (a stop),
close. To it: batch, pulled, answer, error, closed.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import traceback

from absl import logging
import jax

from april_jax import sharding
from april_jax.errors import InputError
from april_jax.models import path_check
from april_jax.rollout import wire
from april_jax.rollout.async_rollout import AsyncRollout
from april_jax.rollout.channel import TO_LEARNER, TO_ROLLOUT, Channel
from april_jax.rollout.remote_weights import Offered
from april_jax.rollout.side import RolloutSide
from april_jax.runtime import user_output
from april_jax.runtime.sigterm_stop import SigtermStop
from april_jax.tasks import task as task_lib
from april_jax.settings.run import RunSettings

POLL_S = 1.0


class LearnerEnded(Exception):
  """The learner's process ended before it started the rollout, or failed."""


class RolloutServer:
  """One split run's rollout, driven by its learner's messages."""

  def __init__(self, config, workdir: str, host: str):
    """config: RunSettings, or a config file's ConfigDict (turned into them here)."""
    self.config, self.workdir = RunSettings.from_config(config), workdir
    self.host = host  # this process's address for the weights' transfers
    self.channel = Channel(send_on=TO_LEARNER, receive_on=TO_ROLLOUT)
    self.stop = SigtermStop()
    self._cut = threading.Event()  # the learner asked for a stop
    self._outbox: queue.Queue = queue.Queue()
    self.side: RolloutSide | None = None  # built by run(), which reports a failure
    self.rollout: AsyncRollout | None = None
    self._told_error = False  # the learner knows what ended the rollout
    self._told_stopping = False  # the learner knows of our SIGTERM

  def _build(self) -> None:
    c = self.config
    os.makedirs(self.workdir, exist_ok=True)
    user_output.start(self.workdir, f"user_output.{jax.process_index()}.log")
    place = sharding.Placement.from_config(c)
    model_cfg, paths = path_check.checked_model(c)
    tokenizer = task_lib.load_tokenizer(c)
    task = task_lib.make_task(c, tokenizer)
    self.side = RolloutSide(c, model_cfg, paths, None, tokenizer, task, place)

  @property
  def stopped(self) -> bool:
    """Whether a stop (SIGTERM here, or the learner's) ended the run early."""
    return self.stop.requested or self._cut.is_set()

  # ------------------------------------------------------------------------------ run
  def run(self) -> None:
    previous = signal.signal(signal.SIGTERM, self.stop.handle)
    sender = threading.Thread(target=self._send_all, name="april-rollout-tx", daemon=True)
    sender.start()
    try:
      self._build()
      self._serve()
    except LearnerEnded:
      raise
    except BaseException as e:  # pylint: disable=broad-except
      if not self._told_error:
        self._outbox.put((_error(e), None))
        self._await_close()  # leaving first would hold the learner at JAX's shutdown
      raise
    finally:
      signal.signal(signal.SIGTERM, previous)
      closers = [] if self.side is None else self.side.closers()
      for close in ([self.rollout.close] if self.rollout else []) + closers:
        try:
          close()
        except Exception as e:  # pylint: disable=broad-except
          logging.info("while closing: %s", e, exc_info=True)
      self._outbox.put(({"kind": "closed"}, None))
      self._outbox.put(None)
      sender.join(timeout=60)
      if self.side is not None:
        user_output.stop()

  def _serve(self) -> None:
    header, arrays = self._next()
    if header["kind"] == "close":  # the learner failed before it could start us
      raise LearnerEnded(
          "the learner's process ended before it started the rollout: its output says why"
      )
    self._start(header, arrays)
    while True:
      header, arrays = self._next()
      kind = header["kind"]
      if kind == "close":
        if self.rollout.error is not None:  # told already; this process ends with it too
          self._told_error = True
          raise self.rollout.error
        if header.get("failed"):
          raise LearnerEnded("the learner's process failed: its output says why")
        return
      if kind == "cut":
        self._cut.set()
      elif kind == "publish":
        offered = Offered.from_json(header["weights"])
        self.rollout.publish(
            offered,
            offered.version,
            [self._answering(rid, name) for rid, name in header["requests"]],
        )
      elif kind == "request":
        self.rollout.ask(self._answering(header["id"], header["name"]))
      else:
        raise ValueError(f"unknown message from the learner: {kind!r}")

  def _start(self, header: dict, arrays: dict) -> None:
    c, side = self.config, self.side
    side.publisher.connect(self.host, header["address"])
    side.publisher.on_pulled = lambda v: self._outbox.put(
        ({"kind": "pulled", "version": int(v), "counts": self._counts()}, None)
    )
    first = Offered.from_json(header["weights"])
    side.publisher.swap(side.engine, first, first.version)
    if header["rollout"] is not None:  # a checkpoint's (its drawn batches stay with the learner)
      side.restore(arrays, dict(header["rollout"], waiting=[]))
    side.engine.warm_up()
    if header["evaluate_first"] is not None:
      self._answering(header["evaluate_first"], "evaluate")()
    self.rollout = AsyncRollout(
        side.scheduler,
        side.publisher,
        depth=0 if c.rollout.max_staleness == 0 else 1,
        in_flight=c.rollout.in_flight_updates,
        resume_mode=c.rollout.resume_mode,
        first_batch=int(header["first_batch"]),
        version=first.version,
        cut_now=lambda: self._cut.is_set() or self.stop.cut_now(),
        deliver=self._deliver,
    )
    self.rollout.start()

  def _next(self) -> tuple[dict, dict]:
    while True:
      message = self.channel.receive(POLL_S)
      if message is not None:
        return message
      self._tell_stopping()  # a SIGTERM while the rollout waits for weights

  def _tell_stopping(self) -> None:
    """Our SIGTERM, told once: the learner stops at the end of its step."""
    if self.stop.requested and not self._told_stopping:
      self._told_stopping = True
      self._outbox.put(({"kind": "stopping"}, None))

  def _await_close(self) -> None:
    """After telling the learner of an error: its close (or its loss) ends the wait."""
    try:
      while self._next()[0]["kind"] != "close":
        pass
    except Exception:  # pylint: disable=broad-except  # the learner is gone
      pass

  # ------------------------------------------------------------------------ answers
  def _answering(self, rid: int, name: str):
    """The request's work, run on the rollout's thread: its answer goes out in order
    with the batches."""
    services = {"evaluate": self.side.evaluate, "capture": lambda: self.side.capture([])}
    if name not in services:
      raise ValueError(f"unknown request from the learner: {name!r}")

    def run():
      try:
        value = services[name]()
      except Exception as e:  # pylint: disable=broad-except
        self._outbox.put(({"kind": "answer", "id": rid, "name": name, "error": _words(e)}, None))
        raise
      arrays = None
      if name == "capture":
        value, arrays = value[1], value[0]
      self._outbox.put(({"kind": "answer", "id": rid, "name": name, "value": value}, arrays))

    return run

  def _deliver(self, result) -> None:
    if isinstance(result, BaseException):
      self._outbox.put((_error(result), None))
      return
    if result.cut:  # before the cut batch: the learner stops at its step's end
      self._tell_stopping()
    header, arrays = wire.batch_message(result)
    self._outbox.put(({"kind": "batch", **header, "counts": self._counts()}, arrays))

  def _counts(self) -> dict:
    r, p = self.rollout, self.side.publisher.stats
    return {
        "rollout_wait_s": r.waits.rollout_s if r else 0.0,
        "swaps": r.swaps if r else 0,
        "copies": p.copies,
        "bytes": p.bytes,
        "publish_s": p.seconds,
    }

  def _send_all(self) -> None:
    while (item := self._outbox.get()) is not None:
      try:
        self.channel.send(*item)
      except Exception as e:  # pylint: disable=broad-except  # the learner is gone
        logging.warning("cannot reach the learner: %s", e)
        return


def _error(error: BaseException) -> dict:
  """The message that tells the learner what ended the rollout (bad input: the user's to
  fix, said in one line there too)."""
  bad_input = isinstance(error, InputError)
  return {
      "kind": "error",
      "message": str(error) if bad_input else _words(error),
      "input": bad_input,
  }


def _words(error: BaseException) -> str:
  """An error as the learner will print it."""
  last = traceback.format_exception_only(type(error), error)[-1].strip()
  return last
