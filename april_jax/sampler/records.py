"""Samples on the host: requests not started, partial samples, finished samples.

A `SampleRecord` is what leaves a slot and what goes back into one. Its response so
far carries, token by token, the behavior logprob and a version tag: the oldest
policy version that token's forward pass saw (the drawing params, or older params
whose KV it attended to; see state.py). A partial snapshotted in mode `kv` also keeps
its KV cache for the used length only (positions 0 .. prompt+response-2: the last
token is pending), with `kv_version`, the oldest version among those KV entries. A
sample cut while tokens it was given (an environment's observation) were still being
fed has KV for fewer positions; the rest are fed when it resumes (rows.kv_positions).

Where a sample stands is its `status` (Status): waiting (never started), live (in a
slot, decoding), held (in a slot, stopped at the end of a turn, waiting for its
environment), kept (out of any slot, its KV kept in the pool's pages), partial (out of
any slot, its KV on the host or none), finished (a stop token or its budget), rejected
(it cannot run: `error` says why). The engine marks the three states it owns (live,
held, kept); the rest follow from the record's own fields.

A record changes only through its transitions, below, each of which checks the state it
leaves (a finished sample draws nothing more, a live one is given no tokens, a started
one keeps its prompt, ...): the record is frozen, so no other module assigns a field.

The fields a caller keeps with a sample are named (group_id, index, cuts, restarts,
home_shard, error, episode) and serialise to JSON (`to_json` / `from_json`), so a
checkpoint holds them as they are; `from_json` also reads the untyped `meta` dict that
checkpoints of earlier versions hold.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from april_jax.sampler.episode_state import Episode
from april_jax.settings.rollout import RolloutSettings


class PromptError(ValueError):
  """A request the sampler cannot run (empty prompt, prompt too long for a slot, ...)."""


class Status(str, enum.Enum):
  WAITING = "waiting"  # never started, in no slot
  LIVE = "live"  # in a slot, decoding
  HELD = "held"  # in a slot, stopped at the end of a turn (EngineConfig.hold_stopped)
  KEPT = "kept"  # in no slot, its KV kept in the pool's pages (snapshot with keep)
  PARTIAL = "partial"  # started, in no slot; its KV on the host (mode kv) or none
  FINISHED = "finished"  # a stop token or its budget: finish_reason says which
  REJECTED = "rejected"  # it cannot run: `error` says why


def _empty(dtype) -> np.ndarray:
  return np.zeros((0,), dtype)


def _tokens(values, dtype) -> np.ndarray:
  """A read-only 1-D array of `values` (a record's arrays change by replacement only)."""
  array = np.array(values, dtype).reshape(-1)
  array.flags.writeable = False
  return array


def check_runnable(record: "SampleRecord", max_len: int) -> None:
  """PromptError if the record can never run in a slot of max_len tokens."""
  P = len(record.prompt)
  if P == 0:
    raise PromptError("empty prompt: a sample needs at least one prompt token")
  if record.max_new_tokens < 1:
    raise PromptError(f"max_new_tokens must be >= 1, got {record.max_new_tokens}")
  if P + record.max_new_tokens > max_len:
    raise PromptError(
        f"prompt of {P} tokens + response budget {record.max_new_tokens} exceeds the "
        f"slot capacity max_len={max_len}"
    )
  if record.finished or record.budget_left < 1:
    raise PromptError("the sample is already finished")
  if not (record.top_k >= 0 and 0 < record.top_p <= 1 and record.temperature >= 0):
    raise PromptError(
        f"bad sampling params temperature={record.temperature} "
        f"top_k={record.top_k} top_p={record.top_p}"
    )


def given_tokens(record: "SampleRecord", tokens) -> np.ndarray:
  """`tokens` as int32 [n], if a held record has room for them and one more drawn token
  (an engine's extend); ValueError otherwise."""
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  if record.budget_left < len(tokens) + 1:
    raise ValueError(
        f"{len(tokens)} given tokens leave no room in the sample's budget "
        f"({record.budget_left} tokens left)"
    )
  return tokens


class TransitionError(RuntimeError):
  """A transition asked of a record in a state it cannot leave that way (a bug of the
  caller's: the message names the transition and the state)."""


@dataclasses.dataclass(eq=False, frozen=True)  # an entity: equal only to itself, hashable
class SampleRecord:
  prompt: np.ndarray  # int32 [P]
  max_new_tokens: int  # the response budget, shared by all segments
  rng: np.ndarray  # uint32 [2], the sample's own key
  temperature: float = RolloutSettings.temperature  # 0 = greedy
  top_k: int = RolloutSettings.top_k  # 0 = off
  top_p: float = RolloutSettings.top_p  # 1 = off
  response: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.int32))
  logprobs: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.float32))
  versions: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.int32))
  kv_k: np.ndarray | None = None  # [L, <= P+R-1, K, H] when snapshotted with KV
  kv_v: np.ndarray | None = None
  kv_version: int | None = None  # the oldest policy version in kv_k / kv_v
  # A Qwen3-MoE model's experts at positions 0 .. n-1 (n <= P+R-1: those whose forward
  # pass ran), uint8 [n, Ls, k], moe.UNRECORDED where not known: routing replay's input.
  routes: np.ndarray | None = None
  finish_reason: str | None = None  # "stop", "length", or None while unfinished
  # The caller's fields (JSON in checkpoints):
  group_id: int | None = None  # the prompt group it belongs to (rollout/group.py)
  index: int = 0  # its place in its group, or in the caller's list of prompts
  cuts: int = 0  # times a step's end cut it unfinished
  restarts: int = 0  # times it started over from its prompt (staleness)
  home_shard: int | None = None  # the slot shard it was snapshotted from (several shards)
  error: str | None = None  # why it was rejected
  episode: Episode | None = None  # with an environment: its episode
  # LIVE, HELD or KEPT while an engine has it (the engine sets it); else None.
  engine_status: Status | None = dataclasses.field(default=None, repr=False)

  def __post_init__(self):
    self._set(prompt=_tokens(self.prompt, np.int32), rng=_tokens(self.rng, np.uint32).reshape(2))
    self._set_tokens(self.response, self.logprobs, self.versions)

  def _set(self, **fields) -> None:
    for name, value in fields.items():
      object.__setattr__(self, name, value)

  def _set_tokens(self, response, logprobs, versions) -> None:
    response, logprobs = _tokens(response, np.int32), _tokens(logprobs, np.float32)
    versions = _tokens(versions, np.int32)
    if not len(response) == len(logprobs) == len(versions):
      raise ValueError("response, logprobs and versions must have one entry per token")
    self._set(response=response, logprobs=logprobs, versions=versions)

  def _expect(self, transition: str, *states: Status) -> None:
    if self.status not in states:
      raise TransitionError(
          f"{transition}: the sample is {self.status.value}, not "
          + " or ".join(s.value for s in states)
      )

  @property
  def status(self) -> Status:
    if self.error is not None:
      return Status.REJECTED
    if self.finish_reason is not None:
      return Status.FINISHED
    if self.engine_status is not None:
      return self.engine_status
    return Status.PARTIAL if self.started else Status.WAITING

  @property
  def finished(self) -> bool:
    """Nothing more to draw: finished, or rejected."""
    return self.status in (Status.FINISHED, Status.REJECTED)

  @property
  def started(self) -> bool:
    return len(self.response) > 0

  @property
  def length(self) -> int:
    """Prompt plus response tokens."""
    return len(self.prompt) + len(self.response)

  @property
  def budget_left(self) -> int:
    return self.max_new_tokens - len(self.response)

  @property
  def has_kv(self) -> bool:
    return self.kv_k is not None

  @property
  def drawn_mask(self) -> np.ndarray:
    """1.0 for each response token the model drew, 0.0 for each token it was given (its
    episode's observations): what trains."""
    mask = np.ones(len(self.response), np.float32)
    for start, end in self.episode.observations if self.episode else ():
      mask[start:end] = 0.0
    return mask

  @property
  def env_error(self) -> str | None:
    """Why its environment ended its episode early (None: it did not, or no episode)."""
    return None if self.episode is None else self.episode.error

  # ----------------------------------------------------------------- transitions
  def go_live(self) -> None:
    """An engine decodes it in a slot (admitted, or extended after a stop)."""
    self._expect("go_live", Status.WAITING, Status.PARTIAL, Status.KEPT, Status.HELD)
    self._set(engine_status=Status.LIVE)

  def hold(self) -> None:
    """Stopped at the end of a turn, it stays in its slot for its environment."""
    self._expect("hold", Status.LIVE)
    self._set(engine_status=Status.HELD)

  def keep(self, kv_version: int) -> None:
    """Out of its slot, its KV (of `kv_version`) kept in the pool's pages."""
    self._expect("keep", Status.LIVE, Status.HELD)
    self._set(engine_status=Status.KEPT, kv_version=int(kv_version))

  def leave_engine(self) -> None:
    """No engine has it any more (its slot or its kept pages let go); a no-op for a
    record the engine no longer marks."""
    if self.engine_status is not None:
      self._set(engine_status=None)

  def read_back(self, response, logprobs, versions) -> None:
    """Its tokens as the slot holds them: what it had, then what it drew since."""
    self._expect("read_back", Status.LIVE, Status.HELD)
    response = np.asarray(response, np.int32)
    if len(response) < len(self.response) or not np.array_equal(
        response[: len(self.response)], self.response
    ):
      raise TransitionError("read_back: the slot's tokens do not extend the sample's")
    self._set_tokens(response, logprobs, versions)

  def give(self, tokens, version: int) -> None:
    """Tokens it is given rather than draws (an environment's observation) join its
    response: logprob 0, tagged `version`."""
    self._expect("give", Status.WAITING, Status.PARTIAL, Status.KEPT, Status.HELD)
    tokens = _tokens(tokens, np.int32)
    self._set_tokens(
        np.concatenate([self.response, tokens]),
        np.concatenate([self.logprobs, np.zeros(len(tokens), np.float32)]),
        np.concatenate([self.versions, np.full(len(tokens), version, np.int32)]),
    )

  def finish(self, reason: str) -> None:
    """Nothing more to draw: "stop" (a stop token, or its episode ended) or "length"."""
    if reason not in ("stop", "length"):
      raise ValueError(f"a sample finishes with 'stop' or 'length', not {reason!r}")
    self._expect("finish", Status.WAITING, Status.PARTIAL, Status.KEPT, Status.LIVE, Status.HELD)
    self._set(finish_reason=reason)

  def reject(self, why: str) -> None:
    """The sample cannot run: it is done, with an empty response and the reason."""
    self._set(error=str(why))

  def set_kv(self, kv_k: np.ndarray, kv_v: np.ndarray, kv_version: int | None) -> None:
    """Its KV on the host (read out of its slot or pages, or from a checkpoint)."""
    self._set(kv_k=kv_k, kv_v=kv_v, kv_version=None if kv_version is None else int(kv_version))

  def set_kv_version(self, kv_version: int) -> None:
    """The oldest policy version among its KV entries, as its slot holds them."""
    self._set(kv_version=int(kv_version))

  def add_routes(self, routes: np.ndarray) -> None:
    """Routes a slot recorded for positions 0 .. len(routes)-1 (slot_ops.extract_routes):
    the ones it lacks join it; the ones it has stay (recorded when their tokens were
    drawn, before any recompute)."""
    routes = np.asarray(routes, np.uint8)
    have = 0 if self.routes is None else len(self.routes)
    if have >= len(routes):
      return
    kept = routes if self.routes is None else np.concatenate([self.routes, routes[have:]])
    kept.flags.writeable = False
    self._set(routes=kept)

  def drop_kv(self) -> None:
    self._set(kv_k=None, kv_v=None, kv_version=None)

  def place(self, shard: int) -> None:
    """The slot shard it was in (a resumed run places it alike)."""
    self._set(home_shard=int(shard))

  def count_cut(self) -> None:
    """A step's end cut it unfinished."""
    self._expect("count_cut", Status.PARTIAL, Status.KEPT)
    self._set(cuts=self.cuts + 1)

  def set_prompt(self, prompt) -> None:
    """Its prompt, before it starts (an environment's reset rendered it)."""
    if self.started:
      raise TransitionError("set_prompt: the sample has started; its prompt is fixed")
    self._set(prompt=_tokens(prompt, np.int32), routes=None)  # the old prompt's routes go

  def set_episode(self, episode: Episode | None) -> None:
    """Its episode as its environment left it (episode_state.py)."""
    self._set(episode=episode)

  def host_bytes(self) -> int:
    arrays = [self.prompt, self.rng, self.response, self.logprobs, self.versions]
    arrays += [a for a in (self.kv_k, self.kv_v, self.routes) if a is not None]
    return sum(a.nbytes for a in arrays)

  def to_json(self) -> dict:
    """Every field but the arrays (prompt, rng, response, logprobs, versions, KV,
    routes), as JSON; `has_kv` and `has_routes` say whether KV and routes go with it."""
    return {
        "max_new_tokens": self.max_new_tokens,
        "temperature": self.temperature,
        "top_k": self.top_k,
        "top_p": self.top_p,
        "finish_reason": self.finish_reason,
        "has_kv": self.has_kv,
        "has_routes": self.routes is not None,
        "kv_version": self.kv_version,
        **{name: getattr(self, name) for name in _CALLER_FIELDS},
        "episode": None if self.episode is None else self.episode.to_json(),
    }

  @staticmethod
  def fields_from_json(d: dict) -> dict[str, Any]:
    """The keyword arguments of a record saved by `to_json` (arrays apart), or by
    earlier versions, which kept the caller's fields in one untyped `meta` dict."""
    unknown = set(d) - _SAVED_NAMES
    if unknown:
      raise ValueError(f"a saved sample has fields this version does not know: {sorted(unknown)}")
    out = {k: d[k] for k in ("max_new_tokens", "temperature", "top_k", "top_p")}
    out["finish_reason"] = d.get("finish_reason")
    fields = _from_meta(d["meta"]) if "meta" in d else d
    out.update({name: fields[name] for name in _CALLER_FIELDS if name in fields})
    episode = fields.get("episode")
    out["episode"] = Episode.from_json(episode) if isinstance(episode, dict) else episode
    if out["finish_reason"] == "rejected":  # earlier versions marked a rejection so
      out["finish_reason"], out["error"] = None, out.get("error") or "rejected"
    return out


_CALLER_FIELDS = ("group_id", "index", "cuts", "restarts", "home_shard", "error")
# What `to_json` writes (and "meta", where earlier versions kept the caller's fields).
_SAVED_NAMES = frozenset({
    "max_new_tokens", "temperature", "top_k", "top_p", "finish_reason", "has_kv",
    "has_routes", "kv_version", "episode", "meta", *_CALLER_FIELDS,
})  # fmt: skip


def _from_meta(meta: dict) -> dict[str, Any]:
  """The named fields of an earlier version's `meta` dict."""
  unknown = set(meta) - set(_META_NAMES) - {"env", "turns", "obs", "env_reward", "env_error"}
  if unknown:
    raise ValueError(f"a saved sample has fields this version does not know: {sorted(unknown)}")
  out = {name: meta[old] for old, name in _META_NAMES.items() if old in meta}
  if "env" in meta or "env_error" in meta:
    out["episode"] = Episode(
        state=meta.get("env"),
        turns=meta.get("turns", 0),
        observations=[list(span) for span in meta.get("obs", [])],
        reward=meta.get("env_reward"),
        error=meta.get("env_error"),
    )
  return out


_META_NAMES = {
    "group": "group_id",
    "index": "index",
    "cuts": "cuts",
    "restarts": "restarts",
    "shard": "home_shard",
    "error": "error",
}
