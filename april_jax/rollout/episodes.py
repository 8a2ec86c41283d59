"""Multi-turn episodes on the slot engine: what happens when a slot ends a turn.

A sample with an environment is an episode. Its response holds every turn of the model
and every observation, in order; its `episode` (records.Episode) keeps the rest as JSON,
so it survives cuts, preemptions and checkpoints: the environment's state, the turns
ended so far, the observations' token spans in the response (given, not drawn: logprob
0, outside the loss, rl/batch.py), the last reward the environment gave, and why the
environment ended the episode early, if it did (it raised or ran past its time limit:
the sample's reward is then the fallback).

The engine holds a slot that draws a stop token (EngineConfig.hold_stopped). The
scheduler hands the samples a decode call stopped to `park`: each stays parked in its
slot, with its pages, while the environment's call for its turn runs on a thread pool
(env.workers calls at once; a user's environment in as many worker processes, which end
a call past env.timeout_s), and the other slots go on decoding. `answer` applies the
calls that have returned: the environment read the turn's text and either ended the
episode (the slot is released, the sample finished) or answered; the answer's tokens,
in the observation template, go into the same slot (`SlotEngine.extend`: one chunked
prefill writes them into its pages). A sample cut out of its slot while its call runs
(a step's end, a preemption) waits on the host for it: the answer joins its response
there, and it resumes when it is in. Limits: max_turns (the episode ends after that
many turns), max_observation_tokens (a longer observation is cut to it before it is put
in its template, counted) and the sample's token budget (an observation that leaves no
room ends the episode, counted).

`reset` may give the episode's first messages (envs/base.py EnvReset): the chat
template renders them (`render`) as the sample's prompt.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading
import time
import types
from typing import Any, Callable

import numpy as np

from april_jax import errors
from april_jax.runtime import workers
from april_jax.envs.base import Env, EnvReset, EnvStep
from april_jax.sampler.episode_state import Episode
from april_jax.envs.observation_format import ObservationFormat, TextFormat
from april_jax.sampler.contract import Engine
from april_jax.sampler.records import SampleRecord
from april_jax.settings.env import EnvSettings

# Characters of an observation tokenized at most per token it may keep: text averages
# about 4 characters a token, so a text cut here still holds every token that is kept.
MAX_CHARS_PER_TOKEN = 32


class EpisodeRunner:
  """Runs one environment for every episode of a run, and counts what happens.

  On several hosts every process runs the same scheduler, so every process must see
  the same episodes: process 0 alone calls the environment, and `agree` (a collective,
  distributed.agree_json) gives its outcome to all. One process: no agreement needed."""

  def __init__(
      self,
      env: Env,
      encode: Callable[[str], list[int]],
      decode: Callable[[list[int]], str],
      settings: EnvSettings = EnvSettings(),
      end_of_turn_ids: tuple[int, ...] = (),
      agree: Callable[[Any], Any] | None = None,
      leader: bool = True,
      render: Callable[..., list[int]] | None = None,
      observations: ObservationFormat | None = None,
  ):
    self.env, self.settings = env, settings
    self._encode, self._decode = encode, decode
    self._end_of_turn = set(int(i) for i in end_of_turn_ids)
    self._agree = agree or (lambda outcome: outcome)
    self._leader = leader
    # The tokens of the environment's answer after a turn (observation_format.py).
    self._observations = observations or TextFormat(encode)
    self._render = render  # chat messages (and tools) -> prompt tokens (reset's messages)
    self.counts = collections.Counter()  # over the run
    self.wait_s = 0.0  # seconds waited for calls (answer with wait), over the run
    self._threads = {}  # kind -> the threads of the environment's calls (_pool)
    # The turns whose calls run (process 0's futures; None elsewhere), in call order.
    self.pending: dict[SampleRecord, concurrent.futures.Future | None] = {}

  def start(self, records: list[SampleRecord], rows: list[dict]) -> None:
    """Opens each sample's episode from its row (once: a resumed sample keeps it); where
    reset gave messages, their rendering becomes the sample's prompt. An environment
    that cannot reset leaves a plain sample, ended at its first turn, counted."""
    fresh = [(r, row) for r, row in zip(records, rows) if r.episode is None]
    outcomes = self._agree(
        self._map(self._reset, [row for _, row in fresh]) if self._leader else None
    )
    for (record, _), outcome in zip(fresh, outcomes):
      self._apply(record, outcome)
      if outcome.get("prompt") is not None:
        record.set_prompt(outcome["prompt"])

  def turn(self, records: list[SampleRecord]) -> list[np.ndarray | None]:
    """The environment's answer to the turn each sample just ended, waited for: the
    observation's tokens to give it, or None when its episode is over (one agreement
    for all)."""
    outcomes = self._agree(self._map(self._step, records) if self._leader else None)
    return [self._apply(r, outcome) for r, outcome in zip(records, outcomes)]

  def step_once(self, record: SampleRecord) -> tuple[np.ndarray | None, list[str] | None]:
    """The environment's answer to the turn `record` just ended, applied to its episode,
    here and now (one process; the replay's): the observation's tokens (None: the
    episode is over) and the tool results as shown in them."""
    outcome = self._step(record)
    return self._apply(record, outcome), outcome.get("results")

  def park(self, engine: Engine, finished: list[SampleRecord]) -> list[SampleRecord]:
    """After a decode call: the samples `engine` holds at a stop stay parked in their
    slots while their turns' calls run; returns the others (finished)."""
    for record in finished:
      if engine.holds(record) and record not in self.pending:
        self.pending[record] = self._submit(record) if self._leader else None
    return [r for r in finished if not engine.holds(r)]

  def awaits(self, record: SampleRecord) -> bool:
    """Whether the sample waits for its environment's call (it cannot decode yet)."""
    return record in self.pending

  def answer(self, engine: Engine, wait: str = "none") -> list[SampleRecord]:
    """Applies the calls that have returned, in call order (wait "one": after waiting
    for at least one; "all": for every one; the time waited is counted in wait_s):
    a sample in its slot goes on after its observation (extend) or ends (release); one
    out of its slot meanwhile (cut, preempted or set aside) takes its observation on the
    host, to be fed when it resumes, or ends there. Returns the samples that ended. Which calls have returned
    is process 0's view, agreed by all."""
    if not self.pending:
      return []
    records = list(self.pending)
    ended = []
    for i, outcome in self._agree(self._ready(wait) if self._leader else None):
      record = records[i]
      del self.pending[record]
      tokens = self._apply(record, outcome)
      if engine.holds(record) and tokens is not None:
        engine.extend(record, tokens)
      elif engine.holds(record):
        engine.release(record)
      elif tokens is not None:
        record.give(tokens, engine.version)
      else:  # finished out of its slot: its KV, on the host or kept, has no further use
        record.finish("stop")
        record.drop_kv()
        if engine.keeps(record):
          engine.discard(record)
      if record.finished:
        ended.append(record)
    return ended

  def resolve(self, engine: Engine, finished: list[SampleRecord]) -> list[SampleRecord]:
    """park and answer every call at once (decoding waits for them): the samples that
    are finished. All turns are answered before the caller looks at any of them (a
    sibling still held would look finished)."""
    self.park(engine, finished)
    self.answer(engine, "all")
    return [r for r in finished if not engine.holds(r)]

  def _submit(self, record: SampleRecord) -> concurrent.futures.Future:
    """The turn's call, started on the pool over a copy of what it reads (the record
    may leave its slot meanwhile)."""
    turn = types.SimpleNamespace(
        episode=record.episode, response=record.response.copy(), budget_left=record.budget_left
    )
    return self._pool().submit(self._step, turn)

  def _ready(self, wait: str) -> list[tuple[int, dict]]:
    """(place in call order, outcome) of the calls that have returned."""
    futures = list(self.pending.values())
    if wait != "none":
      began = time.perf_counter()
      how = (
          concurrent.futures.ALL_COMPLETED if wait == "all" else concurrent.futures.FIRST_COMPLETED
      )
      concurrent.futures.wait(futures, return_when=how)
      self.wait_s += time.perf_counter() - began
    return [(i, f.result()) for i, f in enumerate(futures) if f.done()]

  # ------------------------------------------------- outcomes (process 0 computes them)
  def _reset(self, row: dict) -> dict:
    episode = Episode()
    try:
      out, prompt = self._call(self.env.reset, row), None
      if isinstance(out, EnvReset):
        if out.messages is not None:
          prompt = self._prompt(out.messages, out.tools)
        elif out.state is None:
          raise TypeError("reset returned an EnvReset with neither state nor messages")
        out = out.state
      elif out is None:
        raise TypeError(
            "reset returned None: it must give the episode's first state (JSON) or an "
            "EnvReset(state, messages)"
        )
      episode.state = _json_state(out)
      return {"episode": episode.to_json(), "prompt": prompt}
    except TimeoutError:
      return _failed(
          episode, "timeouts", f"reset ran past env.timeout_s={self.settings.timeout_s:g} s"
      )
    except Exception as e:  # pylint: disable=broad-except
      return _failed(episode, "errors", f"reset: {_why(e)}")

  def _step(self, record: SampleRecord) -> dict:
    """What the turn leads to, as JSON: the sample's new episode, the observation's
    tokens (None: the episode is over) and the counts to add."""
    s = self.settings
    episode = dataclasses.replace(
        record.episode,
        turns=record.episode.turns + 1,
        observations=[list(span) for span in record.episode.observations],
    )
    spans = episode.observations
    counts = {"env/turns": 1}
    if episode.error is not None:  # its environment failed to reset
      return {"episode": episode.to_json(), "counts": counts}
    start = spans[-1][1] if spans else 0
    text = self._decode(record.response[start:].tolist())
    try:
      out = self._call(self.env.step, episode.state, text)
      if not isinstance(out, EnvStep):
        raise TypeError(f"step returned a {type(out).__name__}, not an EnvStep")
      episode.state = _json_state(out.state)
      if out.reward is not None:
        episode.reward = float(out.reward)
      if out.done or out.observation is None:
        return {"episode": episode.to_json(), "counts": counts | {"env/episodes_done": 1}}
      results = _results(out.observation)
      results, cut = zip(*(self._cut(result) for result in results))
      last = int(record.response[-1])
      end_id = last if last in self._end_of_turn else None
      tokens = self._observations.tokens(list(results), end_id)
    except TimeoutError:
      return _failed(episode, "timeouts", f"step ran past env.timeout_s={s.timeout_s:g} s", counts)
    except Exception as e:  # pylint: disable=broad-except
      return _failed(episode, "errors", f"step: {_why(e)}", counts)
    if episode.turns >= s.max_turns:
      return {"episode": episode.to_json(), "counts": counts | {"env/turn_limit": 1}}
    if any(cut):
      counts["env/observations_cut"] = sum(cut)
    if record.budget_left < len(tokens) + 1:
      return {"episode": episode.to_json(), "counts": counts | {"env/out_of_budget": 1}}
    spans.append([len(record.response), len(record.response) + len(tokens)])
    counts["env/observation_tokens"] = len(tokens)
    return {
        "episode": episode.to_json(),
        "tokens": [int(t) for t in tokens],
        "results": list(results),
        "counts": counts,
    }

  def _cut(self, result: str) -> tuple[str, bool]:
    """`result` cut to max_observation_tokens tokens (its frame not counted), and whether
    it was cut. The text is cut first: tokenizing a huge result would stall decoding,
    outside the environment's time limit, and past this many characters it cannot fit
    the tokens anyway."""
    limit = self.settings.max_observation_tokens
    room = limit * MAX_CHARS_PER_TOKEN
    text, cut = result[:room], len(result) > room
    ids = self._observations.encode_text(text)
    if len(ids) > limit:
      text, cut = self._decode(list(ids[:limit])), True
    return text, cut

  def _prompt(self, messages, tools=None) -> list[int]:
    """reset's messages (and tools) rendered by the chat template (TypeError when they
    are not chat messages, or the run has no template)."""
    ok = isinstance(messages, list) and messages
    ok = ok and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )
    if not ok:
      raise TypeError(
          'reset\'s messages must be a non-empty list of {"role": str, "content": str}, got '
          f"{str(messages)[:80]}"
      )
    if self._render is None:
      raise TypeError("reset gave messages, but no chat template renders them here")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
      raise TypeError(
          f"reset's tools must be a list of JSON schemas (dicts), got {str(tools)[:80]}"
      )
    extra = {"tools": tools} if tools is not None else {}
    return [int(t) for t in self._render(messages, **extra)]

  def _apply(self, record: SampleRecord, outcome: dict) -> np.ndarray | None:
    record.set_episode(Episode.from_json(outcome["episode"]))
    self.counts.update(outcome.get("counts", {}))
    tokens = outcome.get("tokens")
    return None if tokens is None else np.asarray(tokens, np.int32)

  def _map(self, fn, items: list) -> list:
    """[fn(item) for item in items], settings.workers calls at once (an outcome depends
    on its own sample alone), on a pool of their own: never behind turns' calls."""
    if self.settings.workers <= 1 or len(items) <= 1:
      return [fn(item) for item in items]
    return list(self._pool("waited").map(fn, items))

  def _pool(self, kind: str = "turns") -> concurrent.futures.ThreadPoolExecutor:
    """The threads of the turns' calls, or of the calls waited for at once ("waited")."""
    if kind not in self._threads:
      self._threads[kind] = concurrent.futures.ThreadPoolExecutor(
          self.settings.workers, thread_name_prefix=f"env-{kind}"
      )
    return self._threads[kind]

  def close(self) -> None:
    """Drops the calls still running and ends the environment's worker processes, if
    it has any."""
    self.pending.clear()
    for threads in self._threads.values():
      threads.shutdown(wait=False, cancel_futures=True)
    close = getattr(self.env, "close", None)
    if getattr(self.env, "in_workers", False) and close is not None:
      close()

  def _call(self, fn, *args) -> Any:
    """fn(*args) under the time limit (TimeoutError past it). A user's environment runs in
    worker processes (envs/in_workers.py), which end a call past its limit themselves; the
    calls of one turn run at once, one per worker. A registered one runs on a daemon
    thread: one that never returns is left behind and does not hold the process at exit.
    It runs on the runner's pool, off the decode path."""
    if getattr(self.env, "in_workers", False):
      return fn(*args)
    box: dict[str, Any] = {}
    done = threading.Event()

    def run():
      try:
        box["out"] = fn(*args)
      except BaseException as e:  # pylint: disable=broad-except
        box["error"] = e
      finally:
        done.set()

    threading.Thread(target=run, daemon=True, name="env").start()
    if not done.wait(self.settings.timeout_s):
      raise TimeoutError
    if "error" in box:
      error = box["error"]
      if not isinstance(error, Exception):  # SystemExit, KeyboardInterrupt: the env's own
        raise RuntimeError(f"{type(error).__name__}({error}) raised by the environment")
      raise error
    return box["out"]


def _results(observation: Any) -> list[str]:
  """An EnvStep's observation as tool results: a string is one, a list one each."""
  if isinstance(observation, (list, tuple)):
    if not observation:
      raise TypeError("step returned an empty list of observations")
    return [str(o) for o in observation]
  return [str(observation)]


def _why(error: Exception) -> str:
  """An environment's error in one line, with the user's file and line."""
  if isinstance(error, (workers.UserCodeError, workers.WorkerDied)):
    return str(error)  # described where it was raised, in the worker
  return errors.describe(error)


def _failed(episode: Episode, kind: str, why: str, counts: dict | None = None) -> dict:
  """The outcome of an environment that raised or ran past its time limit: the episode
  ends, and its reward will be the fallback."""
  failed = dataclasses.replace(episode, error=why)
  return {"episode": failed.to_json(), "counts": (counts or {}) | {f"env/{kind}": 1}}


def _json_state(state: Any) -> Any:
  """The state as a checkpoint gives it back (a JSON copy: tuples become lists, keys
  strings), so a resumed episode sees what an uninterrupted one does; TypeError when
  JSON cannot hold it."""
  try:
    return json.loads(json.dumps(state))
  except (TypeError, ValueError) as e:
    raise TypeError(f"the environment's state is not JSON ({e})") from None
