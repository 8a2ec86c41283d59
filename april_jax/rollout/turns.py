"""The scheduler's one turn hook: what happens at a turn's end, nothing in a single-turn run.

The APRIL scheduler (scheduler.py) calls its hook and never asks whether the run is
multi-turn:

  open        a group's samples start (or restart) an episode: reset gives its prompt
  after_decode  the samples an engine step finished: held turns parked on their
              environment's calls, returned calls applied; the samples now finished
  answered    the calls that returned meanwhile, applied; the samples they finished
  idle        whether every slot waits on its environment (decoding waits for a call)
  set_aside   the parked slots to give up when a sample waits for one
  awaits      whether a sample waits on its environment (it is not admitted meanwhile)
  pending     the samples whose calls run
  cut         a sample snapshotted while its call runs (counted)
  mark, stats_since  the step's env/* counts

`SingleTurn` does nothing at each; `EpisodeTurns` runs them on an EpisodeRunner
(episodes.py) and counts what happened (env/* metrics).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from april_jax.rollout.episodes import EpisodeRunner
from april_jax.rollout.group import Group
from april_jax.sampler.contract import Engine
from april_jax.sampler.records import SampleRecord


class SingleTurn:
  """A sample is one turn: nothing is held, awaited, answered or counted."""

  pending: tuple = ()

  def open(self, group: Group, records: list[SampleRecord]) -> None:
    del group, records

  def awaits(self, record: SampleRecord) -> bool:
    del record
    return False

  def idle(self, engine: Engine) -> bool:
    """Whether every slot waits on its environment (so decoding waits for a call)."""
    del engine
    return False

  def after_decode(self, engine: Engine, finished: list[SampleRecord]) -> list[SampleRecord]:
    del engine
    return finished

  def answered(self, engine: Engine, wait: str) -> list[SampleRecord]:
    del engine, wait
    return []

  def set_aside(self, engine: Engine) -> list[SampleRecord]:
    del engine
    return []

  def cut(self, record: SampleRecord) -> None:
    del record

  def mark(self) -> tuple:
    return ()

  def stats_since(self, mark: tuple) -> dict[str, float]:
    del mark
    return {}


class EpisodeTurns(SingleTurn):
  """A sample is an episode run by `runner`: turns end held, their calls run off the
  decode path, and their answers are fed back into the same slots."""

  def __init__(self, runner: EpisodeRunner):
    self.runner = runner

  @property
  def pending(self):
    return self.runner.pending

  def open(self, group: Group, records: list[SampleRecord]) -> None:
    """Resets the records' episodes from the group's row. Where reset gave messages they
    render the prompt, which a group's samples share: a fresh group takes its first
    sample's, and a sample whose messages render another is an environment error."""
    records = [r for r in records if r.episode is None]
    if not records:
      return
    self.runner.start(records, [{**group.row, "answer": group.answer}] * len(records))
    opened = [r for r in records if r.episode.error is None]  # a failed reset has no say
    if opened and all(r.episode is not None and not r.started for r in group.samples):
      group.prompt = opened[0].prompt  # a fresh group: its first opened sample's
    for r in opened:
      if not np.array_equal(r.prompt, group.prompt):
        r.set_episode(
            dataclasses.replace(
                r.episode, error="reset's messages render another prompt than its group's"
            )
        )
        self.runner.counts["env/errors"] += 1
    for r in records:
      r.set_prompt(group.prompt)

  def awaits(self, record: SampleRecord) -> bool:
    return self.runner.awaits(record)

  def idle(self, engine: Engine) -> bool:
    return engine.num_decoding == 0

  def after_decode(self, engine: Engine, finished: list[SampleRecord]) -> list[SampleRecord]:
    finished = self.runner.park(engine, finished)
    wait = "none" if self.runner.settings.overlap else "all"
    return finished + self.runner.answer(engine, wait)

  def answered(self, engine: Engine, wait: str) -> list[SampleRecord]:
    return self.runner.answer(engine, wait) if self.runner.pending else []

  def set_aside(self, engine: Engine) -> list[SampleRecord]:
    """The parked slots given up: their KV stays kept in their pages."""
    out = []
    for record in list(self.runner.pending):
      if engine.holds(record):
        engine.set_aside(record)
        out.append(record)
        self.runner.counts["env/set_aside"] += 1
    return out

  def cut(self, record: SampleRecord) -> None:
    if self.runner.awaits(record):
      self.runner.counts["env/calls_cut"] += 1

  def mark(self) -> tuple:
    return collections.Counter(self.runner.counts), self.runner.wait_s

  def stats_since(self, mark: tuple) -> dict[str, float]:
    """env/turns, env/errors, ... since `mark` (episodes.py), and env_wait_s."""
    counts, wait_s = mark
    stats = {k: v - counts[k] for k, v in self.runner.counts.items()}
    stats["env_wait_s"] = self.runner.wait_s - wait_s
    return stats
