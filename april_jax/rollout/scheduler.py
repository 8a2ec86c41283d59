"""The APRIL rollout scheduler: one RL step of generation, as docs/design.md describes it.

  1. Admit   free slots take, in order: samples of groups already admitted this step
             (partials first: prioritized resumption), then a new group: the oldest in
             the partial buffer, else a fresh prompt. A group's fresh samples started
             together share one prefill. Admission stops at over_sampling_batch_size
             groups per step (buffered ones included), plus one per group the DAPO
             filter rejects, so rejections do not shrink the batch (at most
             max_dropped_groups a step; past it the filter keeps what comes).
  2. Decode  engine.step(): up to sync_every tokens per live slot, on device. The
             scheduler drives the engine through its contract only (sampler/contract.py).
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
The batch is the first batch_size accepted groups (overdue ones first), in the order of
their group ids: which groups train may depend on how fast they finished, their order
does not (a run with speculation, whose groups finish in fewer calls, then trains its
synchronous baseline's batches alike).

Staleness (max_staleness set): a token's version tag is the oldest policy version its
forward pass saw (sampler/state.py), so a sample's staleness is `version` minus its
oldest tag: in resume mode kv, the version it started at (AReaL's measure); in mode
recompute, that of its oldest token. At admission, each sample (partial or finished)
staler than max_staleness is restarted from its prompt with a fresh key (counted as
stale_restarts); its siblings within the limit are kept. The group is then overdue:
  - the stop rule also waits until every overdue group is complete (the other slots
    keep decoding meanwhile; what they finish is surplus for the next step), and
  - the batch takes overdue groups first, oldest first.
A restart is never cut at a step's end: it finishes in the step it restarts, at the
current version (only SIGTERM cuts it, and its staleness is judged again on resume).
The oldest overdue group always trains in its step (unless SIGTERM cuts the step: then it
waits in the buffer, a restart like any other), so no prompt restarts forever; no
trained token is staler than max_staleness, and the prompt itself is never lost.

With an environment (`episodes`, rollout/episodes.py) a sample is an episode. A slot that
ends a turn is parked with its pages while the environment's call runs off the decode
path (env.overlap) and the other slots decode; when a sample waits for a slot, parked
ones are set aside (their KV kept in their pages, taken back in place once answered).
At each decode boundary the calls that have returned are applied: the observation goes
into the same slot (one chunked prefill), or the episode ends and the sample is
finished. Only when nothing can decode does the scheduler wait for a call (counted as
env_wait_s). With env.overlap off every call is waited for right after the decode call
that ended its turn (a run is then reproducible whatever the calls' timing). A cut
snapshots an episode like any sample, mid-turn, with an observation not yet fed, or with
its call still running: it waits on the host for the call, takes its observation there,
and resumes in either mode; a checkpoint waits for every running call first, so nothing
is lost or asked twice.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

import numpy as np

from april_jax.data import PromptItem
from april_jax.rollout.episodes import EpisodeRunner
from april_jax.rollout.turns import EpisodeTurns, SingleTurn
from april_jax.rollout.buffer import PartialBuffer
from april_jax.rollout.group import Group
from april_jax.rollout.reward_runner import RewardRunner
from april_jax.settings.rollout import RolloutSettings
from april_jax.sampler import PromptError, SampleRecord, sample_keys
from april_jax.sampler.contract import Engine


@dataclasses.dataclass
class RolloutResult:
  groups: list[Group]  # the training batch: batch_size groups
  rejected: list[Group]  # dropped by the DAPO filter this step
  stats: dict[str, float]  # counts and timings of this step (see metrics.py)
  cut: bool = False  # ended early (SIGTERM): no batch; everything stays in the buffer


class AprilScheduler:
  """Drives an engine (sampler/contract.py) through RL steps; owns the partial buffer."""

  def __init__(
      self,
      engine: Engine,
      settings: RolloutSettings,
      prompt_source: Callable[[], PromptItem | None],
      rewards: RewardRunner,
      seed: int = 0,
      episodes: EpisodeRunner | None = None,
  ):
    if found := settings.problems():
      raise ValueError("; ".join(found))
    if engine.config.hold_stopped != (episodes is not None):
      raise ValueError("an environment's episodes need an engine with hold_stopped, and only they")
    self.engine, self.settings, self.rewards = engine, settings, rewards
    self.episodes = episodes  # the runner (None: single-turn), for its counts and close
    self.turns = SingleTurn() if episodes is None else EpisodeTurns(episodes)
    self._prompt_source = prompt_source
    self._seed = seed
    self.buffer = PartialBuffer()
    self.next_group_id = 0
    self.totals = collections.Counter()  # over the run: admitted, trained, rejected, ...

  # ---------------------------------------------------------------- checkpoints
  def checkpoint(self) -> tuple[dict[str, np.ndarray], dict]:
    """Copies every kept KV out of the pool (the pages become plain free pages), then
    returns what a checkpoint keeps: the partial buffer as numpy arrays, KV included,
    and the rest (group ids, run totals) as JSON."""
    self.engine.copy_out_kept()
    self.turns.answered(self.engine, "all")  # calls still running: answers join the buffer
    return self.buffer.to_state(), {
        "next_group_id": self.next_group_id,
        "totals": dict(self.totals),
    }

  def restore(self, arrays: dict[str, np.ndarray], host: dict) -> None:
    """Back to a `checkpoint()`: the buffer exactly, KV included."""
    self.buffer = PartialBuffer.from_state(arrays)
    self.next_group_id = host["next_group_id"]
    self.totals = collections.Counter(host["totals"])

  # ----------------------------------------------------------------- fresh prompts
  def _new_group(self, item: PromptItem, step: int) -> Group:
    s, n = self.settings, self.settings.n_samples_per_prompt
    budgets = [s.max_response_len] * n if item.budgets is None else list(item.budgets)
    if len(budgets) != n:
      raise ValueError(f"prompt {item.prompt_id}: {len(budgets)} budgets for n={n}")
    keys = sample_keys([self._seed, self.next_group_id], n)
    group_id = self.next_group_id
    samples = [
        SampleRecord(
            prompt=item.tokens,
            max_new_tokens=int(budgets[i]),
            rng=keys[i],
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            group_id=group_id,
            index=i,
        )
        for i in range(n)
    ]
    self.next_group_id += 1
    return Group(
        group_id=group_id,
        prompt_id=item.prompt_id,
        prompt=samples[0].prompt,
        answer=item.answer,
        samples=samples,
        first_step=step,
        row=item.row or {},
    )

  def _next_fresh_group(self, step: int, stats) -> Group | None:
    while True:
      item = self._prompt_source()
      if item is None:
        return None
      group = self._new_group(item, step)
      self.turns.open(group, group.samples)  # reset may give the group's prompt (its messages)
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
    if limit is None:
      return False
    stale = [
        i
        for i, sample in enumerate(group.samples)
        if len(sample.versions) and version - int(sample.versions.min()) > limit
    ]
    for i in stale:
      self.engine.discard(group.samples[i])  # its kept KV, if any: it starts over
      group.restart_sample(i)
    stats["stale_restarts"] += len(stale)
    self.totals["stale_restarts"] += len(stale)
    return bool(stale)

  # ------------------------------------------------------------------------- step
  def step(
      self,
      step: int,
      cut_now: Callable[[], bool] | None = None,
      give_up: Callable[[], bool] | None = None,
      train_version: int | None = None,
      between_calls: Callable[[], None] | None = None,
  ) -> RolloutResult:
    """Generates until the stop rule holds, with the engine's policy; returns the training
    batch and stats. Staleness is judged against `train_version`, the version that will
    train on the batch (None: the engine's, as when rollout and learner take turns).
    `between_calls()` runs before each decode call (an asynchronous rollout takes new
    weights there: rollout/async_rollout.py).

    `cut_now()`, asked before each decode call (the same number of times on every
    process of a run), ends the step early: every unfinished sample goes to the buffer as
    at a step's end, the groups completed stay there whole (unscored ones are scored
    again when next admitted), and the result has no batch (`cut`). `give_up()`, asked at
    any time while waiting for rewards (so on one process only), cuts the step too."""
    st = self._begin(step, train_version)
    st.give_up = give_up
    while True:
      if cut_now is not None and cut_now():
        st.cut = True
        break
      if not self._judge(st):
        break  # gave up waiting for rewards: a cut too
      if self._stop(st):
        break
      self._answer(st, "none")  # environment calls that returned meanwhile
      self._fill(st)
      if self._stop(st):  # filling can judge awaiting groups and complete the batch
        break
      if self.engine.num_live == 0 and not self.turns.pending:
        break  # nothing live and nothing admissible: the prompts ran out
      if between_calls is not None:
        between_calls()
      self._decode(st)
    self._snapshot(st)
    # Every complete group keeps its rewards, buffered ones too (unless told to give up).
    if not st.cut and not self.rewards.wait_all(give_up=st.give_up):
      st.cut = True
    return self._cut(st) if st.cut else self._end(st)

  def _begin(self, step: int, train_version: int | None = None) -> "_Step":
    r, counters = self.rewards, self.engine.counters
    return _Step(
        step=step,
        version=self.engine.version if train_version is None else int(train_version),
        budget=self.settings.over_sampling_batch_size,
        start=time.perf_counter(),
        tokens0=counters.tokens_generated,
        steps0=counters.decode_steps,
        drafts0=_draft_counts(counters),
        rewards0=(r.errors, r.timeouts, r.seconds),
        turns0=self.turns.mark(),
    )

  def _admit(self, st: "_Step") -> bool:
    """Admits one more group (buffered first, else fresh), if the budget allows."""
    if len(st.active) >= st.budget:
      return False
    group = next((g for g in self.buffer if g.group_id not in st.active_ids), None)
    if group is not None:
      if self._enforce_staleness(group, st.version, st.stats):
        st.overdue.add(group.group_id)
    else:
      group = self._next_fresh_group(st.step, st.stats)
      if group is None:
        return False
      self.buffer.add(group)
    st.active.append(group)
    st.active_ids.add(group.group_id)
    if group.complete:
      self._completed(st, group)  # a surplus group from an earlier step
    return True

  def _completed(self, st: "_Step", group: Group) -> None:
    """A group's n samples are done: score it; accept it (or let the filter judge)."""
    if not group.scored:
      self.rewards.submit(group)
    if self.settings.dynamic_sampling:
      st.awaiting.append(group)
    else:
      st.accept(group)

  def _judge(self, st: "_Step") -> bool:
    """The DAPO filter: needs the rewards of the groups completed so far. False if
    `give_up` ended the wait first: nothing judged, and the step is cut."""
    if self.rewards.wait_for(st.awaiting, give_up=st.give_up) is None:
      st.cut = True
      return False
    for group in st.awaiting:
      if not group.rewards_all_equal():
        st.accept(group)
        continue
      if st.stats["zero_std_groups_dropped"] >= self.settings.max_dropped_groups:
        st.stats["zero_std_groups_kept"] += 1  # the cap is reached: trained (advantage 0)
        st.accept(group)
        continue
      self.buffer.pop(group.group_id)
      st.rejected.append(group)
      st.decided.add(group.group_id)
      st.stats["zero_std_groups_dropped"] += 1
      self.totals["rejected"] += 1
      st.budget += 1  # rejected groups do not count toward the batch: admit another
    st.awaiting.clear()
    return True

  def _fill(self, st: "_Step") -> None:
    """Free slots take the admitted groups' waiting samples (partials first), as far as
    the KV pages allow; while slots stay free, more groups are admitted, as many as
    the free slots can take, and started together (their prompts share prefill calls),
    until no slot is free, a waiting sample lacks pages, or the stop rule holds."""
    self._set_aside_parked(st)
    while self.engine.num_free and not self._stop(st):
      started = self._start_waiting(st)
      if st.blocked:
        return  # a waiting sample lacks a slot or pages: admit nothing more for now
      if not started and not self._admit_for_free_slots(st):
        return

  def _set_aside_parked(self, st: "_Step") -> None:
    """With every slot taken and a sample waiting for one (or a group still to admit),
    the slots parked on running environment calls are given up: their samples' KV stays
    kept in their pages (resume mode kv), and they take them back in place once
    answered. A tool call then idles no slot."""
    if not self.turns.pending or self.engine.num_free or self.settings.resume_mode != "kv":
      return
    if not self._waiting(st) and (len(st.active) >= st.budget or self._stop(st)):
      return
    st.set_aside.update(self.turns.set_aside(self.engine))

  def _waiting(self, st: "_Step") -> list[tuple[Group, list[SampleRecord]]]:
    """Each admitted group's samples that wait for a slot (unfinished, not in one)."""
    engine = self.engine
    out = []
    for group in st.active:
      waiting = [
          r
          for r in group.samples
          if not r.finished and not engine.holds(r) and not self.turns.awaits(r)
      ]  # a sample whose environment call runs waits for it first
      if waiting:
        out.append((group, waiting))
    return out

  def _start_waiting(self, st: "_Step") -> bool:
    """Starts waiting samples, partials first, then fresh ones, each in the groups'
    admission order, as far as slots and pages allow: the partials in one call, the
    fresh samples in another (their prompts prefilled together), which take the free
    slots in the order room_for counted them. Sets st.blocked if a waiting sample is
    left; True if any started."""
    engine = self.engine
    waiting = self._waiting(st)
    for group, rs in waiting:  # restarted samples: a new episode
      self.turns.open(group, rs)
    order = [r for _, rs in waiting for r in rs if r.started]
    order += [r for _, rs in waiting for r in rs if not r.started]
    room = engine.room_for(order)
    st.blocked = room < len(order)
    # Partials: samples cut or preempted; one set aside this step takes its slot back.
    st.stats["partial_samples"] += sum(r.started and r not in st.set_aside for r in order[:room])
    st.set_aside.difference_update(order[:room])
    engine.admit(order[:room], mode=self.settings.resume_mode)
    return room > 0

  def _admit_for_free_slots(self, st: "_Step") -> bool:
    """Admits groups while the stop rule allows and the waiting samples can all start
    but leave a slot free, so that the groups start together; True if any was."""
    admitted = False
    while not self._stop(st):
      if admitted:
        waiting = [r for _, rs in self._waiting(st) for r in rs]
        if len(waiting) >= self.engine.num_free or self.engine.room_for(waiting) < len(waiting):
          break
      if not self._admit(st):
        break
      self._judge(st)
      admitted = True
    return admitted

  def _decode(self, st: "_Step") -> None:
    """One engine step; the groups it completed, in completion order, once each.

    Free slots after filling mean nothing is waiting, unless a sample waits for pages:
    otherwise decode on through finishes. (Under the DAPO filter a rejected group admits
    another, so keep the early exit.) Samples preempted for pages stay in their groups,
    as partials: the next fill continues them first.
    """
    engine = self.engine
    if self.turns.idle(engine):
      self._answer(st, "one")  # every slot waits for its environment: so does decoding
      return
    refill = engine.num_free == 0 or st.blocked or self.settings.dynamic_sampling
    # Held turns: their calls start; those back go on.
    finished = self.turns.after_decode(engine, engine.step(refill=refill))
    preempted = engine.take_preempted()
    st.stats["preemptions"] += len(preempted)
    self.totals["preemptions"] += len(preempted)
    self._finished(st, finished)

  def _answer(self, st: "_Step", wait: str) -> None:
    """The environment calls that have returned, applied (turns.py)."""
    self._finished(st, self.turns.answered(self.engine, wait))

  def _finished(self, st: "_Step", finished: list[SampleRecord]) -> None:
    """The groups of this step that the finished samples completed, in completion
    order, once each (a group not admitted this step is judged when it is)."""
    done: dict[int, Group] = {}
    for record in finished:
      if record.group_id not in self.buffer or record.group_id not in st.active_ids:
        continue
      group = self.buffer.get(record.group_id)
      if group.samples[record.index] is record and group.complete:
        done[group.group_id] = group
    for group in done.values():
      if group.group_id not in st.decided and group not in st.awaiting:
        self._completed(st, group)

  def _stop(self, st: "_Step") -> bool:
    """batch_size groups accepted and every overdue one decided; the baseline also
    waits for every admitted group. A cut step stops at once."""
    if st.cut:
      return True
    if len(st.accepted) < self.settings.batch_size or not st.overdue <= st.decided:
      return False
    return self.settings.partial_rollout or all(
        g.complete for g in st.active if g.group_id in self.buffer
    )

  def _snapshot(self, st: "_Step") -> None:
    """Every unfinished slot back to its group; a started one was cut at this step's
    end, to be continued (the paper's off-policy measure counts it). In mode kv its KV
    stays in the pool until its pages are needed (engine.snapshot with keep)."""
    st.stats["kv_pages_used_frac"] = self.engine.pages_used_fraction()
    kv = self.settings.resume_mode == "kv"
    for record in self.engine.snapshot(with_kv=kv, keep=kv):
      if record.started:
        record.count_cut()
      self.turns.cut(record)

  def _end(self, st: "_Step") -> RolloutResult:
    """Takes the batch out of the buffer: the first batch_size accepted groups (overdue
    ones first, then the rest in completion order), put in group id order; the step's
    stats."""
    counters, r = self.engine.counters, self.rewards
    st.accepted.sort(key=lambda g: (0, g.group_id) if g.group_id in st.overdue else (1, 0))
    N = self.settings.batch_size
    batch, surplus = st.accepted[:N], st.accepted[N:]
    batch.sort(key=lambda g: g.group_id)
    for group in batch:
      self.buffer.pop(group.group_id)
    self.totals["trained"] += len(batch)
    st.stats.update(
        rollout_s=time.perf_counter() - st.start,
        new_tokens=counters.tokens_generated - st.tokens0,
        decode_steps=counters.decode_steps - st.steps0,
        num_slots=self.engine.config.num_slots,
        buffer_groups=len(self.buffer),
        buffer_bytes=self.buffer.host_bytes(),
        surplus_groups=len(surplus),
        admitted_groups=len(st.active),
        overdue_groups=len(st.overdue),
        reward_errors=r.errors - st.rewards0[0],
        reward_timeouts=r.timeouts - st.rewards0[1],
        reward_s=r.seconds - st.rewards0[2],
    )
    st.stats.update(self.turns.stats_since(st.turns0))  # env/turns, ... (multi-turn runs)
    st.stats.update(_draft_counts(counters, since=st.drafts0))  # spec/* (speculation)
    return RolloutResult(groups=batch, rejected=st.rejected, stats=dict(st.stats))

  def _cut(self, st: "_Step") -> RolloutResult:
    """A step ended early: nothing trains; what it admitted stays in the buffer (scores
    still running are dropped: their groups are scored when next admitted)."""
    self.rewards.drop_unscored()
    st.stats.update(
        rollout_s=time.perf_counter() - st.start,
        new_tokens=self.engine.counters.tokens_generated - st.tokens0,
        buffer_groups=len(self.buffer),
    )
    return RolloutResult(groups=[], rejected=st.rejected, stats=dict(st.stats), cut=True)


@dataclasses.dataclass
class _Step:
  """What one RL step has admitted and decided so far (AprilScheduler.step)."""

  step: int
  version: int
  budget: int  # groups it may admit: N', plus one per DAPO rejection
  start: float
  tokens0: int
  steps0: int
  drafts0: dict
  rewards0: tuple
  turns0: tuple  # the turn hook's counts at the step's start
  active: list[Group] = dataclasses.field(default_factory=list)  # admitted
  active_ids: set[int] = dataclasses.field(default_factory=set)
  accepted: list[Group] = dataclasses.field(default_factory=list)  # completion order
  awaiting: list[Group] = dataclasses.field(default_factory=list)  # the filter's verdict
  rejected: list[Group] = dataclasses.field(default_factory=list)
  decided: set[int] = dataclasses.field(default_factory=set)  # accepted or rejected
  set_aside: set[SampleRecord] = dataclasses.field(default_factory=set)  # not back yet
  overdue: set[int] = dataclasses.field(default_factory=set)  # finish this step
  blocked: bool = False  # a waiting sample found no free slot or pages at the last fill
  cut: bool = False  # ended early (cut_now, or give_up while waiting for rewards)
  give_up: Callable[[], bool] | None = None
  stats: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def accept(self, group: Group) -> None:
    self.accepted.append(group)
    self.decided.add(group.group_id)


def _draft_counts(counters, since: dict | None = None) -> dict[str, int]:
  """Speculation's counters by source (EngineCounters: drafted, accepted, draft_passes)
  as spec/<counter>/<source>, less `since`'s."""
  out = {
      "spec/draft_failures": counters.draft_failures - (since or {}).get("spec/draft_failures", 0)
  }
  for kind in ("drafted", "accepted", "draft_passes"):
    for source, n in getattr(counters, kind).items():
      key = f"spec/{kind}/{source}"
      out[key] = n - (since or {}).get(key, 0)
  return out
