"""A reward that never returns in time, for tests: `\\boxed{10^{10^{10}}}` makes the math
library compute 10**(10**10), holding the interpreter lock for hours."""

from april_jax.rewards.math import math_reward
from april_jax.rewards.registry import register


@register("runaway_for_tests")
def runaway(response: str, answer: str) -> float:
  del response, answer
  return math_reward("\\boxed{10^{10^{10}}}", "\\boxed{7}")
