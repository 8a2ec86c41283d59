"""The multi-turn environment interface, and how `env.name` names one.

An environment plays one side of each sample's episode. One env object serves every
episode: what an episode remembers is its `state`, a JSON value that the env returns and
gets back, so an episode rides in the partial buffer and in checkpoints as plain data
and resumes after a cut, a preemption or a restart of the run:

    class MyEnv:
      def reset(self, row: dict):                      # -> the episode's first state
        return {"calls": 0}                            #    (or an EnvReset)
      def step(self, state, turn: str) -> EnvStep:     # after each turn of the model
        return EnvStep(observation="42", done=False, state={"calls": state["calls"] + 1})

`row` is the dataset row (its columns as JSON values, and "answer"). `reset` returns the
first state, or an `EnvReset(state, messages)`: with messages (chat messages,
[{"role": "system", "content": ...}, {"role": "user", ...}]) the episode opens with them,
rendered by the chat template, instead of the row's prompt (a system prompt with a tool
schema, the task rewritten); without, the row's prompt, as for any sample. `turn` is
the text the model wrote since the last observation (its stop token decoded). An
`EnvStep` gives the observation text (shown to the model in the observation template:
the chat template's tool role), `done`, an optional reward (kept with the sample as
"env_reward" for the reward function) and the new state.

`env.name` (the config's env section) names an environment: a registered name ("calculator", "lookup"), or a
user's class or factory, "path/to/env.py:MyEnv" or "package.module:MyEnv", called with no
arguments. `load` checks it at start-up: a missing file or name, an import that fails, or
an object without reset and step is one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

from april_jax.rewards import loading


@dataclasses.dataclass(frozen=True)
class EnvStep:
  # Shown to the model when the episode goes on: one tool result, or a list of them (one
  # tool message each, e.g. one per call of the turn); None ends the episode.
  observation: str | list[str] | None
  done: bool
  state: Any = None  # the episode's new state (JSON)
  reward: float | None = None  # optional; the last one given is the sample's env_reward


@dataclasses.dataclass(frozen=True)
class EnvReset:
  state: Any = None  # the episode's first state (JSON)
  messages: list[dict] | None = None  # the episode's first messages (None: the row's prompt)
  tools: list[dict] | None = None  # function schemas the chat template shows with messages


class Env(Protocol):

  def reset(self, row: dict) -> Any:  # the first state, or an EnvReset
    ...

  def step(self, state: Any, turn: str) -> EnvStep:
    ...


ENVS: dict[str, Callable[..., Env]] = {}
# The env config fields a registered environment's factory takes, as keywords.
OPTIONS: dict[str, tuple[str, ...]] = {}


def register(name: str, options: tuple[str, ...] = ()):
  """Registers a factory under `name`; `options` names the env config fields (e.g.
  "isolation") that `load` passes it as keywords."""

  def wrap(factory):
    ENVS[name] = factory
    OPTIONS[name] = tuple(options)
    return factory

  return wrap


class EnvError(ValueError):
  """`env.name` cannot be used; the message says why, in one line."""


def load(spec: str, options: dict[str, Any] | None = None) -> Env:
  """The environment `spec` names, made once (EnvError otherwise). A registered one gets
  the `options` it registered for; a user's is called with no arguments."""
  kwargs = {}
  if spec in ENVS:
    factory = ENVS[spec]
    kwargs = {name: (options or {})[name] for name in OPTIONS[spec] if name in (options or {})}
  elif loading.is_user_spec(spec):
    target, _, name = spec.rpartition(":")
    try:
      module = loading._load_module(target)  # pylint: disable=protected-access
    except Exception as e:  # pylint: disable=broad-except
      raise EnvError(f"env.name={spec!r}: {type(e).__name__}: {e}") from None
    factory = getattr(module, name, None)
    if factory is None:
      raise EnvError(f"env.name={spec!r}: {target} has no {name!r}")
    if not callable(factory):
      raise EnvError(
          f"env.name={spec!r}: {name} is a {type(factory).__name__}, not a class or a factory"
      )
  else:
    raise EnvError(
        f"env.name={spec!r} is neither a registered environment ({sorted(ENVS)}) "
        "nor 'path/to/file.py:Name' / 'package.module:Name'"
    )
  try:
    env = factory(**kwargs)
  except EnvError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise EnvError(f"env.name={spec!r}: making it raised {type(e).__name__}: {e}") from None
  missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
  if missing:
    raise EnvError(f"env.name={spec!r}: {type(env).__name__} has no {' or '.join(missing)}")
  return env
