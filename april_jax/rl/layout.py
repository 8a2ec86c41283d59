"""How a minibatch's samples are laid out in the learner's gradient calls.

The host keeps a step's batch one sample a row ([B, T], rl/batch.py); the device sees it
in pieces, one gradient (or logprob) call each, whose arrays are [M, b, T']:

  unpacked  each row one sample (plain: every microbatch at the batch's T in one call;
            by length: rows sorted by length, each microbatch cut to its own bucket).
  packed    samples end to end in rows of a fixed token budget (`train.pack_len`):
            position t of row r holds token pos[r, t] of sample sample[r, t], or padding
            (sample -1). Each sample attends only to itself (its segment id, 1, 2, ... in
            its row; 0 for the padding) and its positions restart at 0, so its logprobs
            are those of its own row. Per-sample arrays (advantages [B]) become per token.

Packing fills `rows` rows of pack_len tokens per microbatch, longest samples first, each
into the first row with room (first-fit decreasing), until what is left fits one last
microbatch; that one takes the smallest shape that holds it: `rows` rows cut to one of
`pack_lengths`, or fewer rows (halved, down to the devices the rows are split over) of
pack_len (`last_shapes`). Every sample is in exactly one row, whole, so packed and unpacked give the same losses and gradients
(rl/losses.py reduces per segment). A row holds at most MAX_SEGMENTS samples.

`plan` lays a whole step's batch out, per minibatch its pieces, as the train section says
(`train_section`: the one the learner and the critic read); `layout_stats` counts what
those pieces compute.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from april_jax.models import moe
from april_jax.models.attention import MAX_SEGMENTS
from april_jax.rl import batch as batch_lib

GRANULE_PARTS = 8  # the last microbatch is cut to a multiple of pack_len / 8


@dataclasses.dataclass(frozen=True)
class Piece:
  """One call's rows: unpacked, batch rows `rows` [M, b] cut to length T; packed, the
  batch row `sample` [M, b, T] (-1: padding) and position `pos` of every slot."""

  T: int
  rows: np.ndarray | None = None
  sample: np.ndarray | None = None
  pos: np.ndarray | None = None

  @property
  def packed(self) -> bool:
    return self.sample is not None

  @property
  def batch_rows(self) -> np.ndarray:
    """The batch rows (samples) this piece holds, each once."""
    if not self.packed:
      return self.rows.reshape(-1)
    return np.unique(self.sample[self.sample >= 0])

  @property
  def padded_tokens(self) -> int:
    """Token positions the call computes."""
    return int((self.rows.size if not self.packed else self.sample[..., 0].size) * self.T)

  def run_lengths(self) -> list[int]:
    """The sequences the call's attention computes, by length: unpacked, whole rows of T;
    packed, each sample and each row's trailing padding (a run of its own)."""
    if not self.packed:
      return [self.T] * self.rows.size
    segments = self.segments().reshape(-1, self.T)
    starts = np.diff(segments, axis=1, prepend=-1) != 0
    runs = np.diff(np.append(np.flatnonzero(starts.reshape(-1)), segments.size))
    return [int(n) for n in runs]

  def gather(self, v: np.ndarray, fill=0) -> np.ndarray:
    """v [B, T0, ...] (or [B]) in this piece's layout: [M, b, T, ...] (unpacked [B] ->
    [M, b]). Packed rows' padding is `fill` (0, False)."""
    if not self.packed:
      return v[self.rows][:, :, : self.T] if v.ndim >= 2 else v[self.rows]
    live = self.sample >= 0
    s, p = np.where(live, self.sample, 0), self.pos
    out = v[s, p] if v.ndim >= 2 else v[s]
    live = live.reshape(live.shape + (1,) * (out.ndim - live.ndim))
    return np.where(live, out, np.asarray(fill, v.dtype))

  def scatter(self, out_BxT: np.ndarray, x: np.ndarray) -> None:
    """Writes x [M, b, T] (this piece's values) back into the batch layout out [B, T0]."""
    if not self.packed:
      out_BxT[self.rows, : self.T] = x
      return
    live = self.sample >= 0
    out_BxT[self.sample[live], self.pos[live]] = x[live]

  def segments(self) -> np.ndarray:
    """[M, b, T] int32: each sample's segment id in its row (1, 2, ...), 0 for padding."""
    starts = (self.pos == 0) & (self.sample >= 0)
    return np.where(self.sample >= 0, np.cumsum(starts, axis=-1), 0).astype(np.int32)

  def device_arrays(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The piece's arrays of `batch`; packed, with its segments and positions."""
    # Routes' padding is "not recorded" (padding's own experts are then its router's).
    out = {k: self.gather(v, moe.UNRECORDED if k == "routes" else 0) for k, v in batch.items()}
    if self.packed:
      out["segments"] = self.segments()
      out["positions"] = np.where(self.sample >= 0, self.pos, 0).astype(np.int32)
    return out


def pack_lengths(pack_len: int) -> list[int]:
  """Every row length a packed microbatch can have: the multiples of pack_len /
  GRANULE_PARTS (rounded up to 8) up to pack_len, so a run compiles GRANULE_PARTS of them."""
  granule = -(-pack_len // (GRANULE_PARTS * 8)) * 8
  return sorted({min(k * granule, pack_len) for k in range(1, GRANULE_PARTS + 1)})


def _first_fit(order, lengths, rows: int, cap: int):
  """Samples `order` (longest first) into `rows` rows of at most `cap` tokens, each into
  the first row with room: (the rows' samples, the samples that fit none)."""
  filled, bins, left = np.zeros(rows, np.int64), [[] for _ in range(rows)], []
  for i in order:
    room = (filled + lengths[i] <= cap) & (np.array([len(b) for b in bins]) < MAX_SEGMENTS)
    if not room.any():
      left.append(i)
      continue
    r = int(np.argmax(room))
    bins[r].append(i)
    filled[r] += lengths[i]
  return bins, left


def last_shapes(rows: int, pack_len: int, min_rows: int = 1) -> list[tuple[int, int]]:
  """The (rows, length) a packed minibatch's last microbatch may take: `rows` rows of any
  of `pack_lengths`, or fewer rows of pack_len (halved while the devices, min_rows of
  them, still split them evenly); smallest first."""
  shapes = {(rows, T) for T in pack_lengths(pack_len)}
  r = rows
  while r % 2 == 0 and r // 2 >= max(min_rows, 1) and (r // 2) % max(min_rows, 1) == 0:
    r //= 2
    shapes.add((r, pack_len))
  return sorted(shapes, key=lambda s: (s[0] * s[1], -s[0]))


def pack(lengths: np.ndarray, rows: int, pack_len: int, min_rows: int = 1):
  """Samples of `lengths` tokens into microbatches: [(each row's sample indices in order,
  the microbatch's row length)], `rows` rows each but the last (see last_shapes). Every
  sample is in exactly one row."""
  lengths = np.asarray(lengths, np.int64)
  if lengths.size and lengths.max() > pack_len:
    raise ValueError(f"a sample of {lengths.max()} tokens does not fit pack_len={pack_len}")
  left = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  out = []
  while left:
    for r, T in last_shapes(rows, pack_len, min_rows):
      if T < lengths[left[0]] or r * T < lengths[left].sum():
        continue
      bins, rest = _first_fit(left, lengths, r, T)
      if not rest:  # what is left fits one microbatch: the smallest shape that holds it
        return out + [(bins, T)]
    bins, left = _first_fit(left, lengths, rows, pack_len)
    out.append((bins, pack_len))
  return out


def packed_pieces(
    lengths: np.ndarray, rows: int, pack_len: int, batch_rows=None, min_rows: int = 1
) -> list[Piece]:
  """Pieces [1, rows', T] holding samples of `lengths` tokens, packed (`pack`): batch
  rows `batch_rows` (default 0, 1, ...)."""
  batch_rows = np.arange(len(lengths)) if batch_rows is None else np.asarray(batch_rows)
  pieces = []
  for bins, T in pack(lengths, rows, pack_len, min_rows):
    sample = np.full((1, len(bins), T), -1, np.int32)
    pos = np.zeros((1, len(bins), T), np.int32)
    for r, row in enumerate(bins):
      at = 0
      for i in row:
        n = int(lengths[i])
        sample[0, r, at : at + n], pos[0, r, at : at + n] = batch_rows[i], np.arange(n)
        at += n
    pieces.append(Piece(T=T, sample=sample, pos=pos))
  return pieces


def token_counts(pieces: list[Piece], lengths: np.ndarray) -> dict[str, float]:
  """Padded token positions the pieces compute against the real tokens they hold."""
  padded = sum(p.padded_tokens for p in pieces)
  real = int(sum(np.asarray(lengths)[p.batch_rows].sum() for p in pieces))
  return {"padded_tokens": padded, "real_tokens": real, "padded_per_real": padded / max(real, 1)}


# ------------------------------------------------------------------ a step's batch


def pack_len(train, T: int) -> int | None:
  """The packed rows' token budget for a batch of padded length T: train.pack_len, or
  T when it is 0 (a run sets it: `train_section`); None when train.packing is off."""
  if not train.packing:
    return None
  return int(train.pack_len) or int(T)


def train_section(config):
  """The train section the learner and critic read: config.train with pack_len 0
  resolved to the run's longest row (data.max_prompt_len + rollout.max_response_len,
  rounded up as rl/batch.py pads), so every step packs into rows of one length."""
  t = config.train
  if t.packing and not t.pack_len:
    max_len = config.data.max_prompt_len + config.rollout.max_response_len
    t = dataclasses.replace(t, pack_len=batch_lib.bucket_len(max_len, max_len=max_len))
  return t


def plan(mask_BxT: np.ndarray, train, min_rows: int = 1) -> list[list[Piece]]:
  """Per minibatch, its microbatches as Pieces (packed when train.packing; a last packed
  microbatch keeps at least min_rows rows: the devices rows are split over)."""
  t = train
  B, T = mask_BxT.shape
  if B % (t.num_minibatches * t.num_microbatches):
    raise ValueError(
        f"batch of {B} samples does not split into train.num_minibatches="
        f"{t.num_minibatches} x train.num_microbatches={t.num_microbatches}"
    )
  minibatches = np.arange(B).reshape(t.num_minibatches, -1)
  budget = pack_len(t, T)
  if budget is not None:
    rows_per_call = B // (t.num_minibatches * t.num_microbatches)
    lengths = batch_lib.row_lengths(mask_BxT)
    return [
        packed_pieces(lengths[rows], rows_per_call, budget, rows, min_rows) for rows in minibatches
    ]
  by_length = bool(t.microbatch_by_length)
  return [
      [
          Piece(T=T, rows=rows[local])
          for local, T in batch_lib.microbatches(mask_BxT[rows], t.num_microbatches, by_length)
      ]
      for rows in minibatches
  ]


def every_shape_plan(mask_BxT: np.ndarray, train, min_rows: int = 1) -> list[list[Piece]]:
  """Pieces of every shape a batch of mask_BxT's padded length can produce (to compile
  them ahead of time): unpacked, its plan (give it rows all of full length); packed, one
  minibatch of a piece for each shape a packed microbatch may take (`last_shapes`)."""
  budget = pack_len(train, mask_BxT.shape[1])
  if budget is None:
    return plan(mask_BxT, train, min_rows)
  rows = mask_BxT.shape[0] // (train.num_minibatches * train.num_microbatches)
  full = lambda r, T: Piece(
      T=T,
      sample=np.broadcast_to(np.arange(r)[None, :, None], (1, r, T)).astype(np.int32),
      pos=np.broadcast_to(np.arange(T)[None, None], (1, r, T)).astype(np.int32),
  )
  return [[full(r, T) for r, T in last_shapes(rows, budget, min_rows)]]


def layout_stats(mask_BxT: np.ndarray, train, min_rows: int = 1) -> dict[str, float]:
  """What the learner's calls compute for a batch: padded token positions against the
  real tokens (prompt + response) they hold, and the calls per update."""
  pieces = [p for mb in plan(mask_BxT, train, min_rows) for p in mb]
  stats = token_counts(pieces, batch_lib.row_lengths(mask_BxT))
  return dict(stats, calls=len(pieces) / train.num_minibatches)
