"""Whether a decode call speculates (rollout.speculative_auto): whichever of speculating
and plain decoding has drawn more tokens per second per live slot, at about this many
live slots, on the calls so far.

A verify pass costs more than a decode step (K + 1 positions a slot, and logits at each),
and yields 1 to K + 1 tokens a slot depending on how many drafts are right. Which wins
depends on the live slots (few: a step reads the weights for a handful of tokens, and
extra positions cost little; many: the step is compute-bound, and they cost their share)
and on the acceptance, which drifts as the policy trains. So both are measured as they
run: each call's tokens over its seconds over its live slots, averaged per mode and per
power-of-two count of live slots (an exponential average, recent calls weighing most),
and each count tries the mode it does not choose every `probe_every` calls. The choice
changes how fast tokens come, never which: both draw each token with its own key.
"""

from __future__ import annotations


def live_bucket(live: int) -> int:
  """The power of two at or above `live` (1 for 0): the counts that share a measure."""
  return 1 << max(live - 1, 0).bit_length()


class SpeculationChoice:
  """Per decode call: speculate or not (choose), then what the call did (record)."""

  def __init__(self, probe_every: int = 16, decay: float = 0.7):
    if probe_every < 2 or not 0.0 <= decay < 1.0:
      raise ValueError(f"probe_every must be >= 2 and decay in [0, 1), got {probe_every}, {decay}")
    self.probe_every, self.decay = probe_every, decay
    self.rates: dict[tuple[int, bool], float] = {}  # (live bucket, speculated) -> rate
    self._calls: dict[int, int] = {}  # live bucket -> calls chosen

  def choose(self, live: int) -> bool:
    """Whether the next call, with `live` slots decoding, speculates: an unmeasured mode
    first (speculation first), then the faster, the other every probe_every-th call."""
    b = live_bucket(live)
    n = self._calls.get(b, 0)
    self._calls[b] = n + 1
    spec, plain = self.rates.get((b, True)), self.rates.get((b, False))
    if spec is None or plain is None:
      return spec is None
    faster = spec >= plain
    return (not faster) if n % self.probe_every == self.probe_every - 1 else faster

  def record(self, live: int, speculated: bool, tokens: int, seconds: float) -> None:
    """A call's measure: `tokens` drawn by `live` slots in `seconds`."""
    rate = tokens / max(seconds, 1e-9) / max(live, 1)
    key = (live_bucket(live), speculated)
    old = self.rates.get(key)
    self.rates[key] = rate if old is None else self.decay * old + (1 - self.decay) * rate
