"""A split run's async/* metrics: each side's waits and the weights' copies, as counts
since the last step (docs/metrics.md)."""

from __future__ import annotations


class StepCounts:
  """The running totals of a split rollout, turned into each step's increments."""

  def __init__(self):
    self._last: dict[str, float] = {}

  def since_last(self, waits, swaps: int, publish_stats) -> dict[str, float]:
    """waits: rollout/async_rollout.py's Waits; swaps: weight sets taken; publish_stats:
    rollout/publish.py's PublishStats (all running totals)."""
    now = {
        "async/rollout_wait_s": waits.rollout_s,
        "async/learner_wait_s": waits.learner_s,
        "async/publish_s": publish_stats.seconds,
        "async/publish_bytes": float(publish_stats.bytes),
        "async/weight_swaps": float(swaps),
    }
    last, self._last = self._last, now
    return {k: v - last.get(k, 0.0) for k, v in now.items()}
