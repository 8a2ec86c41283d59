"""Scores complete groups in the background, while the sampler keeps decoding.

`submit(group)` queues one job per sample (the decoded response text and the group's
gold answer go to the reward function); `poll()` returns the groups whose samples are
all scored, `wait_for(groups)` / `wait_all()` block until they are. A reward function
that raises (or returns something that is not a score, or ends its process) gives that
sample `fallback` and counts an error; one that runs past `timeout_s` gives `fallback`
and counts a timeout. Each failed sample keeps why in `group.reward_info["failures"]`:
the error's line with the user's file and line (errors.describe), which the trainer
prints (rollout/failures.py).

With `processes=True` (what a run uses) each reward thread hands its job to a worker
process of its own (workers.py), and a job past its time limit has its process killed
and replaced:
a pathological answer (`\boxed{10^{10^{10}}}` makes a symbolic library compute a huge
power, holding the interpreter lock) costs at most its time limit, and nothing is left
running at the end of a run or on SIGTERM. With threads only (for in-process reward
functions, e.g. lambdas) a hung thread cannot be killed: it is abandoned, the pool is
replaced and the jobs queued behind it are resubmitted.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import pickle
import threading
import time
from typing import Any, Callable

import numpy as np

from april_jax import errors
from april_jax.runtime import workers
from april_jax.rewards import loading
from april_jax.rollout.group import Group


@dataclasses.dataclass
class _Job:
  group: Group
  index: int
  text: str
  context: dict | None = None  # the prompt, for a reward that takes the whole sample
  future: cf.Future | None = None
  started_at: float | None = None
  seconds: float = 0.0  # compute time, measured on the worker thread
  result: Any = None  # the reward; for a group-form job, a list of (reward, extras)
  extras: dict[str, float] = dataclasses.field(default_factory=dict)  # a dict reward's others
  status: str = "pending"  # pending | ok | error | timeout
  message: str | None = None  # why it failed: the error's line, with the user's file and line


def _samples(job: _Job) -> int:
  """Samples a job scores: its group's n for a group-form job, else 1."""
  return job.group.n if job.index < 0 else 1


def _per_sample(job: _Job) -> list[tuple[float, dict, str, str | None]]:
  """A settled job's (reward, extras, status, why it failed) per sample it scored."""
  if job.index >= 0:
    return [(job.result, job.extras, job.status, job.message)]
  if job.status != "ok":  # the whole group fell back
    return [(job.result, {}, job.status, job.message)] * job.group.n
  return [(value, extras, "ok", None) for value, extras in job.result]


def _episode_fields(sample) -> dict:
  """What a reward that takes the whole sample learns of its episode, if it is one."""
  if sample.episode is None:
    return {}
  return {"turns": sample.episode.turns, "env_reward": sample.episode.reward}


def _reward_server(reward_fn) -> Callable[[tuple], Any]:
  """In a worker process: the function that scores a job (text, answer, context)."""
  return lambda job: loading.score(reward_fn, *job)


class RewardRunner:

  def __init__(
      self,
      reward_fn: Callable[[str, str], float],
      decode: Callable[[list[int]], str],
      num_workers: int = 4,
      timeout_s: float = 10.0,
      fallback: float = 0.0,
      agree: Callable[[np.ndarray], np.ndarray] | None = None,
      processes: bool = True,
  ):
    """Initializes the runner.

    Args:
      reward_fn: (response text, answer) -> reward (a float, or a dict with a "score"
        and extra metrics), or a loading.UserReward.
      decode: Token ids -> text.
      num_workers: Reward threads.
      timeout_s: A reward running longer gets `fallback` (and is counted).
      fallback: The reward of a sample whose reward raised or timed out.
      agree: Makes the processes of a multi-host run agree on rewards ([groups, n]
        array -> the one to use, e.g. process 0's), since a time limit can expire on one
        process and not another. Applied at the blocking calls, which every process
        reaches at the same point. None: one process.
      processes: Score in worker processes, killed at the time limit (the default, and
        the safe one: reward_fn must be picklable, as registered rewards and UserRewards
        are). False scores on threads, whose hung jobs can only be abandoned.
    """
    if processes:
      try:  # the function itself, as the worker will receive it (nothing is unpickled here)
        pickle.dumps(reward_fn)
      except Exception as e:  # pylint: disable=broad-except
        raise TypeError(
            f"reward_fn {reward_fn!r} cannot go to a worker process ({e}): define it at "
            "module level, or pass processes=False to score on threads (where a reward "
            "that hangs cannot be stopped)"
        ) from None
    self._reward_fn, self._decode, self._agree = reward_fn, decode, agree
    self._unagreed: list[Group] = []
    self._num_workers, self.timeout_s, self.fallback = num_workers, timeout_s, fallback
    self._pool = cf.ThreadPoolExecutor(num_workers, thread_name_prefix="reward")
    self._workers = None
    if processes:
      self._workers = workers.WorkerPool(
          functools.partial(_reward_server, reward_fn),
          num_workers,
          preload=(__name__, reward_fn.__module__),
          name="reward",
      )
    self._jobs: dict[int, list[_Job]] = {}
    self._lock = threading.Lock()
    self.errors = 0
    self.timeouts = 0
    self.seconds = 0.0  # reward compute time, summed over samples

  def submit(self, group: Group) -> None:
    if group.group_id in self._jobs:
      return
    context = None
    if getattr(self._reward_fn, "takes_context", False):
      context = {
          "prompt": self._decode(group.prompt.tolist()),
          "prompt_id": group.prompt_id,
          "row": group.row,
      }
    texts = [self._decode(s.response.tolist()) for s in group.samples]
    episodes = [_episode_fields(s) for s in group.samples]
    if getattr(self._reward_fn, "form", None) == "group":  # one job scores the n together
      if context is not None and any(episodes):
        context = {**context, "episodes": episodes}
      jobs = [_Job(group, -1, texts, context)]
    else:
      jobs = [
          _Job(group, i, text, None if context is None else {**context, **episode})
          for i, (text, episode) in enumerate(zip(texts, episodes))
      ]
    self._jobs[group.group_id] = jobs
    if self._agree is not None:
      self._unagreed.append(group)
    for job in jobs:
      if job.index >= 0 and group.samples[job.index].env_error is not None:
        job.result, job.status = self.fallback, "env_error"  # counted by the episodes
        continue
      self._start(job)

  def _start(self, job: _Job) -> None:
    if self._workers is not None:
      job.future = self._pool.submit(self._score_in_process, job)
      return

    def run():
      with self._lock:
        job.started_at = time.monotonic()
      try:
        return loading.score(self._reward_fn, job.text, job.group.answer, job.context)
      except Exception as e:  # pylint: disable=broad-except
        raise workers.UserCodeError(errors.describe(e)) from None
      finally:
        job.seconds = time.monotonic() - job.started_at

    job.future = self._pool.submit(run)

  def _score_in_process(self, job: _Job) -> float:
    """On a reward thread: the job's result from a worker process, killed at the limit."""
    try:
      value, job.seconds = self._workers.call(
          (job.text, job.group.answer, job.context), self.timeout_s
      )
    except workers.CallTimeout:
      job.seconds = self.timeout_s
      raise
    return value

  def _settle(self, job: _Job, now: float) -> bool:
    """Moves a job to a final status if it has one; True when settled."""
    if job.status != "pending":
      return True
    if job.future.done() and not job.future.cancelled():
      try:
        out = job.future.result()
        if job.index < 0:  # a group's list of (reward, extras)
          job.result, job.status = out, "ok"
        else:
          (job.result, job.extras), job.status = out, "ok"
      except workers.CallTimeout:  # its worker was killed at the limit
        self._time_out(job)
      except Exception as e:  # pylint: disable=broad-except
        job.result, job.status, job.message = self.fallback, "error", str(e) or type(e).__name__
        self.errors += _samples(job)
      self.seconds += job.seconds
      return True
    if self._workers is not None:
      return False  # its thread comes back by itself at the limit
    with self._lock:
      started = job.started_at
    if started is not None and now - started > self.timeout_s:
      self._time_out(job)
      self.seconds += now - started
      self._replace_pool()  # a thread cannot be stopped: abandoned
      return True
    return False

  def _time_out(self, job: _Job) -> None:
    job.result, job.status = self.fallback, "timeout"
    job.message = f"ran past rollout.reward_timeout_s={self.timeout_s:g} s"
    self.timeouts += _samples(job)

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
        # (reward, extras, status, why it failed) per sample
        results = [r for job in jobs for r in _per_sample(job)]
        results = [  # an episode whose environment failed gets the fallback, whatever the form
            (self.fallback, {}, "env_error", None) if s.env_error is not None else r
            for r, s in zip(results, group.samples)
        ]
        group.rewards = [value for value, _, _, _ in results]
        statuses = [status for _, _, status, _ in results]
        group.reward_info = {
            "errors": statuses.count("error"),
            "timeouts": statuses.count("timeout"),
        }
        if "error" in statuses or "timeout" in statuses:  # [status, why] per failed sample
          group.reward_info["failures"] = [
              [status, why] if status in ("error", "timeout") else None
              for _, _, status, why in results
          ]
        extras = sorted({k for _, e, _, _ in results for k in e})
        if extras:  # a dict reward's other numbers, per sample (NaN where one lacks it)
          group.reward_info["metrics"] = {
              k: [e.get(k, float("nan")) for _, e, _, _ in results] for k in extras
          }
        del self._jobs[group_id]
        done.append(group)
    return done

  def wait_for(
      self, groups: list[Group], poll_s: float = 0.002, give_up: Callable[[], bool] | None = None
  ) -> list[Group] | None:
    """Blocks until every group given is scored; returns them in the order given. None
    if `give_up()` said to stop waiting first (some may not be scored)."""
    while any(g.group_id in self._jobs for g in groups):
      self.poll()
      if any(g.group_id in self._jobs for g in groups):
        if give_up is not None and give_up():
          return None
        time.sleep(poll_s)
    self._settle_agreement(groups)
    return list(groups)

  def drop_unscored(self) -> None:
    """Forgets every group not yet scored (its rewards stay None: a later submit scores it
    again); their calls still running end at their time limit, or at close()."""
    for jobs in self._jobs.values():
      for job in jobs:
        if job.future is not None:
          job.future.cancel()
    self._unagreed = [g for g in self._unagreed if g.group_id not in self._jobs]
    self._jobs.clear()

  def wait_all(self, poll_s: float = 0.002, give_up: Callable[[], bool] | None = None) -> bool:
    """Blocks until every group submitted is scored (True), or `give_up()` says to stop
    waiting (False)."""
    while self._jobs:
      self.poll()
      if self._jobs:
        if give_up is not None and give_up():
          return False
        time.sleep(poll_s)
    self._settle_agreement(self._unagreed)
    return True

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

  def worker_pids(self) -> list[int]:
    """The live reward worker processes (none when scoring on threads)."""
    return [] if self._workers is None else self._workers.pids()
