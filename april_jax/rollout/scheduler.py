"""The APRIL rollout scheduler: one RL step of generation, as DESIGN.md describes it.

  1. Admit   free slots take, in order: samples of groups already admitted this step
             (partials first: prioritized resumption), then a new group: the oldest in
             the partial buffer, else a fresh prompt. A group's fresh samples started
             together share one prefill. Admission stops at over_sampling_batch_size
             groups per step (buffered ones included), plus one per group the DAPO
             filter rejects, so rejections do not shrink the batch.
  2. Decode  engine.step(): up to sync_every tokens per live slot, on device.
  3. Harvest a group whose n samples are all finished is accepted in completion order
             and scored at once on the reward threads, which overlap with decoding. With
             dynamic_sampling the filter needs the rewards: the scheduler waits for the
             groups completed so far before deciding (counted, removed), so a run is
             deterministic for a seed whatever the reward threads' timing.
  4. Stop    partial_rollout=True: as soon as batch_size groups are accepted.
             partial_rollout=False (the synchronous baseline, N' = N): once every
             admitted group is complete and batch_size are accepted. It admits only
             what it trains (plus one per DAPO rejection), so every trained token was
             drawn in this step by the current params: on-policy.
  5. Snapshot every unfinished slot goes back to its group on the host (with its KV in
             resume mode kv). The groups not trained stay in the buffer, whole.

Staleness (max_staleness >= 0): a token's version tag is the oldest policy version its
forward pass saw (sampler/state.py), so a sample's staleness is `version` minus its
oldest tag: in resume mode kv, the version it started at (AReaL's measure); in mode
recompute, that of its oldest token. At admission, each sample (partial or finished)
staler than max_staleness is restarted from its prompt with a fresh key (counted as
stale_restarts); its siblings within the limit are kept. The group is then overdue:
  - the stop rule also waits until every overdue group is complete (the other slots
    keep decoding meanwhile; what they finish is surplus for the next step), and
  - the batch takes overdue groups first, oldest first.
A restart is never cut: it finishes in the step it restarts, at the current version.
The oldest overdue group always trains in its step, so no prompt restarts forever; no
trained token is staler than max_staleness, and the prompt itself is never lost.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable

import numpy as np

from april_jax.rollout.buffer import PartialBuffer
from april_jax.rollout.group import Group
from april_jax.rollout.reward_runner import RewardRunner
from april_jax.sampler import PromptError, SampleRecord, SlotEngine, sample_keys


@dataclasses.dataclass
class PromptItem:
  prompt_id: Any
  tokens: np.ndarray                     # int32 [P]
  answer: str
  budgets: list[int] | None = None       # per-sample response budgets (default: config)


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  batch_size: int                        # N: groups trained per step
  n_samples_per_prompt: int              # n
  over_sampling_batch_size: int          # N' >= N: groups admitted per step
  partial_rollout: bool = True
  resume_mode: str = "kv"                # kv | recompute
  max_staleness: int = -1                # versions; < 0: unlimited
  max_response_len: int = 256
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  dynamic_sampling: bool = False         # DAPO: drop groups whose rewards are all equal

  @classmethod
  def from_config(cls, rollout) -> "RolloutSettings":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in dict(rollout).items() if k in names})


@dataclasses.dataclass
class RolloutResult:
  groups: list[Group]                    # the training batch: batch_size groups
  rejected: list[Group]                  # dropped by the DAPO filter this step
  stats: dict[str, float]                # counts and timings of this step (see metrics.py)


class AprilScheduler:
  """Drives a SlotEngine through RL steps; owns the partial buffer."""

  def __init__(self, engine: SlotEngine, settings: RolloutSettings,
               prompt_source: Callable[[], PromptItem | None], rewards: RewardRunner,
               seed: int = 0):
    if settings.over_sampling_batch_size < settings.batch_size:
      raise ValueError("over_sampling_batch_size must be >= batch_size")
    if not settings.partial_rollout and settings.over_sampling_batch_size != settings.batch_size:
      # A baseline that over-samples either trains surplus groups a step late (off-policy)
      # or throws finished work away; it admits exactly what it trains instead.
      raise ValueError("the synchronous baseline (partial_rollout=False) needs "
                       "over_sampling_batch_size == batch_size")
    self.engine, self.settings, self.rewards = engine, settings, rewards
    self._prompt_source = prompt_source
    self._seed = seed
    self.buffer = PartialBuffer()
    self.next_group_id = 0
    self.totals = collections.Counter()   # over the run: admitted, trained, rejected, ...

  # ----------------------------------------------------------------- fresh prompts
  def _new_group(self, item: PromptItem, step: int) -> Group:
    s, n = self.settings, self.settings.n_samples_per_prompt
    budgets = [s.max_response_len] * n if item.budgets is None else list(item.budgets)
    if len(budgets) != n:
      raise ValueError(f"prompt {item.prompt_id}: {len(budgets)} budgets for n={n}")
    keys = sample_keys([self._seed, self.next_group_id], n)
    group_id = self.next_group_id
    samples = [SampleRecord(prompt=item.tokens, max_new_tokens=int(budgets[i]), rng=keys[i],
                            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                            meta={"group": group_id, "index": i}) for i in range(n)]
    self.next_group_id += 1
    return Group(group_id=group_id, prompt_id=item.prompt_id, prompt=samples[0].prompt,
                 answer=item.answer, samples=samples, first_step=step)

  def _next_fresh_group(self, step: int, stats) -> Group | None:
    while True:
      item = self._prompt_source()
      if item is None:
        return None
      group = self._new_group(item, step)
      try:
        for sample in group.samples:
          self.engine.check(sample)
      except PromptError:
        stats["prompts_skipped"] += 1
        self.totals["prompts_skipped"] += 1
        continue
      self.totals["admitted"] += 1
      return group

  # -------------------------------------------------------------------- staleness
  def _enforce_staleness(self, group: Group, version: int, stats) -> bool:
    """Restarts the group's samples staler than max_staleness; True if any was."""
    limit = self.settings.max_staleness
    if limit < 0:
      return False
    stale = [i for i, sample in enumerate(group.samples)
             if len(sample.versions) and version - int(sample.versions.min()) > limit]
    for i in stale:
      group.restart_sample(i)
    stats["stale_restarts"] += len(stale)
    self.totals["stale_restarts"] += len(stale)
    return bool(stale)

  # ------------------------------------------------------------------------- step
  def step(self, step: int, version: int) -> RolloutResult:
    """Generates until the stop rule holds; returns the training batch and stats."""
    s, engine = self.settings, self.engine
    start = time.perf_counter()
    engine.version = version
    tokens0, steps0 = engine.tokens_generated, engine.decode_steps
    stats = collections.Counter()
    active: list[Group] = []
    active_ids: set[int] = set()
    in_slot: set[tuple[int, int]] = set()
    accepted: list[Group] = []     # in completion order (overdue ones train first)
    awaiting: list[Group] = []     # complete, waiting for the DAPO filter's verdict
    rejected: list[Group] = []
    decided: set[int] = set()      # accepted or rejected
    overdue: set[int] = set()      # a sample restarted for staleness: finish this step
    budget = s.over_sampling_batch_size
    errors0, timeouts0, reward_s0 = (self.rewards.errors, self.rewards.timeouts,
                                     self.rewards.seconds)

    def admit() -> bool:
      if len(active) >= budget:
        return False
      group = next((g for g in self.buffer if g.group_id not in active_ids), None)
      if group is not None:
        if self._enforce_staleness(group, version, stats):
          overdue.add(group.group_id)
      else:
        group = self._next_fresh_group(step, stats)
        if group is None:
          return False
        self.buffer.add(group)
      active.append(group)
      active_ids.add(group.group_id)
      if group.complete:
        completed(group)  # a surplus group from an earlier step
      return True

    def completed(group: Group) -> None:
      """A group's n samples are done: score it; accept it (or let the filter judge)."""
      if not group.scored:
        self.rewards.submit(group)
      if s.dynamic_sampling:
        awaiting.append(group)
      else:
        accepted.append(group)
        decided.add(group.group_id)

    def judge_awaiting() -> None:
      """DAPO filter: needs the rewards of the groups completed so far."""
      nonlocal budget
      for group in self.rewards.wait_for(awaiting):
        if group.rewards_all_equal():
          self.buffer.pop(group.group_id)
          rejected.append(group)
          stats["zero_std_groups_dropped"] += 1
          self.totals["rejected"] += 1
          budget += 1  # rejected groups do not count toward the batch: admit another
        else:
          accepted.append(group)
        decided.add(group.group_id)
      awaiting.clear()

    def fill_slots() -> None:
      while engine.num_free and not stop_now():
        started = False
        for group in active:
          free = engine.num_free
          if not free:
            return
          waiting = [i for i, r in enumerate(group.samples)
                     if not r.finished and (group.group_id, i) not in in_slot]
          partial = [i for i in waiting if group.samples[i].started][:free]
          if partial:
            engine.add_partials([group.samples[i] for i in partial], mode=s.resume_mode)
            in_slot.update((group.group_id, i) for i in partial)
            stats["partial_samples"] += len(partial)
            started = True
          fresh = [i for i in waiting if not group.samples[i].started]
          fresh = fresh[:engine.num_free]
          if fresh:
            engine.add_group([group.samples[i] for i in fresh])
            in_slot.update((group.group_id, i) for i in fresh)
            started = True
        if not started:
          if not admit():
            return
          judge_awaiting()

    def stop_now() -> bool:
      if len(accepted) < s.batch_size or not overdue <= decided:
        return False
      return s.partial_rollout or all(g.complete for g in active if g.group_id in self.buffer)

    while True:
      judge_awaiting()
      if stop_now():
        break
      fill_slots()
      if stop_now():  # filling can judge awaiting groups and complete the batch
        break
      if engine.num_live == 0:
        break  # nothing live and nothing admissible: the prompts ran out
      newly_complete: dict[int, Group] = {}  # ordered, once per group
      # Free slots after filling mean nothing is waiting: decode on through finishes.
      # (Under the DAPO filter a rejected group admits another, so keep the early exit.)
      for record in engine.step(refill=engine.num_free == 0 or s.dynamic_sampling):
        group = self.buffer.get(record.meta["group"])
        in_slot.discard((group.group_id, record.meta["index"]))
        if group.complete:
          newly_complete[group.group_id] = group
      for group in newly_complete.values():
        completed(group)

    for record in engine.snapshot(with_kv=(s.resume_mode == "kv")):
      if record.started:  # cut at this step's end, to be continued: the paper's off-policy
        record.meta["cuts"] = record.meta.get("cuts", 0) + 1
    self.rewards.wait_all()  # every complete group keeps its rewards, buffered ones too
    # Overdue groups first, oldest first; then the rest in completion order (stable).
    accepted.sort(key=lambda g: (0, g.group_id) if g.group_id in overdue else (1, 0))
    batch, surplus = accepted[:s.batch_size], accepted[s.batch_size:]
    for group in batch:
      self.buffer.pop(group.group_id)
    self.totals["trained"] += len(batch)
    stats.update(
        rollout_s=time.perf_counter() - start,
        new_tokens=engine.tokens_generated - tokens0,
        decode_steps=engine.decode_steps - steps0,
        num_slots=engine.config.num_slots,
        buffer_groups=len(self.buffer), buffer_bytes=self.buffer.host_bytes(),
        surplus_groups=len(surplus), admitted_groups=len(active),
        overdue_groups=len(overdue),
        reward_errors=self.rewards.errors - errors0,
        reward_timeouts=self.rewards.timeouts - timeouts0,
        reward_s=self.rewards.seconds - reward_s0)
    return RolloutResult(groups=batch, rejected=rejected, stats=dict(stats))
