"""The rollout scheduler's settings (`RolloutSettings`) and their rules.

The fields are the run config's `rollout.*` of the same names (settings/base.py); the
rules are written once, here (`problems`), and settings/validate.py reports them for a
run's config under those names.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  batch_size: int  # N: groups trained per step
  n_samples_per_prompt: int  # n
  over_sampling_batch_size: int  # N' >= N: groups admitted per step
  partial_rollout: bool = True
  resume_mode: str = "kv"  # kv | recompute
  max_staleness: int | None = None  # versions; None: unlimited
  max_response_len: int = 256
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal
  # Drops per step; past it the filter keeps what comes, so a step always ends (a data
  # set the policy always fails or always solves would otherwise never fill a batch).
  max_dropped_groups: int = 64

  def __post_init__(self):
    found = problems(dataclasses.asdict(self))
    if found:
      raise ValueError("; ".join(found))

  @classmethod
  def from_config(cls, rollout) -> "RolloutSettings":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in dict(rollout).items() if k in names})


def problems(fields: dict, prefix: str = "") -> list[str]:
  """What is wrong with these settings, each naming its field (prefix + name)."""
  n, N = fields["over_sampling_batch_size"], fields["batch_size"]
  if n < N:
    return [f"{prefix}over_sampling_batch_size ({n}) must be >= {prefix}batch_size ({N})"]
  if not fields.get("partial_rollout", True) and n != N:
    # A baseline that over-samples either trains surplus groups a step late (off-policy)
    # or throws finished work away; it admits exactly what it trains instead.
    return [
        f"{prefix}partial_rollout=False is the synchronous baseline, which admits exactly "
        f"the groups it trains: set {prefix}over_sampling_batch_size={N} (= "
        f"{prefix}batch_size), not {n} (over_sampling_batch_size == batch_size)"
    ]
  return []
