"""The engine contract: what a driver may do with a rollout engine, and what it promises.

Two drivers run an engine: the APRIL scheduler (rollout/scheduler.py), one RL step at a
time, and `generate_on` (generate.py), for evaluation and users; the episode runner
(rollout/episodes.py) answers the slots a step held at a stop. They use these calls only.
`SlotEngine` (engine.py) is the engine; its parts (engine_parts.py: the slot registry,
the KV manager, the prefill cache, the device state, the given tokens) are its own. tests/engine_conformance_test.py asks the promises below
of it and of the tests' host-only engine alike.

A driver may
  set_policy(params, version)   draw with these params, tagging tokens with this version,
                                from the next call on. The policy's one writer (the
                                trainer, after each update; evaluation reads it as is).
  check(record)                 PromptError if the sample can never run in a slot.
  room_for(records) -> n        how many of `records`, in order, could start now.
  admit(records, mode=None)     start the first room_for(records) of them (partial
                                samples, started, go in before fresh ones); a fresh
                                sample's prompt is prefilled once for all who share it,
                                a partial continues from its KV (mode "kv", in place if
                                its KV is kept in the pool) or is recomputed (mode
                                "recompute"); mode None: the engine's resume_mode.
  step(refill=True) -> finished up to sync_every tokens per live slot; the samples that
                                finished, and those held at a stop (status HELD, with
                                hold_stopped), in the order they stopped. Live slots get
                                their pages first; where a shard runs out, its youngest
                                are preempted.
  take_preempted() -> records   the samples preempted since the last call, oldest first;
                                the driver continues them like any partial sample.
  extend(record, tokens)        a sample held at a stop (hold_stopped) goes on after the
  release(record)               given tokens, or ends. Until then it stays parked in its
                                slot with its pages while the other slots decode (a
                                snapshot takes it out like any unfinished sample). Given
                                tokens are written into the slot's pages by one chunked
                                prefill at the next step (feed_given "prefill"), or fed
                                by its decode steps, one a step ("decode").
  set_aside(record)             a held sample leaves its slot to another, its KV kept in
                                its pages (as snapshot with keep leaves it); admitted
                                again, it takes them back in place.
  snapshot(with_kv, keep)       every unfinished sample out of its slot, all slots free;
                                with keep its KV stays in its pages until they are needed.
  discard(record)               a kept sample starts over: its pages go, its KV is not
                                copied.
  copy_out_kept()               every kept sample's KV to the host (before a checkpoint).
  warm_up()                     compile every program a run uses (on an empty engine).
  listen(listener)              listener(event, seconds, **facts) after each call that
                                engine_events.EVENTS names (benchmarks time and count
                                the engine's work so, never by replacing its parts).
and ask, changing nothing: holds(record), keeps(record), num_live, num_free,
num_decoding (live slots not held at a stop), config,
params, version, counters (EngineCounters) and pages_used_fraction().

It promises
  - A sample's draws depend on its own key, its tokens and the params alone: token t is
    drawn with fold_in(rng, t), whatever its slot, its neighbours, cuts or preemptions.
  - Every drawn token carries its behaviour logprob and a version tag: the oldest
    version its forward pass saw (min of the drawing version and its KV's version).
  - Nothing is lost or doubled: every admitted sample leaves once, through step
    (finished), take_preempted or snapshot; a held one only through extend, release
    or set_aside.
  - A partial continued from its KV, kept or from the host, decodes as it would have
    without the cut; a recomputed one as a fresh prefill of its tokens would.
  - Lengths are bucketed: after warm_up, no call compiles a new program.
  - The oldest live slot always has its pages (the pool holds one max_len sequence per
    shard); preemption takes the youngest, and never drops a sample.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from april_jax.sampler.engine_config import EngineConfig
from april_jax.sampler.records import SampleRecord

# Where a speculative pass's drafts come from (drafts.py), as counters and metrics name them.
DRAFT_SOURCES = ("suggested", "own", "group", "history")


@dataclasses.dataclass
class EngineCounters:
  """What an engine has done over its life (drivers take differences per step)."""

  decode_steps: int = 0  # decode steps run (every slot advances at most 1 each)
  tokens_generated: int = 0  # tokens drawn (not given), summed over slots
  prefills: int = 0  # prefill calls (prompts, and recomputed partials)
  preemptions: int = 0  # samples moved out of their slot for pages
  kv_bytes_to_host: int = 0  # KV copied out of the pool (snapshots, preemptions, kept)
  kv_bytes_to_device: int = 0  # host KV put back into the pool
  kv_reads: int = 0  # transfers of KV out of the pool (each up to snapshot_width slots)
  feeds: int = 0  # chunked-prefill calls that wrote given tokens into slots' pages
  tokens_fed: int = 0  # given tokens those calls wrote
  feed_rows: int = 0  # rows those calls computed (a power of two, at most insert_width)
  # Speculation (speculative_tokens > 0), by draft source (DRAFT_SOURCES): tokens
  # guessed and checked by a verify pass, those the pass drew the same, and the slots'
  # passes that checked any.
  decode_calls: int = 0  # device calls of decoding (each up to sync_every steps)
  speculative_calls: int = 0  # those that speculated
  drafted: dict[str, int] = dataclasses.field(default_factory=dict)
  accepted: dict[str, int] = dataclasses.field(default_factory=dict)
  draft_passes: dict[str, int] = dataclasses.field(default_factory=dict)
  draft_failures: int = 0  # a draft source's failures on the host (the slot drafted less)

  def count_drafts(self, stats) -> None:
    """A speculative call's stats [3, sources] (speculative.decode) added in."""
    for row, totals in zip(stats, (self.drafted, self.accepted, self.draft_passes)):
      for name, n in zip(DRAFT_SOURCES, row):
        totals[name] = totals.get(name, 0) + int(n)


class Engine(Protocol):
  """The calls above, as a type for the drivers."""

  config: EngineConfig
  counters: EngineCounters

  @property
  def params(self):
    ...

  @property
  def version(self) -> int:
    ...

  @property
  def num_live(self) -> int:
    ...

  @property
  def num_free(self) -> int:
    ...

  @property
  def num_decoding(self) -> int:
    ...

  def set_policy(self, params, version: int) -> None:
    ...

  def check(self, record: SampleRecord) -> None:
    ...

  def room_for(self, records: list[SampleRecord]) -> int:
    ...

  def admit(self, records: list[SampleRecord], mode: str | None = None) -> list[int]:
    ...

  def step(self, refill: bool = True) -> list[SampleRecord]:
    ...

  def take_preempted(self) -> list[SampleRecord]:
    ...

  def extend(self, record: SampleRecord, tokens) -> None:
    ...

  def release(self, record: SampleRecord) -> None:
    ...

  def set_aside(self, record: SampleRecord) -> None:
    ...

  def snapshot(self, with_kv: bool = True, keep: bool = False) -> list[SampleRecord]:
    ...

  def discard(self, record: SampleRecord) -> None:
    ...

  def copy_out_kept(self) -> None:
    ...

  def holds(self, record: SampleRecord) -> bool:
    ...

  def listen(self, listener) -> None:
    ...

  def keeps(self, record: SampleRecord) -> bool:
    ...

  def pages_used_fraction(self) -> float:
    ...

  def warm_up(self) -> int:
    ...
