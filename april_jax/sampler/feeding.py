"""How a step's given tokens are split into feed calls (slot_ops.feed), on the host.

A slot that was given tokens (an environment's observation, or a resumed sample's tokens
past its KV) stands at `at` (its pending token at at - 1) and must reach `end`. The calls
that take it there write at most `feed_len` tokens a slot each. Slots whose next piece
falls in one length bucket share a call, `width` at most, in rows of a power of two: a
call computes at most twice its work, and a run compiles one program per (bucket, rows).
"""

from __future__ import annotations

from typing import Callable


def rows(slots: int, width: int) -> int:
  """Rows of a feed call of `slots` slots: the power of two that holds them, at most
  `width` (insert_width)."""
  return min(width, 1 << (slots - 1).bit_length())


def calls(
    todo: dict[int, tuple[int, int]], feed_len: int, bucket: Callable[[int], int], width: int
) -> list[tuple[int, list[tuple[int, int]]]]:
  """The feed calls that take each slot from `at` to `end` (todo: slot -> (at, end)), in
  order: (length bucket T, [(slot, where it stands after the call)]). A slot's pieces
  come in order, one per round."""
  at = {slot: start for slot, (start, _) in todo.items()}
  out = []
  while any(at[s] < end for s, (_, end) in todo.items()):
    by_bucket: dict[int, list[tuple[int, int]]] = {}
    for slot, (_, end) in sorted(todo.items()):
      if at[slot] < end:
        piece = min(end - at[slot], feed_len)
        by_bucket.setdefault(bucket(piece), []).append((slot, at[slot] + piece))
    for T, pieces in sorted(by_bucket.items()):
      for i in range(0, len(pieces), width):
        out.append((T, pieces[i : i + width]))
      for slot, reached in pieces:
        at[slot] = reached
  return out
