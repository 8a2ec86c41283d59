"""The slots' device state and every copy between it and the host: SlotState's one owner.

Each jitted call that changes the state (slot_ops.py) is made here, and so is each
transfer: records' rows and host KV to the device, drawn tokens and KV back to the host.
Calls are padded to their fixed widths (insert_width, snapshot_width), so a run compiles
one program per length bucket; bytes of KV moved either way are counted in the engine's
counters. Nothing here decides which slot holds what (slots.py) or where pages go
(kv_manager.py): callers pass slots and the page table.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from april_jax.runtime.distributed import to_host
from april_jax.models import moe, qwen3
from april_jax.sampler import slot_ops
from april_jax.sampler.speculation import decode as speculative
from april_jax.sampler.contract import EngineCounters
from april_jax.sampler.speculation.drafts import DraftInputs
from april_jax.sampler.engine_config import EngineConfig
from april_jax.sampler.records import SampleRecord
from april_jax.sampler.rows import kv_positions, readout, rows_from_records


def _padded(slots, width: int) -> np.ndarray:
  out = np.full(width, -1, np.int32)
  out[: len(slots)] = slots
  return out


class DeviceSlots:
  """The device state of `config.num_slots` slots, changed by `fns` (slot_ops.DeviceFns)."""

  def __init__(self, cfg: qwen3.Qwen3Config, config: EngineConfig, fns, counters: EngineCounters):
    self.cfg, self.config, self.fns, self.counters = cfg, config, fns, counters
    self.state = fns.init()
    # What speculation drafts from besides the slots' rows (drafts.DraftInputs: suggested
    # tokens, each slot's prompt's past samples), on the host; sent with the next decode
    # call after a change.
    # (Without speculation nothing reads them: no row is held.)
    S = config.num_slots
    M = config.max_len if config.speculative_tokens else 0
    H = config.speculative_history if config.speculative_tokens else 0
    self.draft_inputs = DraftInputs(
        suggested=np.full((S, M), -1, np.int32),
        history=np.full((S, H, M), -1, np.int32),
        history_len=np.zeros((S, H), np.int32),
    )
    self._draft_inputs_arg = None
    # Where they go on a mesh: split over the slots as the state's rows are.
    self._slot_rows = None
    if fns.state_sharding is not None:
      sh = fns.state_sharding.length  # NamedSharding of [S]
      row = lambda n: NamedSharding(sh.mesh, PartitionSpec(sh.spec[0], *([None] * n)))
      self._slot_rows = DraftInputs(row(1), row(2), row(1))

  # ----------------------------------------------------------------- writes
  def insert(self, kv, width, slots, records, kv_versions, lengths, kv_rows, table) -> None:
    """One insert call of `width` slots (insert_width, or snapshot_width for restored
    KV): up to that many records into slots, each with row kv_rows[i] of the KV
    [L, R, T, K, H] (rows may be shared) and decoding at lengths[i]."""
    rows_at = np.zeros(width, np.int32)
    rows_at[: len(kv_rows)] = kv_rows
    rows = rows_from_records(records, width, self.config.max_len, kv_versions, lengths)
    self.state = self.fns.insert(self.state, kv, rows, _padded(slots, width), rows_at, table)

  def insert_shared(self, kv, kv_version: int, items, table, length: int | None = None) -> None:
    """KV [L, R, T, K, H] into slots, `insert_width` slots per call: items are (slot,
    record, its KV row); `length`: where their decoding stands (default: their own)."""
    W = self.config.insert_width
    for i in range(0, len(items), W):
      slots, records, kv_rows = zip(*items[i : i + W])
      lengths = [r.length if length is None else length for r in records]
      self.insert(kv, W, slots, records, [kv_version] * len(slots), lengths, kv_rows, table)

  def write_rows(self, records, slots, kv_versions, lengths) -> None:
    """The records' rows into their slots (insert_width per call), decoding again at
    `lengths`, their KV untouched. No records: one call that writes nothing (warm-up)."""
    W = self.config.insert_width
    for i in range(0, max(len(records), 1), W):
      chunk = list(records[i : i + W])
      rows = rows_from_records(
          chunk, W, self.config.max_len, list(kv_versions[i : i + W]), list(lengths[i : i + W])
      )
      self.state = self.fns.write_rows(self.state, rows, _padded(slots[i : i + W], W))

  def decode(
      self, params, version: int, stop_ids, leave_after: int, table, read=True, speculate=None
  ):
    """One decode call: plain, or with `speculate` (the slots that decode, which needs
    speculative_tokens > 0) speculative.decode over them, padded to a verify width. On
    the host: (done [S], lengths [S], steps run, tokens drawn, speculation's stats [3,
    sources] and the pass each slot finished at [S] (-1: none), or None, None), unless
    not `read` (warm-up: nothing is read back, None)."""
    args = (np.int32(version), stop_ids, np.int32(leave_after), table)
    stats = finished_at = None
    if speculate is None:
      self.state, steps, drawn = self.fns.decode(params, self.state, *args)
    else:
      if self._draft_inputs_arg is None:
        self._draft_inputs_arg = jax.device_put(self.draft_inputs, self._slot_rows)
      S = self.config.num_slots
      slots = _padded(speculate, speculative.width_for(len(speculate), S))
      self.state, steps, drawn, stats, finished_at = self.fns.speculate(
          params, self.state, *args, self._draft_inputs_arg, slots
      )
    if not read:
      return None
    out = to_host((self.state.done, self.state.length, steps, drawn, stats, finished_at))
    if speculate is not None:  # [W] -> [S]
      at = np.full(self.config.num_slots, -1, np.int32)
      at[slots[slots >= 0]] = out[5][slots >= 0]
      out = out[:5] + (at,)
    return out

  def suggest(self, slot: int, start: int, tokens) -> None:
    """Tokens a slot's drafts take from position `start` on (speculation's `suggested`
    source); none past max_len."""
    if not self.config.speculative_tokens:
      return  # nothing drafts
    tokens = np.asarray(tokens, np.int32)[: max(self.config.max_len - start, 0)]
    self.draft_inputs.suggested[slot, start : start + len(tokens)] = tokens
    self._draft_inputs_arg = None

  def set_history(self, slot: int, rows: list[np.ndarray]) -> None:
    """A slot's `history` rows (its prompt's past samples, most recent first; as many
    as speculative_history holds, each cut to max_len)."""
    inputs, M = self.draft_inputs, self.config.max_len
    if not rows and not inputs.history_len[slot].any():
      return
    inputs.history[slot] = -1
    inputs.history_len[slot] = 0
    for i, row in enumerate(rows[: inputs.history.shape[1]]):
      inputs.history[slot, i, : min(len(row), M)] = row[:M]
      inputs.history_len[slot, i] = min(len(row), M)
    self._draft_inputs_arg = None

  def forget_drafts(self, slot: int) -> None:
    """No suggested tokens or history rows for the slot (it is free again)."""
    inputs = self.draft_inputs
    if (inputs.suggested[slot] >= 0).any():
      inputs.suggested[slot] = -1
      self._draft_inputs_arg = None
    self.set_history(slot, [])

  def feed(self, params, slots: np.ndarray, ends: np.ndarray, T: int, table) -> None:
    """Given tokens into the slots' pages up to `ends` (one chunked prefill, slot_ops.feed)."""
    self.state = self.fns.feed(params, self.state, slots, ends, T, table)

  def mark_done(self, mask: np.ndarray) -> None:
    self.state = self.fns.mark_done(self.state, mask)

  # ----------------------------------------------------------- host -> device
  def on_device(self, kv: qwen3.KVCache) -> qwen3.KVCache:
    """Host KV as device arrays (in the KV's sharding on a mesh): what a prefill's KV is,
    so an insert of either hits the same compiled program (a numpy argument would trace
    one of its own). A Qwen3-MoE model's carries routes as a prefill's does, all
    unrecorded: the records hold those positions' own."""
    if self.cfg.num_experts and kv.routes is None:
      _, R, T = kv.k.shape[:3]
      kv = kv._replace(routes=np.full((R, T) + self.cfg.route_shape, moe.UNRECORDED, np.uint8))
    return jax.device_put(kv, slot_ops.kv_shardings(self.cfg, self.fns.kv_sharding))

  def host_kv(self, records: list[SampleRecord], kv_len: int) -> qwen3.KVCache:
    """Records' host KV as rows [L, R, kv_len, K, H] (R = snapshot_width), zero-padded,
    on the device."""
    cfg = self.cfg
    shape = (cfg.num_layers, self.config.snapshot_width, kv_len, cfg.num_kv_heads, cfg.head_dim)
    k, v = np.zeros(shape, self.config.kv_dtype), np.zeros(shape, self.config.kv_dtype)
    for j, r in enumerate(records):
      k[:, j, : kv_positions(r)], v[:, j, : kv_positions(r)] = r.kv_k, r.kv_v
      self.counters.kv_bytes_to_device += r.kv_k.nbytes + r.kv_v.nbytes
    return self.on_device(qwen3.KVCache(k, v))

  def one_host_kv(self, r: SampleRecord, kv_len: int) -> qwen3.KVCache:
    """One sample's host KV [L, 1, kv_len, K, H] on the device (as a prefill's KV: no
    rows of padding cross to the device)."""
    pad = ((0, 0), (0, kv_len - kv_positions(r)), (0, 0), (0, 0))
    kv = qwen3.KVCache(np.pad(r.kv_k, pad)[:, None], np.pad(r.kv_v, pad)[:, None])
    self.counters.kv_bytes_to_device += r.kv_k.nbytes + r.kv_v.nbytes
    return self.on_device(kv)

  # ----------------------------------------------------------- device -> host
  def read_rows(self, slots: list[int]):
    """Each slot's response (tokens, logprobs, versions past its prompt; given tokens not
    fed yet included) and its KV's version, insert_width slots per transfer."""
    W, out = self.config.insert_width, []
    for i in range(0, len(slots), W):
      chunk = slots[i : i + W]
      tokens, logprobs, versions, meta = to_host(
          self.fns.extract_rows(self.state, _padded(chunk, W))
      )
      row = readout(meta)
      for j in range(len(chunk)):
        P, end = int(row["prompt_len"][j]), max(int(row["length"][j]), int(row["forced_end"][j]))
        out.append((tokens[j, P:end], logprobs[j, P:end], versions[j, P:end], row["kv_version"][j]))
    return out

  def read_routes(self, used: list[tuple[int, int]], bucket) -> list[np.ndarray]:
    """The routes [n, Ls, k] each (slot, n) recorded at positions < n, in `used`'s order:
    slots grouped by length bucket, insert_width per transfer (a Qwen3-MoE model's)."""
    out = [None] * len(used)
    for length, chunk in _bucketed(used, bucket, self.config.insert_width):
      slots = _padded([used[c][0] for c in chunk], self.config.insert_width)
      routes = to_host(self.fns.extract_routes(self.state, slots, length))
      for j, c in enumerate(chunk):
        out[c] = routes[j, : used[c][1]].copy()
    return out

  def read_kv(self, slots: np.ndarray, kv_len: int, table) -> tuple[np.ndarray, np.ndarray]:
    """Host (k, v) [L, W, kv_len, K, H] of page-table rows `slots` (-1: none)."""
    self.counters.kv_reads += 1
    return to_host(self.fns.extract_kv(self.state, slots, kv_len, table))

  def read_kvs(self, used: list[tuple[int, int]], bucket, table) -> list:
    """(k, v) [L, n, K, H] of each (slot, its n written positions), in `used`'s order:
    slots grouped by length bucket, snapshot_width per transfer."""
    W = self.config.snapshot_width
    out = [None] * len(used)
    for kv_len, chunk in _bucketed(used, bucket, W):
      k, v = self.read_kv(_padded([used[c][0] for c in chunk], W), kv_len, table)
      for j, c in enumerate(chunk):
        n = used[c][1]
        out[c] = (k[:, j, :n].copy(), v[:, j, :n].copy())
        self.counters.kv_bytes_to_host += out[c][0].nbytes + out[c][1].nbytes
    return out


def _bucketed(used: list[tuple[int, int]], bucket, width: int):
  """(length bucket, indices into `used` of up to `width` slots whose n it holds): one
  transfer each."""
  by_bucket: dict[int, list[int]] = {}
  for i, (_, n) in enumerate(used):
    by_bucket.setdefault(bucket(max(n, 1)), []).append(i)
  for length, indices in by_bucket.items():
    for i in range(0, len(indices), width):
      yield length, indices[i : i + width]
