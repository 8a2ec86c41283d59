"""SampleRecords as slot rows: what an insert or a rewrite writes into the slot state.

Built on the host in numpy for one device call of up to W records, and sent as two int32
arrays (PackedRows: the per-position fields [W, 3, M] and the per-slot ones [W, 11],
float32 and uint32 fields as their bits, each at the columns SEQ and VALS name) rather than one array per SlotRows field:
every array a call takes from the host is a transfer of its own, and an insert runs at
each refill. `unpack` turns them back into SlotRows inside the device call.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from april_jax.sampler.records import SampleRecord
from april_jax.sampler.state import SlotRows

# PackedRows.vals, per slot: each field's columns (float32 fields as their bits; rng is
# the key's two words). Defined once: the host packs by these names, the device unpacks.
_INTS = ("length", "prompt_len", "kv_version", "limit", "forced_end", "top_k", "group")
_FLOATS = ("temperature", "top_p")
VALS = {name: slice(i, i + 1) for i, name in enumerate(_INTS + _FLOATS)}
VALS["rng"] = slice(len(VALS), len(VALS) + 2)
NUM_VALS = VALS["rng"].stop
# PackedRows.seq, per position: tokens, versions, logprobs (float32 bits)
SEQ = {"tokens": 0, "versions": 1, "logprobs": 2}

# What extract_rows reads back of each slot besides its sequences, one int32 column each
# of its [W, 4] array (slot_ops.extract_rows builds it in this order).
READOUT = ("length", "prompt_len", "kv_version", "forced_end")


@flax.struct.dataclass
class PackedRows:
  """W slots' rows as one insert or write_rows call takes them from the host."""

  seq: jax.Array  # int32 [W, 3, M]: SEQ
  vals: jax.Array  # int32 [W, NUM_VALS]: VALS


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
) -> PackedRows:
  """The slot rows of up to `width` records (fresh, partial or recomputed alike), padded
  to `width` with inert rows; numpy, for one insert call. `lengths`: where each slot's
  decoding stands (default: the record's length, all its KV in place); the record's
  tokens past it are given (forced_end, state.py)."""
  W, M = width, max_len
  seq = np.zeros((W, len(SEQ), M), np.int32)
  tokens, versions = seq[:, SEQ["tokens"]], seq[:, SEQ["versions"]]
  versions[:] = -1  # -1 for prompt tokens and padding
  logprobs = seq[:, SEQ["logprobs"]].view(np.float32)  # writes through (0 is 0.0)
  vals = np.zeros((W, NUM_VALS), np.int32)
  col = lambda name: vals[:, VALS[name]]
  float_col = lambda name: vals[:, VALS[name]].view(np.float32)  # writes through
  float_col("top_p")[:] = 1.0  # off
  if lengths is None:
    lengths = [r.length for r in records]
  for j, (r, kv_version, length) in enumerate(zip(records, kv_versions, lengths)):
    P = len(r.prompt)
    tokens[j, : r.length] = np.concatenate([r.prompt, r.response])
    versions[j, P : r.length], logprobs[j, P : r.length] = r.versions, r.logprobs
    # The group's id as an int32 (ids past 2^31 wrap: only speculation reads it, to find
    # a slot's group, and a rare collision only makes a draft less likely right).
    group = -1 if r.group_id is None else r.group_id & 0x7FFFFFFF
    fields = dict(length=length, prompt_len=P, kv_version=kv_version, top_k=r.top_k, group=group)
    fields.update(limit=P + r.max_new_tokens, forced_end=r.length)
    for name, value in fields.items():
      col(name)[j] = value
    float_col("temperature")[j], float_col("top_p")[j] = r.temperature, r.top_p
    col("rng")[j] = np.asarray(r.rng, np.uint32).view(np.int32)
  return PackedRows(seq=seq, vals=vals)


def unpack(rows: PackedRows) -> SlotRows:
  """PackedRows as SlotRows (inside a device call)."""
  seq, vals = rows.seq, rows.vals
  as_f32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)
  col = lambda name: vals[:, VALS[name]][:, 0]
  return SlotRows(
      tokens=seq[:, SEQ["tokens"]],
      versions=seq[:, SEQ["versions"]],
      logprobs=as_f32(seq[:, SEQ["logprobs"]]),
      temperature=as_f32(col("temperature")),
      top_p=as_f32(col("top_p")),
      rng=jax.lax.bitcast_convert_type(vals[:, VALS["rng"]], jnp.uint32),
      **{name: col(name) for name in _INTS},
  )


def readout(meta: np.ndarray) -> dict[str, np.ndarray]:
  """extract_rows' [W, len(READOUT)] array as its named columns (host side)."""
  return {name: meta[:, i] for i, name in enumerate(READOUT)}
