"""SampleRecords as slot rows: what an insert or a rewrite writes into the slot state,
built on the host in numpy (one device call for up to W records)."""

from __future__ import annotations

import numpy as np

from april_jax.sampler.records import SampleRecord
from april_jax.sampler.state import SlotRows


def kv_version_of(record: SampleRecord) -> int:
  """The oldest version in a record's host KV (its oldest token's, if not recorded)."""
  if record.kv_version is not None:
    return record.kv_version
  return int(record.versions.min()) if record.started else 0


def kv_positions(record: SampleRecord) -> int:
  """Positions of a record's host KV (fewer than length - 1 when the tokens it was
  given last have not been fed yet)."""
  return record.kv_k.shape[1]


def rows_from_records(
    records: list[SampleRecord],
    width: int,
    max_len: int,
    kv_versions: list[int],
    lengths: list[int] | None = None,
) -> SlotRows:
  """The slot rows of up to `width` records (fresh, partial or recomputed alike), padded
  to `width` with inert rows; numpy, for one insert call. `lengths`: where each slot's
  decoding stands (default: the record's length, all its KV in place); the record's
  tokens past it are given (forced_end, state.py)."""
  W, M = width, max_len
  tokens, logprobs = np.zeros((W, M), np.int32), np.zeros((W, M), np.float32)
  versions = np.full((W, M), -1, np.int32)
  ints = np.zeros((6, W), np.int32)  # length, prompt_len, kv_version, limit, top_k, forced_end
  temperature, top_p = np.zeros(W, np.float32), np.ones(W, np.float32)
  rng = np.zeros((W, 2), np.uint32)
  if lengths is None:
    lengths = [r.length for r in records]
  for j, (r, kv_version, length) in enumerate(zip(records, kv_versions, lengths)):
    P = len(r.prompt)
    tokens[j, : r.length] = np.concatenate([r.prompt, r.response])
    logprobs[j, P : r.length], versions[j, P : r.length] = r.logprobs, r.versions
    ints[:, j] = (length, P, kv_version, P + r.max_new_tokens, r.top_k, r.length)
    temperature[j], top_p[j], rng[j] = r.temperature, r.top_p, r.rng
  return SlotRows(
      tokens=tokens,
      logprobs=logprobs,
      versions=versions,
      length=ints[0],
      prompt_len=ints[1],
      kv_version=ints[2],
      limit=ints[3],
      forced_end=ints[5],
      temperature=temperature,
      top_k=ints[4],
      top_p=top_p,
      rng=rng,
  )
