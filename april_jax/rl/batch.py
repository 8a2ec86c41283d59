"""From trained groups to the arrays the jitted update eats.

Every sample becomes one row: prompt then response, right-padded to a bucketed length T
(so a run compiles a handful of shapes). Arrays are indexed by position t, which predicts
token t+1; a row's response occupies t in [P-1, P+R-2]:

  tokens_BxT        input tokens
  targets_BxT       tokens shifted left (the token predicted at t)
  mask_BxT          1 where targets is a response token the model drew (not an
                    environment's observation)
  behavior_BxT      the sampler's recorded logprob of that token (temperature-scaled)
  stale_BxT         True where the token was drawn by a policy older than the current one
  routes            a Qwen3-MoE rollout's experts at position t in every sparse layer,
                    [B, T, Ls, k] uint8 (moe.UNRECORDED where not recorded): routing
                    replay's input
  advantages_B      per sample (or [B, T] per token), derived by the learner

`TrainBatch` holds a step's rows with its rewards, built once and read-only.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from april_jax import buckets
from april_jax.models import moe
from april_jax.rl import advantages as advantages_lib
from april_jax.rollout.group import Group


def bucket_len(n: int, min_bucket: int = 32, max_len: int | None = None) -> int:
  """A training row's padded length (buckets.py), capped at max_len rounded up to a
  multiple of 8."""
  return buckets.bucket(n, min_bucket, sys.maxsize if max_len is None else _cap(max_len))


def all_bucket_lens(max_len: int, min_bucket: int = 32) -> list[int]:
  """Every padded length a TrainBatch can have for sequences up to max_len."""
  return buckets.all_buckets(min_bucket, _cap(max_len))


def _cap(max_len: int) -> int:
  return -(-max_len // 8) * 8


def row_lengths(mask_BxT: np.ndarray) -> np.ndarray:
  """Tokens each row needs: through the target of its last masked position (1 if none),
  at most the row's T (a target at T - 1 is the row's own, read from `targets`)."""
  mask_BxT = np.asarray(mask_BxT) > 0
  T = mask_BxT.shape[1]
  last = T - 1 - np.argmax(mask_BxT[:, ::-1], axis=1)
  return np.where(mask_BxT.any(axis=1), np.minimum(last + 2, T), 1)


def microbatches(
    mask_BxT: np.ndarray, parts: int, by_length: bool, min_bucket: int = 32
) -> list[tuple[np.ndarray, int]]:
  """How one minibatch [B, T] splits into `parts` microbatches: [(rows [m, B // parts], T')].

  Plain: one entry, rows in order, every microbatch at the batch's T (one fused call).
  By length: rows sorted by length, one entry per microbatch, each cut to the bucket of its
  longest row, so short rows stop paying for the long tail's padding. Either way every row
  is in exactly one microbatch and no response token is cut off.
  """
  B, T = np.shape(mask_BxT)
  if not by_length or parts == 1:
    return [(np.arange(B).reshape(parts, -1), T)]
  lengths = row_lengths(mask_BxT)
  order = np.argsort(lengths, kind="stable").reshape(parts, -1)
  return [(rows[None], bucket_len(int(lengths[rows].max()), min_bucket, T)) for rows in order]


def shaped_rewards(groups: list[Group], train_cfg, max_response_len: int) -> np.ndarray:
  """Rewards [G, n], with DAPO's overlong penalty (counted in tokens) when enabled."""
  rewards = np.array([g.rewards for g in groups], np.float32)
  buffer_len = train_cfg.overlong_buffer_len if train_cfg is not None else 0
  if buffer_len:
    lengths = np.array([[len(s.response) for s in g.samples] for g in groups], np.float32)
    penalty = advantages_lib.overlong_penalty(
        lengths.reshape(-1), max_response_len, buffer_len, train_cfg.overlong_penalty_factor
    )
    rewards = rewards + np.asarray(penalty).reshape(rewards.shape)
  return rewards


def _rows(groups: list[Group], version: int, pad_id: int, min_bucket: int, max_len) -> dict:
  """The row arrays of a step's samples, one row each (see the module docstring)."""
  samples = [s for g in groups for s in g.samples]
  B = len(samples)
  T = bucket_len(max(s.length for s in samples), min_bucket, max_len)
  tokens = np.full((B, T), pad_id, np.int32)
  mask = np.zeros((B, T), np.float32)
  behavior = np.zeros((B, T), np.float32)
  stale = np.zeros((B, T), bool)
  for b, s in enumerate(samples):
    P, R = len(s.prompt), len(s.response)
    tokens[b, :P] = s.prompt
    tokens[b, P : P + R] = s.response
    mask[b, P - 1 : P + R - 1] = s.drawn_mask  # observations are given, not drawn
    behavior[b, P - 1 : P + R - 1] = s.logprobs
    stale[b, P - 1 : P + R - 1] = s.versions < version
  targets = np.concatenate([tokens[:, 1:], np.full((B, 1), pad_id, np.int32)], axis=1)
  return {"tokens": tokens, "targets": targets, "mask": mask, "behavior": behavior, "stale": stale}


def _routes(samples, T: int, route_shape: tuple[int, int]) -> np.ndarray:
  """The samples' recorded routes as rows [B, T, Ls, k], UNRECORDED where a sample has
  none (positions past its record, or a record from before routes were kept)."""
  routes = np.full((len(samples), T) + tuple(route_shape), moe.UNRECORDED, np.uint8)
  for b, s in enumerate(samples):
    if s.routes is not None:
      n = min(len(s.routes), T)
      routes[b, :n] = s.routes[:n]
  return routes


ROW_KEYS = ("tokens", "targets", "mask", "behavior", "stale")


@dataclasses.dataclass(frozen=True, eq=False)
class TrainBatch:
  """One RL step's training data, built once from its groups (`from_groups`) and never
  changed: its arrays are read-only. The learner (rl/learn.py) reads it; what it derives
  (old logprobs, importance weights, advantages) it keeps apart.

  tokens, targets, mask, behavior, stale   [B, T], B = G x n rows in group order
  rewards    [G, n] float32, DAPO's overlong penalty added where the config asks
  lengths    [G, n] float32, each sample's drawn (trained) response tokens
  version    the policy version this batch trains (tokens drawn before it are stale)
  routes     [B, T, Ls, k] uint8 of a Qwen3-MoE model's rollout, else None
  """

  tokens: np.ndarray
  targets: np.ndarray
  mask: np.ndarray
  behavior: np.ndarray
  stale: np.ndarray
  rewards: np.ndarray
  lengths: np.ndarray
  version: int
  routes: np.ndarray | None = None

  def __post_init__(self):
    B, T = self.tokens.shape
    for name in ROW_KEYS:
      if getattr(self, name).shape != (B, T):
        raise ValueError(f"TrainBatch.{name} is {getattr(self, name).shape}, not [B, T] = {(B, T)}")
    if self.routes is not None:
      if self.routes.shape[:2] != (B, T) or self.routes.ndim != 4:
        raise ValueError(f"TrainBatch.routes is {self.routes.shape}, not [B, T, Ls, k]")
      routes = np.array(self.routes, np.uint8)
      routes.flags.writeable = False
      object.__setattr__(self, "routes", routes)
    for name in ("rewards", "lengths"):
      x = getattr(self, name)
      if x.ndim != 2 or x.size != B:
        raise ValueError(f"TrainBatch.{name} is {x.shape}, not [G, n] with G x n = {B} rows")
    for name in ROW_KEYS + ("rewards", "lengths"):
      frozen = np.array(getattr(self, name))  # a copy of its own, so no caller can write it
      frozen.flags.writeable = False
      object.__setattr__(self, name, frozen)

  @classmethod
  def from_groups(
      cls,
      groups: list[Group],
      version: int,
      *,
      pad_id: int = 0,
      min_bucket: int = 32,
      max_len: int | None = None,
      train=None,
      max_response_len: int = 0,
      route_shape: tuple[int, int] | None = None,
  ) -> "TrainBatch":
    """The batch of a step's groups, trained at `version`; T is bucketed (<= max_len, the
    longest prompt + response). With `train` (the config's train section), rewards carry
    its overlong penalty over max_response_len. route_shape: a Qwen3-MoE model's
    (Qwen3Config.route_shape): the samples' recorded routes become `routes`."""
    unscored = [g.group_id for g in groups if not g.scored]
    if unscored:
      raise ValueError(
          f"a TrainBatch is built from scored groups; groups {unscored} have no rewards"
      )
    lengths = [[s.drawn_mask.sum() for s in g.samples] for g in groups]
    rows = _rows(groups, version, pad_id, min_bucket, max_len)
    routes = None
    if route_shape is not None:
      samples = [s for g in groups for s in g.samples]
      routes = _routes(samples, rows["tokens"].shape[1], route_shape)
    return cls(
        **rows,
        rewards=shaped_rewards(groups, train, max_response_len),
        lengths=np.array(lengths, np.float32),
        version=int(version),
        routes=routes,
    )

  @property
  def nbytes(self) -> int:
    """The bytes of its arrays."""
    routes = 0 if self.routes is None else int(self.routes.nbytes)
    return routes + sum(int(getattr(self, k).nbytes) for k in ROW_KEYS + ("rewards", "lengths"))

  def rows(self) -> dict[str, np.ndarray]:
    """The [B, T] arrays by name (and routes [B, T, Ls, k] where recorded), as the
    layout and the learner's passes read them."""
    rows = {k: getattr(self, k) for k in ROW_KEYS}
    return rows if self.routes is None else dict(rows, routes=self.routes)

  def with_advantages(self, advantages) -> dict[str, np.ndarray]:
    """The rows with per-sample [B] (or per-token [B, T]) advantages: what
    Learner.update trains on when advantages are given."""
    adv = np.asarray(advantages, np.float32)
    return dict(self.rows(), advantages=adv.reshape(-1) if adv.size == len(self.tokens) else adv)
