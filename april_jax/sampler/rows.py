"""SampleRecords as slot rows: what an insert or a rewrite writes into the slot state.

Built on the host in numpy for one device call of up to W records, and sent as two int32
arrays (PackedRows: the per-position fields [W, 3, M] and the per-slot ones [W, 10],
float32 and uint32 fields as their bits) rather than one array per SlotRows field:
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

# Columns of PackedRows.vals, in order (rng is two columns: the key's two words).
_VALS = ("length", "prompt_len", "kv_version", "limit", "forced_end", "top_k", "temperature")
_VALS += ("top_p", "rng")


@flax.struct.dataclass
class PackedRows:
  """W slots' rows as one insert or write_rows call takes them from the host."""

  seq: jax.Array  # int32 [W, 3, M]: tokens, versions, logprobs (float32 bits)
  vals: jax.Array  # int32 [W, 10]: _VALS (temperature, top_p: float32 bits; rng: 2 words)


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
  seq = np.zeros((W, 3, M), np.int32)
  seq[:, 1] = -1  # versions: -1 for prompt tokens and padding
  logprobs = seq[:, 2].view(np.float32)  # writes through to seq's bits (0 is 0.0)
  vals = np.zeros((W, 10), np.int32)
  floats = vals[:, 6:8].view(np.float32)  # temperature, top_p
  floats[:, 1] = 1.0  # top_p 1: off
  if lengths is None:
    lengths = [r.length for r in records]
  for j, (r, kv_version, length) in enumerate(zip(records, kv_versions, lengths)):
    P = len(r.prompt)
    seq[j, 0, : r.length] = np.concatenate([r.prompt, r.response])
    seq[j, 1, P : r.length], logprobs[j, P : r.length] = r.versions, r.logprobs
    vals[j, :6] = (length, P, kv_version, P + r.max_new_tokens, r.length, r.top_k)
    floats[j] = (r.temperature, r.top_p)
    vals[j, 8:] = np.asarray(r.rng, np.uint32).view(np.int32)
  return PackedRows(seq=seq, vals=vals)


def unpack(rows: PackedRows) -> SlotRows:
  """PackedRows as SlotRows (inside a device call)."""
  seq, vals = rows.seq, rows.vals
  as_f32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)
  col = {name: vals[:, i] for i, name in enumerate(_VALS[:6])}
  return SlotRows(
      tokens=seq[:, 0],
      versions=seq[:, 1],
      logprobs=as_f32(seq[:, 2]),
      temperature=as_f32(vals[:, 6]),
      top_p=as_f32(vals[:, 7]),
      rng=jax.lax.bitcast_convert_type(vals[:, 8:], jnp.uint32),
      **col,
  )
