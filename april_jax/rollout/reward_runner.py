"""Scores complete groups in the background, while the sampler keeps decoding.

`submit(group)` queues one job per sample (the decoded response text and the group's
gold answer go to the reward function); `poll()` returns the groups whose samples are
all scored, `wait_for(groups)` / `wait_all()` block until they are. A reward function
that raises gives that sample `fallback` and counts an error; one that runs past
`timeout_s` gives `fallback` and counts a timeout.

With `processes=True` (what a run uses) each reward thread hands its job to a worker
process of its own, and a job past its time limit has its process killed and replaced:
a pathological answer (`\boxed{10^{10^{10}}}` makes a symbolic library compute a huge
power, holding the interpreter lock) costs at most its time limit, and nothing is left
running at the end of a run or on SIGTERM. With threads only (for in-process reward
functions, e.g. lambdas) a hung thread cannot be killed: it is abandoned, the pool is
replaced and the jobs queued behind it are resubmitted.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing
import queue
import threading
import time
from typing import Callable

import numpy as np

from april_jax.rollout.group import Group


@dataclasses.dataclass
class _Job:
  group: Group
  index: int
  text: str
  future: cf.Future | None = None
  started_at: float | None = None
  seconds: float = 0.0  # compute time, measured on the worker thread
  result: float | None = None
  status: str = "pending"  # pending | ok | error | timeout
  worker: multiprocessing.Process | None = None  # the process scoring it, while it does
  killed: bool = False


class _Killed(Exception):
  """A job whose worker process was killed at its time limit."""


def _serve(conn, reward_fn) -> None:
  """A worker process: scores (text, answer) jobs until told to stop or its pipe closes."""
  while True:
    try:
      job = conn.recv()
    except (EOFError, OSError):
      return
    if job is None:
      return
    start = time.monotonic()
    try:
      out = (True, float(reward_fn(*job)))
    except Exception as e:  # pylint: disable=broad-except
      out = (False, f"{type(e).__name__}: {e}"[:500])
    conn.send(out + (time.monotonic() - start,))


class _WorkerProcesses:
  """One worker process per reward thread, forked from a server that has already imported
  the worker's and the reward function's modules (so a replacement starts at once)."""

  def __init__(self, reward_fn: Callable[[str, str], float], num: int):
    self._ctx = multiprocessing.get_context("forkserver")
    # This module (the worker's code) and the reward's, imported once in the server.
    self._ctx.set_forkserver_preload([__name__, reward_fn.__module__])
    self._reward_fn = reward_fn
    self._lock = threading.Lock()
    self._idle = queue.Queue()
    self._all: list[multiprocessing.Process] = []
    self._closed = False
    for _ in range(num):
      self._replace()

  def _replace(self) -> None:
    """Starts a worker and makes it idle; after close(), wakes a waiting thread instead."""
    with self._lock:
      if self._closed:
        self._idle.put(None)
        return
      parent, child = self._ctx.Pipe()
      process = self._ctx.Process(target=_serve, args=(child, self._reward_fn), daemon=True)
      process.start()
      child.close()
      self._all.append(process)
    self._idle.put((process, parent))

  def score(self, job: _Job, answer: str) -> tuple[float, float]:
    """On a reward thread: (reward, seconds) from a worker; raises _Killed if the job's
    worker was killed, RuntimeError if the reward raised."""
    worker = self._idle.get()
    if worker is None:  # closed
      self._idle.put(None)
      raise _Killed()
    process, conn = worker
    with self._lock:
      job.worker = process
      job.started_at = time.monotonic()
    try:
      conn.send((job.text, answer))
      ok, value, seconds = conn.recv()
    except (EOFError, OSError):
      ok = None
    with self._lock:
      job.worker, killed = None, job.killed
    if killed or ok is None:
      process.join(timeout=5)
      conn.close()
      self._replace()
      raise _Killed()
    self._idle.put((process, conn))
    if not ok:
      raise RuntimeError(value)
    return value, seconds

  def kill(self, job: _Job) -> None:
    """Kills the process scoring `job`, if one still is."""
    with self._lock:
      job.killed = True
      if job.worker is not None:
        job.worker.kill()

  def close(self) -> None:
    """Kills every worker; threads waiting for one are woken (and score nothing)."""
    with self._lock:
      self._closed = True
      processes = list(self._all)
    self._idle.put(None)
    for process in processes:
      if process.is_alive():
        process.kill()
    for process in processes:
      process.join(timeout=5)


class RewardRunner:

  def __init__(
      self,
      reward_fn: Callable[[str, str], float],
      decode: Callable[[list[int]], str],
      num_workers: int = 4,
      timeout_s: float = 10.0,
      fallback: float = 0.0,
      agree: Callable[[np.ndarray], np.ndarray] | None = None,
      processes: bool = False,
  ):
    """Initializes the runner.

    Args:
      reward_fn: (response text, answer) -> reward.
      decode: Token ids -> text.
      num_workers: Reward threads.
      timeout_s: A reward running longer gets `fallback` (and is counted).
      fallback: The reward of a sample whose reward raised or timed out.
      agree: Makes the processes of a multi-host run agree on rewards ([groups, n]
        array -> the one to use, e.g. process 0's), since a time limit can expire on one
        process and not another. Applied at the blocking calls, which every process
        reaches at the same point. None: one process.
      processes: Score in worker processes, killed at the time limit (reward_fn must be
        a module-level function, as registered rewards are); else on threads.
    """
    self._reward_fn, self._decode, self._agree = reward_fn, decode, agree
    self._unagreed: list[Group] = []
    self._num_workers, self.timeout_s, self.fallback = num_workers, timeout_s, fallback
    self._pool = cf.ThreadPoolExecutor(num_workers, thread_name_prefix="reward")
    self._workers = _WorkerProcesses(reward_fn, num_workers) if processes else None
    self._jobs: dict[int, list[_Job]] = {}
    self._lock = threading.Lock()
    self.errors = 0
    self.timeouts = 0
    self.seconds = 0.0  # reward compute time, summed over samples

  def submit(self, group: Group) -> None:
    if group.group_id in self._jobs:
      return
    jobs = [_Job(group, i, self._decode(s.response.tolist())) for i, s in enumerate(group.samples)]
    self._jobs[group.group_id] = jobs
    if self._agree is not None:
      self._unagreed.append(group)
    for job in jobs:
      self._start(job)

  def _start(self, job: _Job) -> None:
    if self._workers is not None:
      job.future = self._pool.submit(self._score_in_process, job)
      return

    def run():
      with self._lock:
        job.started_at = time.monotonic()
      try:
        return float(self._reward_fn(job.text, job.group.answer))
      finally:
        job.seconds = time.monotonic() - job.started_at

    job.future = self._pool.submit(run)

  def _score_in_process(self, job: _Job) -> float:
    value, job.seconds = self._workers.score(job, job.group.answer)
    return value

  def _settle(self, job: _Job, now: float) -> bool:
    """Moves a job to a final status if it has one; True when settled."""
    if job.status != "pending":
      return True
    if job.future.done() and not job.future.cancelled():
      try:
        job.result, job.status = job.future.result(), "ok"
      except Exception:  # pylint: disable=broad-except
        job.result, job.status = self.fallback, "error"
        self.errors += 1
      self.seconds += job.seconds
      return True
    with self._lock:
      started = job.started_at
    if started is not None and now - started > self.timeout_s:
      job.result, job.status = self.fallback, "timeout"
      self.timeouts += 1
      self.seconds += now - started
      if self._workers is not None:
        self._workers.kill(job)  # its thread comes back at once
      else:
        self._replace_pool()
      return True
    return False

  def _replace_pool(self) -> None:
    """Abandons the pool holding a hung job; resubmits what had not started."""
    old = self._pool
    self._pool = cf.ThreadPoolExecutor(self._num_workers, thread_name_prefix="reward")
    old.shutdown(wait=False, cancel_futures=True)
    for jobs in self._jobs.values():
      for job in jobs:
        if job.status == "pending" and job.future.cancelled():
          self._start(job)

  def poll(self) -> list[Group]:
    """Groups whose every sample is scored (rewards and reward_info set), in submit order."""
    now = time.monotonic()
    done = []
    for group_id, jobs in list(self._jobs.items()):
      if all([self._settle(job, now) for job in jobs]):
        group = jobs[0].group
        group.rewards = [job.result for job in jobs]
        group.reward_info = {
            "errors": sum(j.status == "error" for j in jobs),
            "timeouts": sum(j.status == "timeout" for j in jobs),
        }
        del self._jobs[group_id]
        done.append(group)
    return done

  def wait_for(self, groups: list[Group], poll_s: float = 0.002) -> list[Group]:
    """Blocks until every group given is scored; returns them in the order given."""
    while any(g.group_id in self._jobs for g in groups):
      self.poll()
      time.sleep(poll_s)
    self._settle_agreement(groups)
    return list(groups)

  def wait_all(self, poll_s: float = 0.002) -> None:
    while self._jobs:
      self.poll()
      time.sleep(poll_s)
    self._settle_agreement(self._unagreed)

  def _settle_agreement(self, groups: list[Group]) -> None:
    """Replaces the rewards of these scored groups with the agreed ones (multi-host)."""
    if self._agree is None:
      return
    pending = {id(u) for u in self._unagreed}
    groups = [g for g in groups if id(g) in pending]
    settled = {id(g) for g in groups}
    self._unagreed = [u for u in self._unagreed if id(u) not in settled]
    if not groups:
      return
    agreed = self._agree(np.array([g.rewards for g in groups], np.float64))
    for group, rewards in zip(groups, agreed):
      group.rewards = [float(r) for r in rewards]

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)
    if self._workers is not None:
      self._workers.close()
