"""Reward functions by name, so a config can say `reward: math` and the trainer finds it.

A reward function scores one finished sample:

    fn(response: str, answer: str) -> float

`response` is the model's decoded response text, `answer` the gold answer string from
the dataset. Modules register their rewards with `@register("name")` when imported;
`april_jax.rewards` imports them all.
"""

from __future__ import annotations

from typing import Callable

from april_jax.registry import Registry

RewardFn = Callable[[str, str], float]

REWARDS = Registry("reward")
register = REWARDS.register
get_reward = REWARDS.lookup
