"""Padded lengths: one rule for every program that pads a sequence to a fixed length.

A length n is padded to the first of min_bucket * 2^i that holds it, capped at `cap`, so
a run compiles one program per bucket: log2(cap / min_bucket) + 1 of them at most. The
sampler pads prefills and KV copies with it, the learner its training rows.
"""

from __future__ import annotations


def bucket(n: int, min_bucket: int, cap: int) -> int:
  """The padded length of n: min_bucket * 2^i >= n, at most cap."""
  b = min_bucket
  while b < n:
    b *= 2
  return min(b, cap)


def all_buckets(min_bucket: int, cap: int) -> list[int]:
  """Every padded length `bucket` gives for 1 <= n <= cap, ascending."""
  out = [min(min_bucket, cap)]
  while out[-1] < cap:
    out.append(min(out[-1] * 2, cap))
  return out
