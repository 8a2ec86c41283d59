"""Samples on the host: requests not started, partial samples, finished samples.

A `SampleRecord` is what leaves a slot and what goes back into one. Its response so
far carries, token by token, the behavior logprob and a version tag: the oldest
policy version that token's forward pass saw (the drawing params, or older params
whose KV it attended to; see state.py). A partial snapshotted in mode `kv` also keeps
its KV cache for the used length only (positions 0 .. prompt+response-2: the last
token is pending), with `kv_version`, the oldest version among those KV entries. A
sample cut while tokens it was given (an environment's observation) were still being
fed has KV for fewer positions; the rest are fed when it resumes (rows.kv_positions).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


class PromptError(ValueError):
  """A request the sampler cannot run (empty prompt, prompt too long for a slot, ...)."""


def _empty(dtype) -> np.ndarray:
  return np.zeros((0,), dtype)


@dataclasses.dataclass
class SampleRecord:
  prompt: np.ndarray  # int32 [P]
  max_new_tokens: int  # the response budget, shared by all segments
  rng: np.ndarray  # uint32 [2], the sample's own key
  temperature: float = 1.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off
  response: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.int32))
  logprobs: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.float32))
  versions: np.ndarray = dataclasses.field(default_factory=lambda: _empty(np.int32))
  kv_k: np.ndarray | None = None  # [L, <= P+R-1, K, H] when snapshotted with KV
  kv_v: np.ndarray | None = None
  kv_version: int | None = None  # the oldest policy version in kv_k / kv_v
  finish_reason: str | None = None  # "stop", "length", or None while unfinished
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # the caller's ids

  def __post_init__(self):
    self.prompt = np.asarray(self.prompt, np.int32).reshape(-1)
    self.rng = np.asarray(self.rng, np.uint32).reshape(2)
    self.response = np.asarray(self.response, np.int32).reshape(-1)
    self.logprobs = np.asarray(self.logprobs, np.float32).reshape(-1)
    self.versions = np.asarray(self.versions, np.int32).reshape(-1)
    if not len(self.response) == len(self.logprobs) == len(self.versions):
      raise ValueError("response, logprobs and versions must have one entry per token")

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None

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

  def drop_kv(self) -> None:
    self.kv_k = self.kv_v = self.kv_version = None

  def host_bytes(self) -> int:
    arrays = [self.prompt, self.rng, self.response, self.logprobs, self.versions]
    arrays += [a for a in (self.kv_k, self.kv_v) if a is not None]
    return sum(a.nbytes for a in arrays)
