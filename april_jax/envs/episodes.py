"""Multi-turn episodes on the slot engine: what happens when a slot ends a turn.

A sample with an environment is an episode. Its response holds every turn of the model
and every observation, in order; its `episode` (records.Episode) keeps the rest as JSON,
so it survives cuts, preemptions and checkpoints: the environment's state, the turns
ended so far, the observations' token spans in the response (given, not drawn: logprob
0, outside the loss, rl/batch.py), the last reward the environment gave, and why the
environment ended the episode early, if it did (it raised or ran past its time limit:
the sample's reward is then the fallback).

The engine holds a slot that draws a stop token (EngineConfig.hold_stopped). The
scheduler hands the samples a decode call stopped to `turn`: the environment reads the turn's text and either
ends the episode (the slot is released, the sample finished) or answers; the answer's
tokens, in the observation template, go into the same slot (`SlotEngine.extend`) and
decoding goes on over the slot's own KV. Limits: max_turns (the episode ends after that
many turns), max_observation_tokens (a longer observation is cut to it before it is put
in its template, counted) and the sample's token budget (an observation that leaves no
room ends the episode, counted).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading
from typing import Any, Callable

import numpy as np

from april_jax import errors
from april_jax import workers
from april_jax.envs.base import Env, EnvStep
from april_jax.envs.episode_state import Episode

SampleRecord = Any  # april_jax.sampler.SampleRecord (a layer above this one)


# Characters of an observation tokenized at most per token it may keep: text averages
# about 4 characters a token, so a text cut here still holds every token that is kept.
MAX_CHARS_PER_TOKEN = 32


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
  max_turns: int = 8
  max_observation_tokens: int = 256
  timeout_s: float = 10.0  # per environment call
  # The text around an observation: it closes the model's turn and opens the next one.
  observation_template: str = "{observation}"
  # Put before the template when the turn ended on a stop token that is not the end of
  # a chat turn (e.g. `</tool_call>` rather than `<|im_end|>`).
  close_turn: str = ""

  @classmethod
  def from_config(cls, env_config) -> "EpisodeSettings":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in dict(env_config).items() if k in names})


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
      settings: EpisodeSettings = EpisodeSettings(),
      end_of_turn_ids: tuple[int, ...] = (),
      agree: Callable[[Any], Any] | None = None,
      leader: bool = True,
  ):
    self.env, self.settings = env, settings
    self._encode, self._decode = encode, decode
    self._end_of_turn = set(int(i) for i in end_of_turn_ids)
    self._agree = agree or (lambda outcome: outcome)
    self._leader = leader
    prefix, _, suffix = settings.observation_template.partition("{observation}")
    self._around = (prefix, suffix)
    self.counts = collections.Counter()  # over the run
    self._threads = None  # calls to a user's environment, one per worker process

  def start(self, records: list[SampleRecord], rows: list[dict]) -> None:
    """Opens each sample's episode from its row (once: a resumed sample keeps it). An
    environment that cannot reset leaves a plain sample, ended at its first turn,
    counted."""
    fresh = [(r, row) for r, row in zip(records, rows) if r.episode is None]
    outcomes = self._agree(
        self._map(self._reset, [row for _, row in fresh]) if self._leader else None
    )
    for (record, _), outcome in zip(fresh, outcomes):
      self._apply(record, outcome)

  def turn(self, records: list[SampleRecord]) -> list[np.ndarray | None]:
    """The environment's answer to the turn each sample just ended: the observation's
    tokens to give it, or None when its episode is over (one agreement for all)."""
    outcomes = self._agree(self._map(self._step, records) if self._leader else None)
    return [self._apply(r, outcome) for r, outcome in zip(records, outcomes)]

  def resolve(self, engine, finished: list[SampleRecord]) -> list[SampleRecord]:
    """After a decode call: each sample `engine` holds at a stop gets the environment's
    answer, and goes on in its slot (extended) or ends (released). Returns the samples
    that are finished; all turns are answered before the caller looks at any of them (a
    sibling still held would look finished)."""
    held = [r for r in finished if engine.holds(r)]
    for record, observation in zip(held, self.turn(held)):
      if observation is not None:
        engine.extend(record, observation)
      else:
        engine.release(record)
    return [r for r in finished if not engine.holds(r)]

  # ------------------------------------------------- outcomes (process 0 computes them)
  def _reset(self, row: dict) -> dict:
    episode = Episode()
    try:
      episode.state = _json_state(self._call(self.env.reset, row))
      return {"episode": episode.to_json()}
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
      text = str(out.observation)
      # Cut the text first: tokenizing a huge observation would stall decoding, outside the
      # environment's time limit. Past this many characters it cannot fit the tokens anyway.
      room = s.max_observation_tokens * MAX_CHARS_PER_TOKEN
      observation, cut = self._encode(text[:room]), len(text) > room
    except TimeoutError:
      return _failed(episode, "timeouts", f"step ran past env.timeout_s={s.timeout_s:g} s", counts)
    except Exception as e:  # pylint: disable=broad-except
      return _failed(episode, "errors", f"step: {_why(e)}", counts)
    if episode.turns >= s.max_turns:
      return {"episode": episode.to_json(), "counts": counts | {"env/turn_limit": 1}}
    if cut or len(observation) > s.max_observation_tokens:  # the observation, not its frame
      observation = observation[: s.max_observation_tokens]
      counts["env/observations_cut"] = 1
    close = "" if int(record.response[-1]) in self._end_of_turn else s.close_turn
    prefix, suffix = self._around
    tokens = self._encode(close + prefix) + observation + self._encode(suffix)
    if record.budget_left < len(tokens) + 1:
      return {"episode": episode.to_json(), "counts": counts | {"env/out_of_budget": 1}}
    spans.append([len(record.response), len(record.response) + len(tokens)])
    counts["env/observation_tokens"] = len(tokens)
    return {"episode": episode.to_json(), "tokens": [int(t) for t in tokens], "counts": counts}

  def _apply(self, record: SampleRecord, outcome: dict) -> np.ndarray | None:
    record.episode = Episode.from_json(outcome["episode"])
    self.counts.update(outcome.get("counts", {}))
    tokens = outcome.get("tokens")
    return None if tokens is None else np.asarray(tokens, np.int32)

  def _map(self, fn, items: list) -> list:
    """[fn(item) for item in items]; with a user's environment in worker processes, its
    calls run at once, one per worker (an outcome depends on its own sample alone)."""
    num = getattr(self.env, "num", 1) if getattr(self.env, "in_workers", False) else 1
    if num <= 1 or len(items) <= 1:
      return [fn(item) for item in items]
    if self._threads is None:
      self._threads = concurrent.futures.ThreadPoolExecutor(num, thread_name_prefix="env")
    return list(self._threads.map(fn, items))

  def close(self) -> None:
    """Ends the environment's worker processes, if it has any."""
    if self._threads is not None:
      self._threads.shutdown(wait=False, cancel_futures=True)
    close = getattr(self.env, "close", None)
    if getattr(self.env, "in_workers", False) and close is not None:
      close()

  def _call(self, fn, *args) -> Any:
    """fn(*args) under the time limit (TimeoutError past it). A user's environment runs in
    worker processes (envs/in_workers.py), which end a call past its limit themselves; the
    calls of one turn run at once, one per worker. A registered one runs on a daemon
    thread: one that never returns is left behind and does not hold the process at exit.
    Decoding waits for the calls."""
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


def observation_mask(record: SampleRecord) -> np.ndarray:
  """1.0 for each response token the model drew, 0.0 for each observation token."""
  mask = np.ones(len(record.response), np.float32)
  for start, end in record.episode.observations if record.episode else ():
    mask[start:end] = 0.0
  return mask
