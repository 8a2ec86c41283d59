"""The partial buffer: every group admitted but not yet trained or rejected.

FIFO by first admission, whole groups: finished siblings with their rewards, partial
samples (tokens, logprobs, versions, rng, a Qwen3-MoE rollout's routes, and in mode kv
the used KV), never-started samples, and surplus complete groups. The scheduler drains it before fresh prompts.

`to_state()` turns it into flat numpy arrays plus one JSON string (ragged fields are
concatenated with offsets), which a checkpoint stores as is; `from_state()` rebuilds it
exactly, KV included. A buffer saved by an earlier version, whose samples kept their
fields in an untyped `meta` dict, is read into the named fields
(SampleRecord.fields_from_json).
"""

from __future__ import annotations

import json
from typing import Iterator

import numpy as np

from april_jax.rollout.group import Group
from april_jax.sampler import SampleRecord


class PartialBuffer:
  """Groups keyed by group_id, iterated oldest first."""

  def __init__(self):
    self._groups: dict[int, Group] = {}

  def __len__(self) -> int:
    return len(self._groups)

  def __iter__(self) -> Iterator[Group]:
    return iter(sorted(self._groups.values(), key=lambda g: g.group_id))

  def __contains__(self, group_id: int) -> bool:
    return group_id in self._groups

  def add(self, group: Group) -> None:
    self._groups[group.group_id] = group

  def get(self, group_id: int) -> Group:
    return self._groups[group_id]

  def pop(self, group_id: int) -> Group:
    return self._groups.pop(group_id)

  def host_bytes(self) -> int:
    return sum(g.host_bytes() for g in self._groups.values())

  # ------------------------------------------------------------------ serialisation
  @staticmethod
  def groups_in(state: dict[str, np.ndarray]) -> int:
    """How many groups a `to_state` holds (without rebuilding them)."""
    if "meta_json" not in state or not state["meta_json"].size:
      return 0
    return len(json.loads(np.asarray(state["meta_json"], np.uint8).tobytes().decode()))

  def to_state(self) -> dict[str, np.ndarray]:
    groups = list(self)
    samples = [s for g in groups for s in g.samples]
    kv_samples = [s for s in samples if s.has_kv]
    meta = [
        {
            "group_id": g.group_id,
            "prompt_id": g.prompt_id,
            "answer": g.answer,
            "first_step": g.first_step,
            "rewards": g.rewards,
            "reward_info": g.reward_info,
            "row": g.row,
            "samples": [s.to_json() for s in g.samples],
        }
        for g in groups
    ]
    cat = lambda arrays, dtype: (
        np.concatenate(arrays).astype(dtype) if arrays else np.zeros((0,), dtype)
    )
    offsets = lambda arrays: np.cumsum([0] + [len(a) for a in arrays]).astype(np.int64)
    state = {
        "meta_json": np.frombuffer(json.dumps(meta).encode(), np.uint8).copy(),
        "prompts": cat([g.prompt for g in groups], np.int32),
        "prompt_offsets": offsets([g.prompt for g in groups]),
        "responses": cat([s.response for s in samples], np.int32),
        "logprobs": cat([s.logprobs for s in samples], np.float32),
        "versions": cat([s.versions for s in samples], np.int32),
        "response_offsets": offsets([s.response for s in samples]),
        "rngs": (np.stack([s.rng for s in samples]) if samples else np.zeros((0, 2), np.uint32)),
        "kv_offsets": offsets([s.kv_k[0] for s in kv_samples]),
    }
    if kv_samples:
      state["kv_k"] = np.concatenate([s.kv_k for s in kv_samples], axis=1)
      state["kv_v"] = np.concatenate([s.kv_v for s in kv_samples], axis=1)
    routed = [s.routes for s in samples if s.routes is not None]
    if routed:  # [positions, Ls, k] each, concatenated
      state["route_offsets"] = offsets(routed)
      state["routes"] = np.concatenate(routed).astype(np.uint8)
    return state

  @classmethod
  def from_state(cls, state: dict[str, np.ndarray]) -> "PartialBuffer":
    meta = json.loads(np.asarray(state["meta_json"], np.uint8).tobytes().decode())
    buffer = cls()
    po, ro, ko = state["prompt_offsets"], state["response_offsets"], state["kv_offsets"]
    sample_i = kv_i = route_i = 0
    for gi, gm in enumerate(meta):
      prompt = np.asarray(state["prompts"][po[gi] : po[gi + 1]], np.int32)
      samples = []
      for sm in gm["samples"]:
        sl = slice(ro[sample_i], ro[sample_i + 1])
        record = SampleRecord(
            prompt=prompt,
            rng=state["rngs"][sample_i],
            response=state["responses"][sl],
            logprobs=state["logprobs"][sl],
            versions=state["versions"][sl],
            **SampleRecord.fields_from_json(sm),
        )
        if sm["has_kv"]:
          kv = slice(ko[kv_i], ko[kv_i + 1])
          kv_k, kv_v = np.asarray(state["kv_k"][:, kv]), np.asarray(state["kv_v"][:, kv])
          record.set_kv(kv_k, kv_v, sm.get("kv_version"))
          kv_i += 1
        if sm.get("has_routes"):
          at = state["route_offsets"]
          record.add_routes(np.asarray(state["routes"][at[route_i] : at[route_i + 1]]))
          route_i += 1
        samples.append(record)
        sample_i += 1
      buffer.add(
          Group(
              group_id=gm["group_id"],
              prompt_id=gm["prompt_id"],
              prompt=prompt,
              answer=gm["answer"],
              samples=samples,
              first_step=gm["first_step"],
              rewards=gm["rewards"],
              reward_info=gm["reward_info"],
              row=gm.get("row", {}),
          )
      )
    return buffer
