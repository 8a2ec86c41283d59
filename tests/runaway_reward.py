"""A reward that never returns in time, for tests: a sum over a range of 10^15 integers
runs in C, holding the interpreter lock, in constant memory, for days."""

from april_jax.rewards.registry import register


@register("runaway_for_tests")
def runaway(response: str, answer: str) -> float:
  del response, answer
  return float(sum(range(10**15)))
