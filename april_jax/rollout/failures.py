"""A step's failures of user code, said on the console, and the rule that stops a run
whose every sample fails the same way.

A sample failed when its reward raised (or returned something that is not a score, or
ended its worker process), its reward ran past rollout.reward_timeout_s, or its episode's
environment raised or ran past env.timeout_s. Each keeps why: `reward_info["failures"]`
(reward_runner.py), `SampleRecord.env_error` (rollout/episodes.py). A step's count is over the
samples of its batch and of the groups the DAPO filter dropped.

  tally = StepFailures.of(groups)       how many, of what kind, the first message of each
  tally.line(step)                      the console's warning, or "" when nothing failed
  FailureStreak(max_failed_steps)       .see(tally, step): why the run must stop (else
                                        None) when every sample of max_failed_steps steps
                                        in a row failed for one cause, and at the first
                                        step this process runs; the trainer raises it as
                                        StepsFailed (an InputError: one line, exit 2)
"""

from __future__ import annotations

import collections
import dataclasses
import re

from april_jax.errors import InputError

# kind -> what the console calls it
KINDS = {
    "reward_error": "the reward raised",
    "reward_timeout": "the reward ran past its time limit",
    "env_error": "the environment raised",
    "env_timeout": "the environment ran past its time limit",
}
_PLACE = re.compile(r" \(([^()]*:\d+)\)$")


class StepsFailed(InputError):
  """Every sample of too many steps failed for one cause; the message names it."""


def cause(kind: str, why: str) -> tuple[str, str]:
  """What makes two failures the same: their kind, and the error's type and place (its
  text may name the sample), or the whole line when it has neither."""
  place = _PLACE.search(why)
  kind_of_error = why.split(":", 1)[0] if ":" in why else why
  return kind, f"{kind_of_error} at {place.group(1)}" if place else kind_of_error


def _env_kind(why: str) -> str:
  return "env_timeout" if "ran past" in why else "env_error"


@dataclasses.dataclass
class StepFailures:
  samples: int = 0  # samples looked at
  failed: int = 0  # samples with any failure
  kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  first: dict[str, str] = dataclasses.field(default_factory=dict)  # kind -> its first message
  causes: set = dataclasses.field(default_factory=set)

  @classmethod
  def of(cls, groups) -> "StepFailures":
    out = cls()
    for group in groups:
      failures = group.reward_info.get("failures") or [None] * group.n
      for sample, reward_failure in zip(group.samples, failures):
        out.samples += 1
        found = []
        if sample.env_error is not None:
          why = sample.env_error
          found.append((_env_kind(why), why))
        elif reward_failure is not None:
          status, why = reward_failure
          found.append((f"reward_{status}", str(why)))
        for kind, why in found:
          out.kinds[kind] += 1
          out.first.setdefault(kind, why)
          out.causes.add(cause(kind, why))
        out.failed += bool(found)
    return out

  @property
  def all_one_cause(self) -> bool:
    return self.samples > 0 and self.failed == self.samples and len(self.causes) == 1

  def line(self, step: int) -> str:
    """`step N: K of M samples failed: the reward raised for K: <first message>; ...`"""
    if not self.failed:
      return ""
    parts = [
        f"{KINDS[kind]} for {count}: {self.first[kind]}"
        for kind, count in sorted(self.kinds.items(), key=lambda kv: -kv[1])
    ]
    return f"step {step}: {self.failed} of {self.samples} samples failed: " + "; ".join(parts)


class FailureStreak:
  """Counts the steps in a row whose every sample failed for one cause."""

  def __init__(self, max_failed_steps: int):
    self.max_failed_steps = max_failed_steps
    self.streak = 0
    self.steps_seen = 0

  def see(self, tally: StepFailures, step: int) -> str | None:
    """After each step: why the run must stop, or None."""
    first = self.steps_seen == 0
    self.steps_seen += 1
    self.streak = self.streak + 1 if tally.all_one_cause else 0
    limit = self.max_failed_steps
    if not limit or not self.streak or (self.streak < limit and not first):
      return None
    (kind,) = tally.kinds
    steps = f"step {step}" if self.streak == 1 else f"steps {step - self.streak + 1}-{step}"
    return (
        f"every sample of {steps} failed the same way ({KINDS[kind]}): {tally.first[kind]}; "
        f"nothing of it was trained. Fix it and rerun the same command (a run stops when "
        f"this happens at its first step, or {limit} steps in a row: "
        f"rollout.max_failed_steps, 0 never stops)"
    )
