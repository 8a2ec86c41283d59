"""Slot rows as an insert takes them from the host: two packed int32 arrays whose
unpacking gives back every field exactly (floats and uint32 keys travel as their bits)."""

import jax
import numpy as np

from april_jax.sampler import rows as rows_lib
from april_jax.sampler.records import SampleRecord


def _records():
  fresh = SampleRecord(
      prompt=[5, 6, 7],
      max_new_tokens=9,
      rng=[0xFFFFFFFF, 0x80000001],  # words above 2**31 - 1: signed bits on the wire
      temperature=0.7,
      top_k=20,
      top_p=0.95,
  )
  partial = SampleRecord(
      prompt=[11, 12],
      max_new_tokens=6,
      rng=[3, 4],
      temperature=0.0,
      response=[40, 41, 42],
      logprobs=[-0.125, -3.5e-8, -17.25],
      versions=[2, 2, 3],
  )
  return [fresh, partial]


def test_packed_rows_unpack_to_every_field_exactly():
  records = _records()
  W, M = 3, 10
  packed = rows_lib.rows_from_records(records, W, M, kv_versions=[7, 2], lengths=[3, 4])
  assert len(jax.tree.leaves(packed)) == 2  # two host arrays per call, not one per field
  rows = jax.tree.map(np.asarray, jax.jit(rows_lib.unpack)(packed))

  np.testing.assert_array_equal(rows.tokens[0, :3], [5, 6, 7])
  np.testing.assert_array_equal(rows.tokens[1, :5], [11, 12, 40, 41, 42])
  assert rows.logprobs.dtype == np.float32
  np.testing.assert_array_equal(rows.logprobs[1, 2:5], np.float32([-0.125, -3.5e-8, -17.25]))
  np.testing.assert_array_equal(rows.versions[1], [-1, -1, 2, 2, 3] + [-1] * 5)
  np.testing.assert_array_equal(rows.versions[0], [-1] * M)
  np.testing.assert_array_equal(rows.length, [3, 4, 0])  # where decoding stands (given)
  np.testing.assert_array_equal(rows.forced_end, [3, 5, 0])  # the record's own length
  np.testing.assert_array_equal(rows.prompt_len, [3, 2, 0])
  np.testing.assert_array_equal(rows.kv_version, [7, 2, 0])
  np.testing.assert_array_equal(rows.limit, [12, 8, 0])
  np.testing.assert_array_equal(rows.top_k, [20, 0, 0])
  np.testing.assert_array_equal(rows.temperature, np.float32([0.7, 0.0, 0.0]))
  np.testing.assert_array_equal(rows.top_p, np.float32([0.95, 1.0, 1.0]))  # padding: off
  assert rows.rng.dtype == np.uint32
  np.testing.assert_array_equal(rows.rng, np.uint32([[0xFFFFFFFF, 0x80000001], [3, 4], [0, 0]]))
