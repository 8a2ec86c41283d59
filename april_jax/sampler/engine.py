"""The host side of the slot sampler: admit, step, harvest, snapshot, restore.

    engine = SlotEngine(cfg, params, EngineConfig(num_slots=64, max_len=4096))
    engine.add_group(records)          # one prefill, KV copied into len(records) slots
    engine.add(record, mode="kv")      # continue a snapshotted partial sample
    finished = engine.step()           # up to sync_every tokens per live slot
    partials = engine.snapshot()       # every unfinished slot -> host records, slots freed

The engine owns the device `SlotState` and knows which record each slot holds.
Sequence lengths for prefill and KV copies are bucketed (powers of two from
`min_bucket`, capped at `max_len`), so a long run compiles a fixed, small set of
programs. Assign `engine.params` and `engine.version` after each update: the next
tokens are drawn under the new params. A token is tagged with the oldest version its
forward pass saw: a sample put back with its KV (mode kv) keeps its KV's version, a
recomputed or fresh one takes the new version (see state.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from april_jax import sharding
from april_jax.distributed import to_host
from april_jax.models import qwen3
from april_jax.sampler import slot_ops
from april_jax.sampler.records import PromptError, SampleRecord

RESUME_MODES = ("kv", "recompute")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  num_slots: int
  max_len: int                     # tokens a slot holds: prompt + response
  sync_every: int = 16             # decode steps per host round trip (at most)
  min_bucket: int = 16
  stop_ids: tuple[int, ...] = ()
  kv_dtype: str = "float32"
  insert_width: int = 8            # slots filled per insert call (fixed: one compile)
  snapshot_width: int = 4          # slots whose KV is copied out per device call
  decode_block: int = 1024         # cache entries per block of decode attention

  def __post_init__(self):
    for name in ("num_slots", "max_len", "sync_every", "min_bucket", "insert_width",
                 "snapshot_width", "decode_block"):
      if getattr(self, name) < 1:
        raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")


def buckets(min_bucket: int, max_len: int) -> list[int]:
  """Padded lengths used for prefill and KV copies: min_bucket * 2^i, then max_len."""
  out, b = [], min_bucket
  while b < max_len:
    out.append(b)
    b *= 2
  return out + [max_len]


class SlotEngine:
  """A static array of decode slots over one set of (sharded) params."""

  def __init__(self, cfg: qwen3.Qwen3Config, params, config: EngineConfig, mesh=None,
               rules=sharding.DECODE_RULES, version: int = 0):
    self.cfg, self.params, self.config, self.version = cfg, params, config, version
    self.fns = slot_ops.device_fns(cfg, config.num_slots, config.max_len, config.sync_every,
                                   config.kv_dtype, mesh, tuple(rules), config.decode_block)
    self.state = self.fns.init()
    self._stop_ids = jnp.asarray(config.stop_ids, jnp.int32).reshape(-1)
    self._buckets = buckets(config.min_bucket, config.max_len)
    self._owner: list[SampleRecord | None] = [None] * config.num_slots
    self._lengths = np.zeros(config.num_slots, np.int64)  # host copy, as of the last sync
    self.decode_steps = 0        # decode steps run (every slot advances at most 1 each)
    self.tokens_generated = 0    # tokens kept, summed over slots

  # ------------------------------------------------------------------ bookkeeping
  def free_slots(self) -> list[int]:
    return [s for s, r in enumerate(self._owner) if r is None]

  @property
  def num_free(self) -> int:
    return self._owner.count(None)

  @property
  def num_live(self) -> int:
    return self.config.num_slots - self.num_free

  def bucket(self, n: int) -> int:
    for b in self._buckets:
      if b >= n:
        return b
    raise PromptError(f"{n} tokens exceed the slot capacity max_len={self.config.max_len}")

  def check(self, record: SampleRecord) -> None:
    """Raises PromptError if the record cannot run in a slot."""
    P, M = len(record.prompt), self.config.max_len
    if P == 0:
      raise PromptError("empty prompt: a sample needs at least one prompt token")
    if record.max_new_tokens < 1:
      raise PromptError(f"max_new_tokens must be >= 1, got {record.max_new_tokens}")
    if P + record.max_new_tokens > M:
      raise PromptError(
          f"prompt of {P} tokens + response budget {record.max_new_tokens} exceeds the "
          f"slot capacity max_len={M}")
    if record.finished or record.budget_left < 1:
      raise PromptError("the sample is already finished")
    if not (record.top_k >= 0 and 0 < record.top_p <= 1 and record.temperature >= 0):
      raise PromptError(f"bad sampling params temperature={record.temperature} "
                        f"top_k={record.top_k} top_p={record.top_p}")

  def warm_up(self) -> int:
    """Compiles every program a run can use: per length bucket, prefill, insert and KV
    extract; then decode. Runs on the engine's own state, as no-ops (no memory for a
    second state), so the engine must be empty. Returns the number of buckets."""
    if self.num_live:
      raise RuntimeError("warm_up needs an empty engine")
    W, M = self.config.insert_width, self.config.max_len
    no_slots = np.full(W, -1, np.int32)
    for b in self._buckets:
      kv = self.fns.prefill_kv(self.params, np.zeros((1, b), np.int32))
      self.state = self.fns.insert(
          self.state, kv, no_slots, np.zeros(M, np.int32), np.zeros(M, np.float32),
          np.full(M, -1, np.int32), np.int32(1), np.int32(1), np.int32(0),
          np.zeros(W, np.int32),
          np.zeros(W, np.float32), np.zeros(W, np.int32), np.ones(W, np.float32),
          np.zeros((W, 2), np.uint32))
      jax.block_until_ready(self.fns.extract_kv(
          self.state, np.full(self.config.snapshot_width, -1, np.int32), b))
      self.state = self.fns.insert_rows(self.state, *self._rows_args([], b))
    self.state, _, _ = self.fns.decode(self.params, self.state, np.int32(self.version),
                                       self._stop_ids, np.bool_(True))
    self.state = self.fns.mark_done(self.state, np.zeros(self.config.num_slots, bool))
    jax.block_until_ready(self.fns.extract_rows(self.state, no_slots))
    return len(self._buckets)

  # ---------------------------------------------------------------------- admit
  def _insert(self, kv: qwen3.KVCache, kv_version: int, slots: list[int],
              records: list[SampleRecord]):
    """Copies one sequence into slots, `insert_width` slots per device call."""
    W = self.config.insert_width
    for i in range(0, len(slots), W):
      self._insert_chunk(kv, kv_version, slots[i:i + W], records[i:i + W])
    self._own(slots, records)

  def _own(self, slots: list[int], records: list[SampleRecord]) -> None:
    """The samples now live in these slots; their host KV copies are released."""
    for slot, record in zip(slots, records):
      record.drop_kv()
      self._owner[slot] = record
      self._lengths[slot] = record.length

  @staticmethod
  def _fill_row(record: SampleRecord, tokens: np.ndarray, logprobs: np.ndarray,
                versions: np.ndarray) -> None:
    """Writes a sample's tokens, behaviour logprobs and versions into [M] host rows."""
    P = len(record.prompt)
    tokens[:record.length] = np.concatenate([record.prompt, record.response])
    logprobs[P:record.length] = record.logprobs
    versions[P:record.length] = record.versions

  def _insert_chunk(self, kv: qwen3.KVCache, kv_version: int, slots: list[int],
                    records: list[SampleRecord]):
    first = records[0]
    M = self.config.max_len
    tokens, logprobs = np.zeros(M, np.int32), np.zeros(M, np.float32)
    versions = np.full(M, -1, np.int32)
    self._fill_row(first, tokens, logprobs, versions)
    P = len(first.prompt)
    pad = self.config.insert_width - len(slots)
    padded = lambda values, dtype, fill=0: np.asarray(list(values) + [fill] * pad, dtype)
    self.state = self.fns.insert(
        self.state, kv, padded(slots, np.int32, -1), tokens, logprobs, versions,
        np.int32(first.length), np.int32(P), np.int32(kv_version),
        padded([P + r.max_new_tokens for r in records], np.int32),
        padded([r.temperature for r in records], np.float32),
        padded([r.top_k for r in records], np.int32),
        padded([r.top_p for r in records], np.float32, 1.0),
        np.concatenate([np.stack([r.rng for r in records]), np.zeros((pad, 2), np.uint32)]))

  def _rows_args(self, chunk: list[tuple[int, SampleRecord]], kv_len: int) -> tuple:
    """insert_rows' arguments for up to snapshot_width (slot, sample with KV) pairs."""
    W, M, cfg = self.config.snapshot_width, self.config.max_len, self.cfg
    kv_shape = (cfg.num_layers, W, kv_len, cfg.num_kv_heads, cfg.head_dim)
    k, v = np.zeros(kv_shape, self.config.kv_dtype), np.zeros(kv_shape, self.config.kv_dtype)
    slots = np.full(W, -1, np.int32)
    tokens, logprobs = np.zeros((W, M), np.int32), np.zeros((W, M), np.float32)
    versions = np.full((W, M), -1, np.int32)
    ints = np.zeros((5, W), np.int32)  # length, prompt_len, kv_version, limit, top_k
    floats = np.stack([np.zeros(W, np.float32), np.ones(W, np.float32)])  # temp, top_p
    rng = np.zeros((W, 2), np.uint32)
    for j, (slot, r) in enumerate(chunk):
      P, used = len(r.prompt), r.length - 1
      slots[j] = slot
      k[:, j, :used], v[:, j, :used] = r.kv_k, r.kv_v
      self._fill_row(r, tokens[j], logprobs[j], versions[j])
      ints[:, j] = (r.length, P, self._kv_version(r), P + r.max_new_tokens, r.top_k)
      floats[:, j] = (r.temperature, r.top_p)
      rng[j] = r.rng
    kv = qwen3.KVCache(k, v)
    if self.fns.kv_rows_sharding is not None:
      kv = jax.device_put(kv, self.fns.kv_rows_sharding)
    return (kv, slots, tokens, logprobs, versions, ints[0], ints[1], ints[2], ints[3],
            floats[0], ints[4], floats[1], rng)

  @staticmethod
  def _kv_version(record: SampleRecord) -> int:
    """The oldest version in a record's host KV (its oldest token's, if not recorded)."""
    if record.kv_version is not None:
      return record.kv_version
    return int(record.versions.min()) if record.started else 0

  def add_partials(self, records: list[SampleRecord], mode: str = "kv") -> list[int]:
    """Continues several partial samples; in mode kv, snapshot_width per device call.

    Samples without KV (or in mode recompute) go through `add` one by one.
    """
    if mode not in RESUME_MODES:
      raise ValueError(f"resume mode must be one of {RESUME_MODES}, got {mode!r}")
    with_kv = [r for r in records if mode == "kv" and r.has_kv]
    rest = [r for r in records if not (mode == "kv" and r.has_kv)]
    for r in with_kv:
      self.check(r)
    slots = self._take_slots(len(with_kv))
    by_bucket: dict[int, list[tuple[int, SampleRecord]]] = {}
    for slot, r in zip(slots, with_kv):
      by_bucket.setdefault(self.bucket(max(r.length - 1, 1)), []).append((slot, r))
    W = self.config.snapshot_width
    for kv_len, pairs in by_bucket.items():
      for i in range(0, len(pairs), W):
        self.state = self.fns.insert_rows(self.state, *self._rows_args(pairs[i:i + W], kv_len))
    self._own(slots, with_kv)
    slot_of = dict(zip(map(id, with_kv), slots))
    slot_of.update((id(r), self.add(r, mode)) for r in rest)
    return [slot_of[id(r)] for r in records]

  def _take_slots(self, n: int) -> list[int]:
    free = self.free_slots()
    if len(free) < n:
      raise RuntimeError(f"{n} slots requested, {len(free)} free")
    return free[:n]

  def _prefill(self, tokens: np.ndarray) -> qwen3.KVCache:
    padded = np.zeros((1, self.bucket(len(tokens))), np.int32)
    padded[0, :len(tokens)] = tokens
    return self.fns.prefill_kv(self.params, padded)

  def add_group(self, records: list[SampleRecord]) -> list[int]:
    """Fresh samples of one prompt: prefilled once, KV copied into len(records) slots.

    Each sample keeps its own response budget, rng and sampling params.
    """
    for r in records:
      self.check(r)
      if r.started or not np.array_equal(r.prompt, records[0].prompt):
        raise ValueError("add_group takes fresh samples of one and the same prompt")
    slots = self._take_slots(len(records))
    self._insert(self._prefill(records[0].prompt), self.version, slots, records)
    return slots

  def add(self, record: SampleRecord, mode: str = "kv") -> int:
    """Continues one sample: fresh, or partial (its KV put back, or recomputed)."""
    if mode not in RESUME_MODES:
      raise ValueError(f"resume mode must be one of {RESUME_MODES}, got {mode!r}")
    self.check(record)
    slot = self._take_slots(1)
    if mode == "kv" and record.has_kv:
      used = record.length - 1
      kv_len = self.bucket(max(used, 1))
      pad = ((0, 0), (0, kv_len - used), (0, 0), (0, 0))
      kv = qwen3.KVCache(np.pad(record.kv_k, pad), np.pad(record.kv_v, pad))
      if self.fns.kv_sharding is not None:
        kv = jax.device_put(kv, self.fns.kv_sharding)
      kv_version = self._kv_version(record)
    else:  # recompute (or a fresh / KV-less sample): prefill prompt + response so far
      kv = self._prefill(np.concatenate([record.prompt, record.response]))
      kv_version = self.version
    self._insert(kv, kv_version, slot, [record])
    return slot[0]

  # ------------------------------------------------------------------ decode, harvest
  def step(self, refill: bool = True) -> list[SampleRecord]:
    """Runs up to sync_every decode steps; returns the samples that finished.

    With `refill` (a sample waits for a free slot) decoding stops at the first finish,
    so the slot is refilled at once; without it, the sync_every steps run unless every
    slot finishes, saving host round trips when nothing could use a freed slot.
    """
    self.state, steps, kept = self.fns.decode(self.params, self.state,
                                              np.int32(self.version), self._stop_ids,
                                              np.bool_(refill))
    done, lengths, steps, kept = to_host((self.state.done, self.state.length, steps, kept))
    grown = np.array(lengths) - self._lengths  # a live slot gains one token per step
    self._lengths = np.array(lengths)
    self.decode_steps += int(steps)
    self.tokens_generated += int(kept)
    # In the order they finished (the step each finished at, then slot): with refill off
    # several finish within one window, and callers rely on completion order.
    finished = sorted(((slot, r) for slot, r in enumerate(self._owner)
                       if r is not None and done[slot]), key=lambda x: (grown[x[0]], x[0]))
    self._read_back(finished, with_kv=False)
    for slot, record in finished:
      last = record.response[-1]
      record.finish_reason = "stop" if last in self.config.stop_ids else "length"
      self._owner[slot] = None
    return [record for _, record in finished]

  def snapshot(self, with_kv: bool = True) -> list[SampleRecord]:
    """Every unfinished sample back to the host (with its KV if asked); slots freed."""
    held = [(slot, r) for slot, r in enumerate(self._owner) if r is not None]
    self._read_back(held, with_kv)
    for slot, _ in held:
      self._owner[slot] = None
    self.state = self.fns.mark_done(self.state, np.array([r is None for r in self._owner]))
    return [record for _, record in held]

  def _read_back(self, items: list[tuple[int, SampleRecord]], with_kv: bool) -> None:
    """Copies the slots' responses (and KV) into their records, W slots per transfer."""
    W = self.config.insert_width
    for i in range(0, len(items), W):
      chunk = items[i:i + W]
      slots = np.full(W, -1, np.int32)
      slots[:len(chunk)] = [slot for slot, _ in chunk]
      tokens, logprobs, versions, meta = to_host(self.fns.extract_rows(self.state, slots))
      for j, (slot, record) in enumerate(chunk):
        length, P = int(meta[j, 0]), int(meta[j, 1])
        record.response = tokens[j, P:length].copy()
        record.logprobs = logprobs[j, P:length].copy()
        record.versions = versions[j, P:length].copy()
        if with_kv:
          record.kv_version = int(meta[j, 2])
    if with_kv:
      self._read_back_kv(items)

  def _read_back_kv(self, items: list[tuple[int, SampleRecord]]) -> None:
    """KV of the used length, slots grouped by length bucket, W per device call."""
    W = self.config.snapshot_width
    by_bucket: dict[int, list[tuple[int, SampleRecord]]] = {}
    for slot, record in items:
      by_bucket.setdefault(self.bucket(max(record.length - 1, 1)), []).append((slot, record))
    for kv_len, group in by_bucket.items():
      for i in range(0, len(group), W):
        chunk = group[i:i + W]
        slots = np.full(W, -1, np.int32)
        slots[:len(chunk)] = [slot for slot, _ in chunk]
        k, v = to_host(self.fns.extract_kv(self.state, slots, kv_len))
        for j, (_, record) in enumerate(chunk):
          used = record.length - 1
          record.kv_k, record.kv_v = k[:, j, :used].copy(), v[:, j, :used].copy()
