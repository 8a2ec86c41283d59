"""The host side of the slot sampler: admit, step, harvest, snapshot, restore.

    engine = SlotEngine(cfg, params, EngineConfig(num_slots=64, max_len=4096))
    engine.add_group(records)          # one prefill, KV copied into len(records) slots
    engine.add_groups([g1, g2, g3])    # several prompts: one prefill call per bucket and
                                       # prefill_width prompts
    engine.add(record, mode="kv")      # continue a snapshotted partial sample
    finished = engine.step()           # up to sync_every tokens per live slot
    engine.extend(record, tokens)      # with hold_stopped: a stopped slot goes on after
                                       # tokens it is given (an environment's turn)
    partials = engine.snapshot()       # every unfinished slot -> host records, slots freed
    partials = engine.snapshot(keep=True)  # ... their KV left in its pages until needed

The engine owns the device `SlotState` and knows which record each slot holds.
Sequence lengths for prefill and KV copies are bucketed (powers of two from
`min_bucket`, capped at `max_len`), so a long run compiles a fixed, small set of
programs. Assign `engine.params` and `engine.version` after each update: the next
tokens are drawn under the new params. A token is tagged with the oldest version its
forward pass saw: a sample put back with its KV (mode kv) keeps its KV's version, a
recomputed or fresh one takes the new version (see state.py).

A snapshot with `keep` leaves each sample's KV in its pages instead of copying it to the
host, until another slot needs them or `copy_out_kept` asks (a checkpoint); a kept sample
put back with its KV takes its pages back in place (kept_kv.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from april_jax import buckets, sharding
from april_jax.distributed import to_host
from april_jax.models import qwen3
from april_jax.sampler import kept_kv, pages, slot_ops
from april_jax.sampler.engine_config import RESUME_MODES, EngineConfig
from april_jax.sampler.records import PromptError, SampleRecord
from april_jax.sampler.rows import kv_positions, kv_version_of, rows_from_records


class SlotEngine:
  """A static array of decode slots over one set of (sharded) params."""

  def __init__(
      self,
      cfg: qwen3.Qwen3Config,
      params,
      config: EngineConfig,
      mesh=None,
      rules=sharding.DECODE_RULES,
      version: int = 0,
  ):
    self.cfg, self.params, self.config, self.version = cfg, params, config, version
    self.fns = slot_ops.device_fns(
        cfg,
        config.num_slots,
        config.max_len,
        config.sync_every,
        config.kv_dtype,
        mesh,
        tuple(rules),
        config.decode_block,
        config.page_size,
        config.num_pages,
        config.decode_attention,
    )
    if self.fns.pages_per_shard - 1 < config.pages_per_sequence:
      raise ValueError(
          f"EngineConfig.num_pages={config.num_pages} gives each of {self.fns.shards} slot "
          f"shards {self.fns.pages_per_shard - 1} pages: too few for one sequence of "
          f"max_len={config.max_len} ({config.pages_per_sequence} pages)"
      )
    self.book = pages.PageBook(
        config.num_slots,
        self.fns.pages_per_shard,
        self.fns.shards,
        config.page_size,
        pages.pages_for(config.max_len, config.page_size),
    )
    # Snapshotted samples whose KV stays in the pool (snapshot with keep).
    self.kept = kept_kv.KeptKV(
        self.book,
        functools.partial(buckets.bucket, min_bucket=config.min_bucket, cap=config.max_len),
        config.snapshot_width,
        self._read_kv,
    )
    self.state = self.fns.init()
    self._stop_ids = jnp.asarray(config.stop_ids, jnp.int32).reshape(-1)
    self._table_arg = None  # the page table as last passed to a device call (_table)
    self._buckets = buckets.all_buckets(config.min_bucket, config.max_len)
    self._owner: list[SampleRecord | None] = [None] * config.num_slots
    self._held: set[int] = set()  # id() of the records in _owner
    self._lengths = np.zeros(config.num_slots, np.int64)  # host copy, as of the last sync
    self._kv_versions = np.zeros(config.num_slots, np.int64)  # as of the last read back
    self._limits = np.zeros(config.num_slots, np.int64)  # prompt + budget, per slot
    self._age = np.zeros(config.num_slots, np.int64)  # admission order (preempt the youngest)
    self._admissions = 0
    self._stopped: set[int] = set()  # slots held at a stop (hold_stopped): extend or release
    self.preempted: list[SampleRecord] = []  # moved out for pages; callers put them back
    self.preemptions = 0  # over the engine's life
    self.decode_steps = 0  # decode steps run (every slot advances at most 1 each)
    self.tokens_generated = 0  # tokens drawn (not given), summed over slots
    self.prefills = 0  # prefill calls (prompts, and recomputed partials)
    self._kv_bytes_read = 0  # KV of slots copied to the host (snapshots, preemptions)
    self.kv_bytes_to_device = 0  # host KV put back into the pool

  @property
  def kv_bytes_to_host(self) -> int:
    """KV copied out of the pool: from slots, and from kept pages."""
    return self._kv_bytes_read + self.kept.bytes_to_host

  @property
  def params(self):
    return self._params

  @params.setter
  def params(self, params) -> None:
    """New weights: the kept prompt KV (add_group) was computed by the old ones."""
    self._params = params
    self._last_prompt = None

  # ------------------------------------------------------------------ bookkeeping
  def free_slots(self) -> list[int]:
    return [s for s, r in enumerate(self._owner) if r is None]

  def holds(self, record: SampleRecord) -> bool:
    """Whether the record is in a slot now."""
    return id(record) in self._held

  def keeps(self, record: SampleRecord) -> bool:
    """Whether the record's KV is kept in the pool (snapshot with keep)."""
    return record in self.kept

  @property
  def num_free(self) -> int:
    return self.config.num_slots - len(self._held)

  @property
  def num_live(self) -> int:
    return self.config.num_slots - self.num_free

  def bucket(self, n: int) -> int:
    if n > self.config.max_len:
      raise PromptError(f"{n} tokens exceed the slot capacity max_len={self.config.max_len}")
    return buckets.bucket(n, self.config.min_bucket, self.config.max_len)

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
          f"slot capacity max_len={M}"
      )
    if record.finished or record.budget_left < 1:
      raise PromptError("the sample is already finished")
    if not (record.top_k >= 0 and 0 < record.top_p <= 1 and record.temperature >= 0):
      raise PromptError(
          f"bad sampling params temperature={record.temperature} "
          f"top_k={record.top_k} top_p={record.top_p}"
      )

  def warm_up(self) -> int:
    """Compiles every program a run can use: per length bucket, prefill and its insert
    (one prompt, and prefill_rows prompts where that is more), the insert of restored
    KV and the KV extract; then decode. Runs on the engine's own state, as no-ops (no
    memory for a second state), so the engine must be empty. Returns the number of
    buckets."""
    if self.num_live:
      raise RuntimeError("warm_up needs an empty engine")
    cfg, W, Wr = self.cfg, self.config.insert_width, self.config.snapshot_width
    for b in self._buckets:
      for rows in sorted({1, self.config.prefill_rows(b)}):
        kv = self.fns.prefill_kv(self.params, np.zeros((rows, b), np.int32))
        self._insert(kv, W, [], [], [], [], [])
      jax.block_until_ready(
          self.fns.extract_kv(self.state, np.full(Wr, -1, np.int32), b, self._table())
      )
      zeros = np.zeros(
          (cfg.num_layers, Wr, b, cfg.num_kv_heads, cfg.head_dim), self.config.kv_dtype
      )
      self._insert(self._on_device(qwen3.KVCache(zeros, zeros)), Wr, [], [], [], [], [])
    self.state, _, _ = self.fns.decode(
        self.params, self.state, np.int32(self.version), self._stop_ids, np.int32(1), self._table()
    )
    self.state = self.fns.mark_done(self.state, np.zeros(self.config.num_slots, bool))
    no_slots = np.full(self.config.insert_width, -1, np.int32)
    jax.block_until_ready(self.fns.extract_rows(self.state, no_slots))
    rows = rows_from_records([], self.config.insert_width, self.config.max_len, [])
    self.state = self.fns.write_rows(self.state, rows, no_slots)
    return len(self._buckets)

  # ---------------------------------------------------------------------- admit
  def _insert(
      self,
      kv: qwen3.KVCache,
      width: int,
      slots: list[int],
      records: list[SampleRecord],
      kv_versions: list[int],
      lengths: list[int],
      kv_rows: list[int],
  ) -> None:
    """One insert call of `width` slots (insert_width, or snapshot_width for restored
    KV): up to that many records into slots, each with row kv_rows[i] of the KV
    [L, R, T, K, H] (rows may be shared) and decoding at lengths[i]."""
    padded, rows_at = np.full(width, -1, np.int32), np.zeros(width, np.int32)
    padded[: len(slots)], rows_at[: len(kv_rows)] = slots, kv_rows
    rows = rows_from_records(records, width, self.config.max_len, kv_versions, lengths)
    self.state = self.fns.insert(self.state, kv, rows, padded, rows_at, self._table())

  def _insert_shared(
      self,
      kv: qwen3.KVCache,
      kv_version: int,
      items: list[tuple[int, SampleRecord, int]],
      length: int | None = None,
  ) -> None:
    """KV [L, R, T, K, H] into slots, `insert_width` slots per call: items are (slot,
    record, its KV row); `length`: where their decoding stands (default: their own)."""
    W = self.config.insert_width
    for i in range(0, len(items), W):
      slots, records, kv_rows = zip(*items[i : i + W])
      lengths = [r.length if length is None else length for r in records]
      self._insert(kv, W, slots, records, [kv_version] * len(slots), lengths, kv_rows)

  def _own(self, slots: list[int], records: list[SampleRecord], lengths: list[int]) -> None:
    """The samples now live in these slots; their host KV copies are released."""
    for slot, record, length in zip(slots, records, lengths):
      record.drop_kv()
      self._owner[slot] = record
      self._held.add(id(record))
      self._lengths[slot] = length

  def _on_device(self, kv: qwen3.KVCache) -> qwen3.KVCache:
    return kv if self.fns.kv_sharding is None else jax.device_put(kv, self.fns.kv_sharding)

  def _host_kv(self, records: list[SampleRecord], kv_len: int) -> qwen3.KVCache:
    """Records' host KV as rows [L, R, kv_len, K, H] (R = snapshot_width), zero-padded."""
    cfg = self.cfg
    shape = (cfg.num_layers, self.config.snapshot_width, kv_len, cfg.num_kv_heads, cfg.head_dim)
    k, v = np.zeros(shape, self.config.kv_dtype), np.zeros(shape, self.config.kv_dtype)
    for j, r in enumerate(records):
      k[:, j, : kv_positions(r)], v[:, j, : kv_positions(r)] = r.kv_k, r.kv_v
      self.kv_bytes_to_device += r.kv_k.nbytes + r.kv_v.nbytes
    return self._on_device(qwen3.KVCache(k, v))

  def add_partials(self, records: list[SampleRecord], mode: str = "kv") -> list[int]:
    """Continues several partial samples, in the free slots room_for counts for them
    (in order); in mode kv, snapshot_width per device call. Samples without KV (or in
    mode recompute) are prefilled one by one.
    """
    if mode not in RESUME_MODES:
      raise ValueError(f"resume mode must be one of {RESUME_MODES}, got {mode!r}")
    for r in records:
      self.check(r)
    slots, in_place = self._take_slots(records, mode == "kv")
    pairs = list(zip(slots, records))
    self._resume_in_place([(slot, r, in_place[id(r)]) for slot, r in pairs if id(r) in in_place])
    pairs = [(slot, r) for slot, r in pairs if id(r) not in in_place]
    with_kv = [(slot, r) for slot, r in pairs if mode == "kv" and r.has_kv]
    rest = [(slot, r) for slot, r in pairs if not (mode == "kv" and r.has_kv)]
    by_bucket: dict[int, list[tuple[int, SampleRecord]]] = {}
    for slot, r in with_kv:
      by_bucket.setdefault(self.bucket(max(kv_positions(r), 1)), []).append((slot, r))
    W = self.config.snapshot_width
    for kv_len, items in by_bucket.items():
      for i in range(0, len(items), W):
        chunk = [r for _, r in items[i : i + W]]
        self._insert(
            self._host_kv(chunk, kv_len),
            W,
            [slot for slot, _ in items[i : i + W]],
            chunk,
            [kv_version_of(r) for r in chunk],
            [kv_positions(r) + 1 for r in chunk],
            list(range(len(chunk))),
        )
    kv_slots, kv_records = [s for s, _ in with_kv], [r for _, r in with_kv]
    self._own(kv_slots, kv_records, [kv_positions(r) + 1 for r in kv_records])
    for slot, r in rest:
      self._continue(slot, r, mode)
    return slots

  def _take_slots(
      self, records: list[SampleRecord], resume_kv: bool = False
  ) -> tuple[list[int], dict[int, int]]:
    """Free slots for the records, each with pages for its KV and one decode call.
    With resume_kv a kept record takes its own pages back where it can; returns the
    slots and, for those records, id -> KV positions. Any other kept record given
    here lets its pages go (its KV copied out if it continues from its KV)."""
    ids = {id(r) for r in records}
    if len(ids) < len(records) or not ids.isdisjoint(self._held):
      raise ValueError("a sample can be in one slot only: it is given twice or already held")
    slots = self._place(records)
    if len(slots) < len(records):
      raise RuntimeError(
          f"{len(records)} samples do not fit: {self.num_free} slots and "
          f"{self.book.free()} pages free (check room_for first)"
      )
    # Kept records that cannot take their pages back let them go first, those that
    # continue from their KV copied out together (a slot on another shard than its pages).
    self.kept.let_go(
        [
            r
            for slot, r in zip(slots, records)
            if r in self.kept
            and not (resume_kv and self.kept.on_shard(r, self.book.shard_of(slot)))
        ],
        copy=resume_kv,
    )
    windows = [self._window(r.length, len(r.prompt) + r.max_new_tokens) for r in records]
    if len(self.kept):
      grows = [
          (self.book.shard_of(slot), self._pages(window) - self.kept.pages_of(r))
          for slot, r, window in zip(slots, records, windows)
      ]
      self.kept.copy_out_ahead(grows, {id(r) for r in records})
    in_place = {}
    for slot, r, window in zip(slots, records, windows):
      if r in self.kept:
        in_place[id(r)] = self.kept.take_back(slot, r, window)
      else:
        self.book.grow(slot, window, self.kept.copy_out)
      self._limits[slot] = len(r.prompt) + r.max_new_tokens
      self._age[slot] = self._admissions
      self._admissions += 1
    return slots, in_place

  def _resume_in_place(self, items: list[tuple[int, SampleRecord, int]]) -> None:
    """Kept samples back into the slots that took their pages back (slot, record, KV
    positions): only their rows are written, insert_width slots per call."""
    W = self.config.insert_width
    for i in range(0, len(items), W):
      slots, records, used = zip(*items[i : i + W])
      lengths = [n + 1 for n in used]
      padded = np.full(W, -1, np.int32)
      padded[: len(slots)] = slots
      versions = [kv_version_of(r) for r in records]
      rows = rows_from_records(list(records), W, self.config.max_len, versions, lengths)
      self.state = self.fns.write_rows(self.state, rows, padded)
      self._own(list(slots), list(records), lengths)

  def discard(self, record: SampleRecord) -> None:
    """Lets a kept record's pages go without copying its KV out (the caller drops the
    record: it starts over)."""
    self.kept.discard(record)

  def copy_out_kept(self) -> None:
    """Every kept record's KV to the host, its pages then plain free pages (before a
    checkpoint keeps the records)."""
    self.kept.copy_out_all()

  # ---------------------------------------------------------------------- pages
  def _window(self, length: int, limit: int) -> int:
    """Positions a slot at `length` may write within one decode call (its KV then
    covers them): the pending token's and sync_every - 1 more, never past limit - 1."""
    return int(min(length - 1 + self.config.sync_every, limit - 1))

  def _pages(self, positions: int) -> int:
    """Pages that hold `positions` positions."""
    return pages.pages_for(positions, self.config.page_size)

  def room_for(self, records: list[SampleRecord]) -> int:
    """How many of `records`, in order, can start now: each needs a free slot, and
    pages on that slot's shard for its KV and one decode call's growth (_place)."""
    return len(self._place(records))

  def _place(self, records: list[SampleRecord]) -> list[int]:
    """Slots for the records, in order, as far as they fit: each takes the lowest free
    slot on a shard with pages for it, the shard it was snapshotted from first (its
    meta "shard", with more than one shard: where its kept pages are). Calls that take
    slots for a list in parts, in order, get what one call for the whole list would:
    room_for counts what they get."""
    free: dict[int, list[int]] = {}  # shard -> its free slots, lowest first
    for slot in self.free_slots():
      free.setdefault(self.book.shard_of(slot), []).append(slot)
    left = {shard: self.book.free(slots[0]) for shard, slots in free.items()}
    out = []
    for r in records:
      window = self._window(r.length, len(r.prompt) + r.max_new_tokens)
      need = self._pages(window)
      fits = [shard for shard, slots in free.items() if slots and left[shard] >= need]
      if not fits:
        break
      home = r.meta.get("shard")
      shard = home if home in fits else min(fits, key=lambda shard: free[shard][0])
      out.append(free[shard].pop(0))
      left[shard] -= need
    return out

  def _table(self):
    """The page table for an insert, decode or KV read call (insert and decode make it
    the state's): the host's, passed with the call rather than uploaded by a device call
    of its own. On a mesh it is put on the devices once per change; without one the
    host's copy (remade once per change) goes with each call. Never the state's own
    buffer, which insert and decode donate."""
    if self.book.dirty:  # (a new book starts dirty)
      self._table_arg = self.book.table.copy()  # the host edits its table in place
      if self.fns.state_sharding is not None:
        self._table_arg = jax.device_put(self._table_arg, self.fns.state_sharding.page_table)
      self.book.dirty = False
    return self._table_arg

  def _reserve(self) -> None:
    """Pages for every live slot's next decode call, oldest slots first. Where a shard
    runs out, its youngest live slot is preempted (never dropped: see take_preempted);
    the oldest always fits, as the pool holds one max_len sequence per shard."""
    live = [s for s, r in enumerate(self._owner) if r is not None]
    windows = {s: self._window(int(self._lengths[s]), int(self._limits[s])) for s in live}
    if len(self.kept):  # kept pages the coming grows reach: copied out in one batch
      self.kept.copy_out_ahead(
          (self.book.shard_of(s), self._pages(w) - int(self.book.held[s]))
          for s, w in windows.items()
      )
    for slot in sorted(live, key=lambda s: self._age[s]):
      if self._owner[slot] is None:
        continue  # preempted for an older slot
      need = windows[slot]
      while not self.book.grow(slot, need, self.kept.copy_out):
        shard = self.book.shard_of(slot)
        victim = max(
            (
                s
                for s, r in enumerate(self._owner)
                if r is not None and self.book.shard_of(s) == shard
            ),
            key=lambda s: self._age[s],
        )
        self._preempt(victim)
        if victim == slot:
          break

  def _preempt(self, slot: int) -> None:
    """The slot's sample back to the host (with its KV in preempt_mode kv); slot freed."""
    record = self._owner[slot]
    self._read_back([(slot, record)], with_kv=self.config.preempt_mode == "kv")
    self._release(slot)
    mask = np.zeros(self.config.num_slots, bool)
    mask[slot] = True
    self.state = self.fns.mark_done(self.state, mask)
    self.preempted.append(record)
    self.preemptions += 1

  def take_preempted(self) -> list[SampleRecord]:
    """The samples preempted since the last call (oldest first); the caller continues
    them like any partial sample."""
    out, self.preempted = self.preempted, []
    return out

  def _prefill(self, sequences: list[np.ndarray]) -> qwen3.KVCache:
    """One prefill call: the KV [L, B, T, K, H] of sequences of one length bucket T,
    row i the i-th; B = 1 for one sequence, else prefill_rows(T) (rows past the
    sequences are padding)."""
    T = self.bucket(max(len(t) for t in sequences))
    padded = np.zeros((1 if len(sequences) == 1 else self.config.prefill_rows(T), T), np.int32)
    for i, tokens in enumerate(sequences):
      padded[i, : len(tokens)] = tokens
    self.prefills += 1
    return self.fns.prefill_kv(self.params, padded)

  def _prompt_kvs(self, prompts: list[np.ndarray]):
    """Yields (KV [L, B, T, K, H], [(prompt index, row)]): every prompt's prefilled KV.
    Prompts of one length bucket share prefill calls, prefill_rows per call, and a
    prompt given twice is prefilled once. The KV of the call that holds the last
    prompt is kept on the device (one call's KV, in the memory plan), so a group whose
    samples start as slots free up, one or a few at a time, prefills its prompt once;
    new params or a new version drop it. Kept KV is what a new prefill call computes.
    At most two calls' KV are alive at once: the kept one and the newest (the caller
    lets each go once inserted)."""
    at: dict[bytes, list[int]] = {}
    for i, p in enumerate(prompts):
      at.setdefault(np.asarray(p, np.int32).tobytes(), []).append(i)
    last = np.asarray(prompts[-1], np.int32).tobytes()
    kept = self._last_prompt
    if kept is not None and kept[0] == self.version and kept[1] in at:
      yield kept[2], [(i, kept[3]) for i in at.pop(kept[1])]
    if last in at:
      self._last_prompt = kept = None  # replaced below: let it go before prefilling
    by_bucket: dict[int, list[bytes]] = {}
    for key, where in at.items():
      by_bucket.setdefault(self.bucket(len(prompts[where[0]])), []).append(key)
    for T, keys in by_bucket.items():
      width = self.config.prefill_rows(T)
      for c in range(0, len(keys), width):
        chunk = keys[c : c + width]
        kv = self._prefill([prompts[at[key][0]] for key in chunk])
        if last in chunk:
          self._last_prompt = (self.version, last, kv, chunk.index(last))
        yield kv, [(i, row) for row, key in enumerate(chunk) for i in at[key]]
        del kv

  def add_group(self, records: list[SampleRecord]) -> list[int]:
    """Fresh samples of one prompt: see add_groups."""
    return self.add_groups([records])[0]

  def add_groups(self, groups: list[list[SampleRecord]]) -> list[list[int]]:
    """Fresh samples of several prompts, one list per prompt: each prompt prefilled
    once (also across calls, while it is in the last prefill call: _prompt_kvs), in
    calls of up to prefill_width prompts of one length bucket; its KV copied into its
    samples' slots, insert_width slots per insert call (each slot owns its pages;
    docs/what_fits.md says why pages are not shared). Returns each group's slots.

    Each sample keeps its own response budget, rng and sampling params.
    """
    for records in groups:
      for r in records:
        self.check(r)
        if r.started or not np.array_equal(r.prompt, records[0].prompt):
          raise ValueError("add_groups takes fresh samples of one prompt per group")
    flat = [r for records in groups for r in records]
    slots, _ = self._take_slots(flat)
    taken = iter(slots)
    group_slots = [[next(taken) for _ in records] for records in groups]
    nonempty = [g for g, records in enumerate(groups) if records]
    if nonempty:
      for kv, members in self._prompt_kvs([groups[g][0].prompt for g in nonempty]):
        items = [
            (slot, r, row)
            for i, row in members
            for slot, r in zip(group_slots[nonempty[i]], groups[nonempty[i]])
        ]
        self._insert_shared(kv, self.version, items)
        del kv  # inserted: the next prefill call's output need not sit beside it
    self._own(slots, flat, [r.length for r in flat])
    return group_slots

  def add(self, record: SampleRecord, mode: str = "kv") -> int:
    """Continues one sample: fresh, or partial (its KV put back, or recomputed)."""
    if mode not in RESUME_MODES:
      raise ValueError(f"resume mode must be one of {RESUME_MODES}, got {mode!r}")
    self.check(record)
    [slot], in_place = self._take_slots([record], mode == "kv")
    if in_place:
      self._resume_in_place([(slot, record, in_place[id(record)])])
    else:
      self._continue(slot, record, mode)
    return slot

  def _continue(self, slot: int, record: SampleRecord, mode: str) -> None:
    """One sample into its slot (taken, with pages): its KV put back, or recomputed."""
    length = record.length
    if mode == "kv" and record.has_kv:
      used = kv_positions(record)
      length = used + 1
      pad = ((0, 0), (0, self.bucket(max(used, 1)) - used), (0, 0), (0, 0))
      kv = self._on_device(
          qwen3.KVCache(np.pad(record.kv_k, pad)[:, None], np.pad(record.kv_v, pad)[:, None])
      )
      self.kv_bytes_to_device += record.kv_k.nbytes + record.kv_v.nbytes
      kv_version = kv_version_of(record)
    else:  # recompute (or a fresh / KV-less sample): prefill prompt + response so far
      kv = self._prefill([np.concatenate([record.prompt, record.response])])
      kv_version = self.version
    self._insert_shared(kv, kv_version, [(slot, record, 0)], length)
    self._own([slot], [record], [length])

  # ------------------------------------------------------------------ decode, harvest
  def step(self, refill: bool = True) -> list[SampleRecord]:
    """Runs up to sync_every decode steps; returns the samples that finished.

    With `refill` (a sample waits for a free slot) decoding stops once `refill_batch`
    slots have finished, so they are refilled together; without it, the sync_every
    steps run unless every slot finishes, saving host round trips when nothing could
    use a freed slot. First every live slot gets the pages it can fill in this call;
    where the pool runs out the youngest are preempted (take_preempted).
    """
    if self._stopped:
      raise RuntimeError(
          f"{len(self._stopped)} slots are held at a stop: extend or release each before "
          "the next step"
      )
    self._reserve()
    if not self.num_live:
      return []
    leave_after = min(self.config.refill_batch, self.num_live) if refill else 0
    self.state, steps, kept = self.fns.decode(
        self.params,
        self.state,
        np.int32(self.version),
        self._stop_ids,
        np.int32(leave_after),
        self._table(),
    )
    done, lengths, steps, kept = to_host((self.state.done, self.state.length, steps, kept))
    grown = np.array(lengths) - self._lengths  # a live slot gains one token per step
    self._lengths = np.array(lengths)
    self.decode_steps += int(steps)
    self.tokens_generated += int(kept)
    # In the order they finished (the step each finished at, then slot): with refill off
    # several finish within one window, and callers rely on completion order.
    finished = sorted(
        ((slot, r) for slot, r in enumerate(self._owner) if r is not None and done[slot]),
        key=lambda x: (grown[x[0]], x[0]),
    )
    self._read_back(finished, with_kv=False)
    for slot, record in finished:
      stopped = record.response[-1] in self.config.stop_ids
      record.finish_reason = "stop" if stopped else "length"
      if stopped and self.config.hold_stopped:
        self._stopped.add(slot)
      else:
        self._release(slot)
    return [record for _, record in finished]

  def _held_stopped(self, record: SampleRecord) -> int:
    """The slot holding `record` at a stop (hold_stopped); ValueError if none does."""
    slot = next((s for s in self._stopped if self._owner[s] is record), None)
    if slot is None:
      raise ValueError("the sample is not held in a slot at a stop")
    return slot

  def extend(self, record: SampleRecord, tokens: np.ndarray) -> None:
    """Continues a sample that stopped and was held (hold_stopped) after `tokens`, which
    it is given rather than draws (an environment's observation): they join its
    response with logprob 0 and the engine's version, and the next decode steps feed
    them through the slot's own KV, in place, before it draws again. The sample must
    have room for them and one more token."""
    slot = self._held_stopped(record)
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if record.budget_left < len(tokens) + 1:
      raise ValueError(
          f"{len(tokens)} given tokens leave no room in the sample's budget "
          f"({record.budget_left} tokens left)"
      )
    length = record.length
    record.response = np.concatenate([record.response, tokens])
    record.logprobs = np.concatenate([record.logprobs, np.zeros(len(tokens), np.float32)])
    record.versions = np.concatenate(
        [record.versions, np.full(len(tokens), self.version, np.int32)]
    )
    record.finish_reason = None
    W = self.config.insert_width
    slots = np.full(W, -1, np.int32)
    slots[0] = slot
    kv_version = int(self._kv_versions[slot])
    rows = rows_from_records([record], W, self.config.max_len, [kv_version], [length])
    self.state = self.fns.write_rows(self.state, rows, slots)
    self._stopped.discard(slot)

  def release(self, record: SampleRecord) -> None:
    """Frees the slot of a sample that stopped and was held (hold_stopped)."""
    self._release(self._held_stopped(record))

  def snapshot(self, with_kv: bool = True, keep: bool = False) -> list[SampleRecord]:
    """Every unfinished sample back to the host (with its KV if asked); slots freed.
    With `keep` (and with_kv) the KV stays in the slots' pages, kept for the records
    (keeps): a slot held at a stop still copies its KV out."""
    held = [(slot, r) for slot, r in enumerate(self._owner) if r is not None]
    if self.book.shards > 1:  # a checkpoint keeps it: a resumed run places alike
      for slot, r in held:
        r.meta["shard"] = self.book.shard_of(slot)
    stay = [(slot, r) for slot, r in held if keep and with_kv and slot not in self._stopped]
    kept = {slot for slot, _ in stay}
    self._read_back([(slot, r) for slot, r in held if slot not in kept], with_kv)
    self._read_back(stay, with_kv=False)
    for slot, record in stay:
      record.kv_version = int(self._kv_versions[slot])
      self.kept.keep(slot, record, int(self._lengths[slot]) - 1)
    for slot, _ in held:
      self._release(slot)
    self.state = self.fns.mark_done(self.state, np.array([r is None for r in self._owner]))
    return [record for _, record in held]

  def _release(self, slot: int) -> None:
    self._stopped.discard(slot)
    self._held.discard(id(self._owner[slot]))
    self._owner[slot] = None
    self.book.release(slot)

  def _read_back(self, items: list[tuple[int, SampleRecord]], with_kv: bool) -> None:
    """Copies the slots' responses (and KV) into their records, W slots per transfer."""
    W = self.config.insert_width
    for i in range(0, len(items), W):
      chunk = items[i : i + W]
      slots = np.full(W, -1, np.int32)
      slots[: len(chunk)] = [slot for slot, _ in chunk]
      tokens, logprobs, versions, meta = to_host(self.fns.extract_rows(self.state, slots))
      for j, (slot, record) in enumerate(chunk):
        # Given tokens not fed yet (forced_end) belong to the response all the same.
        P, end = int(meta[j, 1]), max(int(meta[j, 0]), int(meta[j, 3]))
        record.response = tokens[j, P:end].copy()
        record.logprobs = logprobs[j, P:end].copy()
        record.versions = versions[j, P:end].copy()
        self._kv_versions[slot] = int(meta[j, 2])
        if with_kv:
          record.kv_version = int(meta[j, 2])
    if with_kv:
      self._read_back_kv(items)

  def _read_back_kv(self, items: list[tuple[int, SampleRecord]]) -> None:
    """KV of the positions written (all but the pending token and any given tokens not
    yet fed), slots grouped by length bucket, W per device call."""
    W = self.config.snapshot_width
    by_bucket: dict[int, list[tuple[int, SampleRecord]]] = {}
    for slot, record in items:
      used = int(self._lengths[slot]) - 1
      by_bucket.setdefault(self.bucket(max(used, 1)), []).append((slot, record))
    for kv_len, group in by_bucket.items():
      for i in range(0, len(group), W):
        chunk = group[i : i + W]
        slots = np.full(W, -1, np.int32)
        slots[: len(chunk)] = [slot for slot, _ in chunk]
        k, v = self._read_kv(slots, kv_len)
        for j, (slot, record) in enumerate(chunk):
          used = int(self._lengths[slot]) - 1
          record.kv_k, record.kv_v = k[:, j, :used].copy(), v[:, j, :used].copy()
          self._kv_bytes_read += record.kv_k.nbytes + record.kv_v.nbytes

  def _read_kv(self, slots: np.ndarray, kv_len: int, table: np.ndarray | None = None):
    """Host (k, v) [L, W, kv_len, K, H] of page-table rows `slots` (-1: none), through
    the book's table or a call's own `table` (kept_kv.py)."""
    if table is None:
      table = self._table()
    elif self.fns.state_sharding is not None:
      table = jax.device_put(table, self.fns.state_sharding.page_table)
    return to_host(self.fns.extract_kv(self.state, slots, kv_len, table))
