"""What a multi-turn episode keeps beside its sample (SampleRecord.episode), as JSON.

The runner (episodes.py) writes it at each turn; a checkpoint holds it as it is, so an
episode cut, preempted or checkpointed goes on where it stood.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Episode:
  """A multi-turn episode's state beside its sample (rollout/episodes.py), as JSON."""

  state: Any = None  # the environment's state (JSON)
  turns: int = 0  # model turns ended so far
  # [[start, end], ...]: the observations' token spans in the response; given, not
  # drawn: logprob 0, outside the loss (rl/batch.py)
  observations: list[list[int]] = dataclasses.field(default_factory=list)
  reward: float | None = None  # the last reward the environment gave, if any
  error: str | None = None  # why the environment ended the episode early

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "Episode":
    return cls(**d)
