"""Reward functions by name, so a config can say `reward: math` and the trainer finds it.

A reward function scores one finished sample:

    fn(response: str, answer: str) -> float

`response` is the model's decoded response text, `answer` the gold answer string from
the dataset. Modules register their rewards with `@register("name")` when imported;
`april_jax.rewards` imports them all.
"""

from __future__ import annotations

from typing import Callable

RewardFn = Callable[[str, str], float]

REWARDS: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
  """Decorator: adds `fn` to REWARDS under `name`; a name already taken is a ValueError."""
  def add(fn: RewardFn) -> RewardFn:
    if name in REWARDS:
      raise ValueError(f"reward {name!r} is already registered (by {REWARDS[name].__module__})")
    REWARDS[name] = fn
    return fn
  return add


def get_reward(name: str) -> RewardFn:
  """The reward registered under `name`; KeyError naming the known rewards otherwise."""
  if name not in REWARDS:
    raise KeyError(f"unknown reward {name!r}; known rewards: {sorted(REWARDS)}")
  return REWARDS[name]
