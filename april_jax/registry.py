"""A name -> function table filled by a decorator: rewards, advantage estimators, losses.

REWARDS = Registry("reward")
@REWARDS.register("math")
def math_reward(response, answer): ...
REWARDS.lookup("math")   # KeyError listing the known names when unknown
"""

from __future__ import annotations

from typing import Callable, TypeVar

Fn = TypeVar("Fn", bound=Callable)


class Registry(dict):

  def __init__(self, kind: str):
    super().__init__()
    self.kind = kind

  def register(self, name: str) -> Callable[[Fn], Fn]:
    """Decorator: adds the function under `name`; a name already taken is a ValueError."""

    def add(fn: Fn) -> Fn:
      if name in self:
        raise ValueError(
            f"{self.kind} {name!r} is already registered (by " f"{self[name].__module__})"
        )
      self[name] = fn
      return fn

    return add

  def lookup(self, name: str) -> Callable:
    """The function registered under `name`; KeyError naming the known ones otherwise."""
    if name not in self:
      raise KeyError(f"unknown {self.kind} {name!r}; known: {sorted(self)}")
    return self[name]
