"""A prompt group: one prompt, its n samples, their rewards, and where it stands.

A group is the unit APRIL admits, buffers and trains. Its samples are SampleRecords
(april_jax.sampler) in one of the seven states of records.Status:
  waiting           never started, in no slot
  live              in a slot, decoding (owned by the engine while the step runs)
  held              in a slot, stopped at a turn's end while its environment answers
  kept              in no slot, its KV kept in the pool's pages (snapshot with keep)
  partial           snapshotted unfinished: tokens, logprobs, versions (+ KV on the host)
  finished          stop token or budget reached
  rejected          it cannot run (its error says why)
The group is complete when all n samples are finished; its rewards are computed once,
as soon as it completes. Nothing in a group is ever dropped except by an explicit,
counted decision (the DAPO filter, a staleness restart).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from april_jax.sampler import SampleRecord, sample_keys


@dataclasses.dataclass
class Group:
  group_id: int  # order of first admission: the buffer is FIFO by it
  prompt_id: Any  # the dataset's id of the prompt
  prompt: np.ndarray  # int32 [P]
  answer: str  # gold answer, handed to the reward function
  samples: list[SampleRecord]
  first_step: int  # the step that first admitted the group
  rewards: list[float] | None = None  # set once, when the group completes
  reward_info: dict[str, Any] = dataclasses.field(default_factory=dict)
  row: dict[str, Any] = dataclasses.field(default_factory=dict)  # the dataset row (JSON)

  @property
  def n(self) -> int:
    return len(self.samples)

  @property
  def complete(self) -> bool:
    return all(s.finished for s in self.samples)

  @property
  def scored(self) -> bool:
    return self.rewards is not None

  def rewards_all_equal(self) -> bool:
    return self.scored and len(set(self.rewards)) <= 1

  def host_bytes(self) -> int:
    return self.prompt.nbytes + sum(s.host_bytes() for s in self.samples)

  def restart_sample(self, index: int) -> None:
    """Discards a sample's tokens so it starts again from the prompt, with a fresh key
    derived from its old one (a restart does not regrow the same response)."""
    old = self.samples[index]
    # A new, uncut sample, on no shard yet; an episode starts over (rollout/episodes.py).
    restarts = old.restarts + 1
    rng = sample_keys([int(x) for x in old.rng] + [restarts], 1)[0]
    self.samples[index] = SampleRecord(
        prompt=old.prompt,
        max_new_tokens=old.max_new_tokens,
        rng=rng,
        temperature=old.temperature,
        top_k=old.top_k,
        top_p=old.top_p,
        group_id=old.group_id,
        index=old.index,
        restarts=restarts,
    )
    self.rewards = None
    self.reward_info = {}
