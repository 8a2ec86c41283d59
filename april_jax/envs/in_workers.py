"""A user's environment runs in worker processes, where a call past env.timeout_s is ended.

A user's environment is Python the run does not control: a `step` that computes
`10**(10**10)` holds the interpreter lock, and in a thread it would stall decoding and
outlive the run. So `load` serves a user's environment ("path/to/env.py:MyEnv",
"package.module:MyEnv") from worker processes (workers.py): each worker makes the
environment once, and each call runs under the time limit; one past it has its worker
killed and replaced, and raises TimeoutError, as the episode runner expects. The
registered environments (calculator, lookup) are the project's own bounded code and
stay in the trainer.

A `ProcessEnv` has the environment's own `reset` and `step`; what crosses the pipe is
plain data (the row, the state, the turn's text, and back an EnvStep's or EnvReset's
fields).
"""

from __future__ import annotations

import functools
from typing import Any

from april_jax.runtime import workers
from april_jax.envs import base
from april_jax.envs.base import Env, EnvError, EnvReset, EnvStep
from april_jax.rewards import loading


def _env_server(spec: str):
  """In a worker: makes the environment once; serves (method, args) calls."""
  env = base.load(spec)

  def serve(job):
    method, args = job
    if method == "ready":
      return True
    out = getattr(env, method)(*args)
    if method == "step":
      if not isinstance(out, EnvStep):
        raise TypeError(f"step returned a {type(out).__name__}, not an EnvStep")
      return (out.observation, out.done, out.state, out.reward)
    if method == "reset" and isinstance(out, EnvReset):
      return ("EnvReset", out.state, out.messages, out.tools)
    return ("state", out)

  return serve


class ProcessEnv:
  """`spec`'s environment served by `num` worker processes; the episode runner makes as
  many calls at once."""

  in_workers = True  # the episode runner calls it directly: its own time limit ends calls

  def __init__(self, spec: str, timeout_s: float, num: int = 1):
    self.spec, self.timeout_s, self.num = spec, timeout_s, num
    self._pool = workers.WorkerPool(
        functools.partial(_env_server, spec), num, preload=(__name__,), name="environment"
    )
    try:  # a file, name or factory that fails is one line at start-up
      self._pool.call(("ready", ()), max(timeout_s, 60.0))
    except (workers.UserCodeError, workers.WorkerDied, workers.CallTimeout) as e:
      self.close()
      raise EnvError(str(e).removeprefix("EnvError: ")) from None

  def _call(self, method: str, *args) -> Any:
    try:
      return self._pool.call((method, args), self.timeout_s)[0]
    except workers.CallTimeout:
      raise TimeoutError(f"{method} ran past env.timeout_s={self.timeout_s:g} s") from None

  def reset(self, row: dict) -> Any:
    kind, *out = self._call("reset", row)
    return EnvReset(*out) if kind == "EnvReset" else out[0]

  def step(self, state: Any, turn: str) -> EnvStep:
    observation, done, state, reward = self._call("step", state, turn)
    return EnvStep(observation=observation, done=done, state=state, reward=reward)

  def pids(self) -> list[int]:
    return self._pool.pids()

  def close(self) -> None:
    self._pool.close()


def load(
    spec: str, timeout_s: float, workers: int = 1, options: dict[str, Any] | None = None
) -> Env:
  """The environment `spec` names: a registered one in this process (given the `options`
  it takes), a user's in `workers` worker processes (EnvError, one line, if it cannot be
  made)."""
  if loading.is_user_spec(spec) and spec not in base.ENVS:
    return ProcessEnv(spec, timeout_s, workers)
  return base.load(spec, options)
