"""The sampler's device functions: prefill, insert, decode, extract (all pure).

  prefill_kv(params, tokens[B, T])          -> the KV of B sequences, [L, B, T, K, H]
  insert(state, kv, rows, slots[W], kv_rows[W], table)
                                            -> state with W slots written: their rows
                                               (rows.PackedRows) and KV, slot i taking row
                                               kv_rows[i] of kv [L, R, T, K, H] (rows
                                               may be shared: a prompt's samples), into
                                               the pages their table rows list
  decode(params, state, version, stop_ids, leave_after, table)
                                            -> state advanced by up to `sync_every` tokens
  extract_rows(state, slots[W])             -> the rows of several slots, one transfer
  extract_kv(state, slots[W], T, table)     -> several slots' KV up to T, one transfer
  extract_routes(state, slots[W], T)        -> several slots' recorded experts up to T
                                               (a Qwen3-MoE model's; state.py)
  write_rows(state, rows, slots[W])         -> state with W slots' rows rewritten and
                                               decoding again, their KV untouched (an
                                               observation appended in place)
  feed(params, state, slots[W], ends[W], T, table)
                                            -> state with W slots' given tokens (from
                                               their length - 1 up to ends - 1) written
                                               into their pages by one chunked prefill
                                               over their KV: each then stands at ends
  mark_done(state, mask)                    -> state with those slots stopped

Sequences' KV travel as [L, R, T, K, H] (R rows: prefill's output, the host buffer's
format); the slots' KV lives in a page pool [L, P, K, page, H] with a page table per
slot (state.py, pages.py; the host allocates, the device only reads the table, which
comes with each call that reads or writes pages, so uploading it is no call of its own). Writes
into and reads out of the pool, and decode attention, run per device on its own slots
and pages (`shard_map` with local indices): a page index is traced, and a dynamic slice
or gather at a traced index along a sharded axis would make XLA gather the whole pool
onto every device. `DeviceFns` jits them once per (model config, slot shapes,
mesh): T is bucketed by the caller, so steady state compiles nothing new. The state is
donated everywhere and, on a mesh, pinned to its shardings on the way out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from april_jax import sharding
from april_jax.models import paged_attention, paged_attention_kernel, qwen3
from april_jax.sampler import chunk_ops
from april_jax.sampler.speculation import decode as speculative
from april_jax.sampler.engine_config import DeviceSettings
from april_jax.sampler.sampling import sample_tokens
from april_jax.sampler.rows import READOUT, PackedRows, unpack
from april_jax.sampler import state as state_lib
from april_jax.sampler.state import SlotState, init_state, state_logical_axes


def prefill_kv(cfg: qwen3.Qwen3Config, params, tokens_BxT: jax.Array) -> qwen3.KVCache:
  """The KV of B (right-padded) sequences: k, v [L, B, T, K, H]; with a Qwen3-MoE model
  also each position's experts (routes [B, T, Ls, k] uint8), which insert records."""
  _, kv, seen = qwen3.hidden_states(cfg, params, tokens_BxT, return_kv=True, moe_out=True)
  if seen is None:
    return kv
  return kv._replace(routes=seen.experts.astype(jnp.uint8))


@dataclasses.dataclass(frozen=True)
class _CacheLayout:
  """Where the slot cache lies: the mesh, and the mesh axes of its slot and KV-head dims."""

  mesh: Any = None
  slot_axes: Any = None  # PartitionSpec entry of the slot dim (None: whole on each device)
  head_axes: Any = None  # PartitionSpec entry of the KV-head dim

  def local(self, fn, in_specs, out_specs):
    """fn run per device on local blocks (itself when there is no mesh)."""
    if self.mesh is None:
      return fn
    return jax.shard_map(
        fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )

  def first_local_slot(self, local_slots: int):
    if self.mesh is None or self.slot_axes is None:
      return 0
    return jax.lax.axis_index(self.slot_axes) * local_slots


def _write_kv(
    layout: _CacheLayout,
    state: SlotState,
    kv: qwen3.KVCache,
    slots_W: jax.Array,
    kv_rows_W: jax.Array,
) -> qwen3.KVCache:
  """Copies sequences' KV [L, R, T, K, H] into the pages of the slots slots_W (entries
  < 0 are padding), positions < T, each device into its own pages. Slot i takes KV row
  kv_rows_W[i]: several slots may share one (a prompt's samples). Only the pages a
  slot holds are written: pages past them go to the scratch page."""
  T = kv.k.shape[2]

  def local(ck, cv, nk, nv, table, slots, kv_rows):
    S_local, page = table.shape[0], ck.shape[3]
    first = layout.first_local_slot(S_local)
    span = min(T, page)  # positions per page write
    n_pages = -(-T // page)
    if n_pages * span > T:  # the capped last bucket: not a whole number of pages
      pad = ((0, 0), (0, 0), (0, n_pages * span - T), (0, 0), (0, 0))
      nk, nv = jnp.pad(nk, pad), jnp.pad(nv, pad)
    scratch = ck.shape[1] - 1
    # Once into the pool's layout and storage, by page: [L, R, n_pages, K, span, H].
    L, R, _, K, H = nk.shape
    by_page = lambda n, c: qwen3.kv_store(
        n.reshape(L, R, n_pages, span, K, H).transpose(0, 1, 2, 4, 3, 5), c.dtype
    )
    nk, nv = by_page(nk, ck), by_page(nv, cv)
    at = slots - first
    ok = (slots >= 0) & (at >= 0) & (at < S_local)
    ids = table[jnp.clip(at, 0, S_local - 1), :n_pages]  # [W, n_pages]
    ids = jnp.where(ok[:, None] & (ids >= 0), ids, scratch)
    # One scatter of a slot's pages per slot (W, static, unrolled): no loop over pages,
    # and a shared row is read in place rather than broadcast to W copies.
    row = lambda n, i: n[:, 0] if R == 1 else jax.lax.dynamic_index_in_dim(n, kv_rows[i], 1, False)
    for i in range(slots.shape[0]):
      ck = ck.at[:, ids[i], :, :span, :].set(row(nk, i))
      cv = cv.at[:, ids[i], :, :span, :].set(row(nv, i))
    return ck, cv

  P = PartitionSpec
  cache_spec = P(None, layout.slot_axes, layout.head_axes, None, None)
  new_spec = P(None, None, None, layout.head_axes, None)
  fn = layout.local(
      local,
      (cache_spec, cache_spec, new_spec, new_spec, P(layout.slot_axes, None), P(), P()),
      (cache_spec, cache_spec),
  )
  k, v = fn(state.kv.k, state.kv.v, kv.k, kv.v, state.page_table, slots_W, kv_rows_W)
  return qwen3.KVCache(k, v)


def _paged_attend(
    layout: _CacheLayout,
    state: SlotState,
    past_S: jax.Array,
    chunk_pages: int,
    decode_attention: str = "auto",
):
  """decode_step's `attend`: ragged attention over the pool, per device on its own slots,
  pages and heads. decode_attention "xla": paged_attention.py (the live pages are listed
  once per step, here, and every layer reads that list); "pallas": the kernel of
  paged_attention_kernel.py, which walks each slot's page table itself; "auto": the
  kernel on NVIDIA GPUs, the XLA path elsewhere (paged_attention_kernel.choose)."""
  P = PartitionSpec
  s, h = layout.slot_axes, layout.head_axes
  page_size = state.kv.k.shape[3]
  cache_spec = P(None, s, h, None, None)
  decode_attention = paged_attention_kernel.choose(decode_attention, page_size, state.kv.k.shape[4])
  if decode_attention == "pallas":
    fn = layout.local(
        functools.partial(paged_attention_kernel.paged_decode_attention, view=qwen3.kv_view),
        (P(s, h, None, None), P(s, h, None), P(s, h, None), cache_spec, cache_spec, P(), P(s))
        + (P(s, None),),
        P(s, h, None, None),
    )
    return lambda q, k_new, v_new, layer, past: fn(
        q, k_new, v_new, state.kv.k, state.kv.v, layer, past, state.page_table
    )

  def local_plan(past, table):
    plan = paged_attention.plan_pages(past, table, page_size, chunk_pages)
    return plan.pairs_3xE, plan.num_chunks[None]

  plan_fn = layout.local(local_plan, (P(s), P(s, None)), (P(None, s), P(s)))
  pairs, num_chunks = plan_fn(past_S, state.page_table)

  def local(q, k_new, v_new, pool_k, pool_v, layer, past, table, pairs, num_chunks):
    plan = paged_attention.PagePlan(pairs, num_chunks[0])
    return paged_attention.paged_decode_attention(
        q, k_new, v_new, pool_k, pool_v, layer, past, table, chunk_pages, qwen3.kv_view, plan
    )

  fn = layout.local(
      local,
      (P(s, h, None, None), P(s, h, None), P(s, h, None), cache_spec, cache_spec, P(), P(s))
      + (P(s, None), P(None, s), P(s)),
      P(s, h, None, None),
  )
  return lambda q, k_new, v_new, layer, past: fn(
      q, k_new, v_new, state.kv.k, state.kv.v, layer, past, state.page_table, pairs, num_chunks
  )


def _write_positions(
    layout: _CacheLayout, state: SlotState, new_k_LxBxKxH, new_v_LxBxKxH, positions_B, live_B
) -> qwen3.KVCache:
  """paged_attention.write_pages, run per device on its own slots and pages."""

  def local(ck, cv, nk, nv, table, pos, live):
    nk, nv = qwen3.kv_store(nk, ck.dtype), qwen3.kv_store(nv, cv.dtype)
    return paged_attention.write_pages((ck, cv), nk, nv, table, pos, live, ck.shape[1] - 1)

  P = PartitionSpec
  s = layout.slot_axes
  cache_spec = P(None, s, layout.head_axes, None, None)
  new_spec = P(None, s, layout.head_axes, None)
  fn = layout.local(
      local,
      (cache_spec, cache_spec, new_spec, new_spec, P(s, None), P(s), P(s)),
      (cache_spec, cache_spec),
  )
  k, v = fn(
      state.kv.k, state.kv.v, new_k_LxBxKxH, new_v_LxBxKxH, state.page_table, positions_B, live_B
  )
  return qwen3.KVCache(k, v)


def insert(
    layout: _CacheLayout,
    state: SlotState,
    kv_LxRxTxKxH: qwen3.KVCache,
    rows: PackedRows,
    slots_W: jax.Array,
    kv_rows_W: jax.Array,
    table_SxJ: jax.Array,
) -> SlotState:
  """Writes W slots: their KV (slot i takes row kv_rows_W[i] of kv, positions < T; see
  _write_kv) and their rows. Entries of slots_W < 0 are padding and change nothing. The
  slots start undone. table_SxJ: the page table as the host holds it now (it becomes
  the state's), so that an upload is no device call of its own.

  W and R are fixed per call site (one compile per T bucket, whatever the group size).
  """
  state = state.replace(page_table=table_SxJ)
  rows = unpack(rows)
  S = state.tokens.shape[0]
  at = jnp.where(slots_W >= 0, slots_W, S)  # out of range: dropped by the scatters below
  put = lambda a, v: a.at[at].set(v, mode="drop")
  fields = {
      f.name: put(getattr(state, f.name), getattr(rows, f.name)) for f in dataclasses.fields(rows)
  }
  if kv_LxRxTxKxH.routes is not None:  # a Qwen3-MoE model's, where the KV was written
    T = kv_LxRxTxKxH.k.shape[2]  # (host KV's are unrecorded: its record holds them)
    fields["routes"] = state.routes.at[at, :T].set(kv_LxRxTxKxH.routes[kv_rows_W], mode="drop")
  return state.replace(
      kv=_write_kv(layout, state, kv_LxRxTxKxH, slots_W, kv_rows_W),
      done=put(state.done, False),
      **fields,
  )


def write_rows(state: SlotState, rows: PackedRows, slots_W: jax.Array) -> SlotState:
  """Rewrites W slots' rows (entries of slots_W < 0 are padding) and starts them
  decoding again; their pages and KV stay as they are."""
  rows = unpack(rows)
  S = state.tokens.shape[0]
  at = jnp.where(slots_W >= 0, slots_W, S)
  put = lambda a, v: a.at[at].set(v, mode="drop")
  fields = {
      f.name: put(getattr(state, f.name), getattr(rows, f.name)) for f in dataclasses.fields(rows)
  }
  return state.replace(done=put(state.done, False), **fields)


def decode(
    layout: _CacheLayout,
    cfg: qwen3.Qwen3Config,
    sync_every: int,
    chunk_pages: int,
    decode_attention: str,
    params,
    state: SlotState,
    version: jax.Array,
    stop_ids_E: jax.Array,
    leave_after: jax.Array,
    table_SxJ: jax.Array,
):
  """Up to `sync_every` decode steps; leaves early once `leave_after` slots have
  finished in this call (0: only once every slot is done). table_SxJ: the page table as
  the host holds it now (it becomes the state's, as in insert). decode_attention: "auto",
  "xla" or "pallas" (_paged_attend).

  Returns (state, steps run, tokens drawn). Each drawn token is tagged min(version,
  kv_version): the oldest params its forward pass saw. A slot finishes on a drawn stop
  token or when its length reaches its limit; both are checked here, on device. Below
  forced_end a slot's next token is given (state.py): it keeps the logprob and version
  the host wrote for it. Attention reads each live
  slot's own pages, `chunk_pages` pages at a time (paged_attention.py), so a step costs
  what the live tokens hold and no length compiles a new program. The host has given
  every live slot the pages it can fill within the call (engine.step).
  """
  state = state.replace(page_table=table_SxJ)
  one = functools.partial(_decode_one, layout, cfg, chunk_pages, decode_attention, params)

  def step(carry):
    state, i, drawn_n, finished_n = carry
    state, drawn, finished = one(state, version, stop_ids_E)
    return state, i + 1, drawn_n + jnp.sum(drawn), finished_n + jnp.sum(finished)

  def keep_going(carry):
    state, i, _, finished_n = carry
    enough = (leave_after > 0) & (finished_n >= leave_after)
    return (i < sync_every) & ~enough & jnp.any(~state.done)

  zero = jnp.zeros((), jnp.int32)
  state, steps, drawn_n, _ = jax.lax.while_loop(keep_going, step, (state, zero, zero, zero))
  return state, steps, drawn_n


def _decode_one(layout, cfg, chunk_pages, decode_attention, params, state, version, stop_ids_E):
  """One decode step of every live slot: (state, drawn [S], finished [S]). A slot below
  its forced_end keeps its given token (drawn False there)."""
  S, M = state.tokens.shape
  rows = jnp.arange(S)
  live = ~state.done
  pos = jnp.maximum(state.length - 1, 0)
  last = state.tokens[rows, pos]
  past = jnp.where(live, pos, 0)
  attend = _paged_attend(layout, state, past, chunk_pages, decode_attention)
  write = lambda cache, nk, nv, p: _write_positions(layout, state, nk, nv, p, live)
  logits, kv, experts = qwen3.decode_step(
      cfg, params, last, pos, state.kv, live, 0, write, attend, return_experts=True
  )
  keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(state.rng), state.length)
  new_tok, new_lp = sample_tokens(logits, keys, state.temperature, state.top_k, state.top_p)
  at = jnp.minimum(state.length, M - 1)
  drawn = live & (state.length >= state.forced_end)  # else: the given token stays
  put = lambda a, v: a.at[rows, at].set(jnp.where(drawn, v, a[rows, at]))
  tokens = put(state.tokens, new_tok)
  length = state.length + live
  stopped = drawn & jnp.isin(tokens[rows, at], stop_ids_E)
  finished = live & (stopped | (length >= state.limit))
  state = state.replace(
      tokens=tokens,
      logprobs=put(state.logprobs, new_lp),
      versions=put(state.versions, jnp.minimum(version, state.kv_version)),
      kv=kv,
      length=length,
      done=state.done | finished,
      routes=state_lib.record_routes(state.routes, experts[:, None], pos[:, None], live[:, None]),
  )
  return state, drawn, finished


def feed(
    layout: _CacheLayout,
    cfg: qwen3.Qwen3Config,
    block_pages: int,
    params,
    state: SlotState,
    slots_W: jax.Array,
    ends_W: jax.Array,
    T: int,
    table_SxJ: jax.Array,
) -> SlotState:
  """Feeds W slots' given tokens in one call (entries of slots_W < 0 are padding): slot
  s's tokens from its pending one, at length - 1, up to ends - 2 go through the model
  as one chunk per slot (T >= ends - length, bucketed by the caller), attending to its
  pooled KV and causally to the chunk; their KV is written into its pages (which the
  host has given it) and the slot stands at length ends, its last given token pending,
  as that many decode steps would leave it."""
  state = state.replace(page_table=table_SxJ)
  S, M = state.tokens.shape
  ok = slots_W >= 0
  row = jnp.where(ok, slots_W, 0)
  start = jnp.where(ok, state.length[row] - 1, 0)
  count = jnp.where(ok, ends_W - 1 - start, 0)
  positions = start[:, None] + jnp.arange(T)[None, :]  # [W, T]
  tokens = jnp.take_along_axis(state.tokens[row], jnp.minimum(positions, M - 1), axis=1)
  live = ok[:, None] & (jnp.arange(T)[None, :] < count[:, None])  # [W, T]
  attend = chunk_ops.chunk_attend(layout, state, slots_W, start, block_pages)
  (k, v, _), experts = qwen3.chunk_kv(cfg, params, tokens, positions, attend, return_experts=True)
  kv = chunk_ops.write_chunks(layout, state, k, v, slots_W, positions, live)
  at = jnp.where(ok, slots_W, S)
  routes = state_lib.record_routes(state.routes, experts, positions, live, row)
  return state.replace(kv=kv, length=state.length.at[at].set(ends_W, mode="drop"), routes=routes)


def extract_rows(state: SlotState, slots_W: jax.Array):
  """Rows of W slots at once (entries < 0 are padding): tokens, logprobs, versions
  [W, M] and int32 [W, 4], the columns rows.READOUT names. One transfer
  for many samples."""
  idx = jnp.maximum(slots_W, 0)
  meta = jnp.stack([getattr(state, name)[idx] for name in READOUT], axis=-1)
  return state.tokens[idx], state.logprobs[idx], state.versions[idx], meta


def extract_kv(
    layout: _CacheLayout, state: SlotState, slots_W: jax.Array, kv_len: int, table_SxJ: jax.Array
):
  """The KV of W slots for positions < kv_len (entries < 0 are padding, zeros; so are
  positions past a slot's pages): k, v [L, W, kv_len, K, H], through the page table
  table_SxJ (the host's, as insert and decode take it). Each device reads its own slots'
  pages; the W rows are summed over the slot axes (one of them nonzero), so no device
  gathers the pool."""

  def local(ck, cv, table, slots):
    S_local, page = table.shape[0], ck.shape[3]
    first = layout.first_local_slot(S_local)
    n_pages = -(-kv_len // page)
    out = []
    for c in (ck, cv):
      L, _, K, _, H = c.shape

      def take(slot):
        at = slot - first
        ok = (slot >= 0) & (at >= 0) & (at < S_local)
        ids = table[jnp.clip(at, 0, S_local - 1), :n_pages]
        x = c[:, jnp.maximum(ids, 0)]  # [L, n_pages, K, page, H]
        keep = ok & (ids >= 0)
        x = jnp.where(keep[None, :, None, None, None], x, jnp.zeros_like(x))
        return x.transpose(0, 1, 3, 2, 4).reshape(L, n_pages * page, K, H)[:, :kv_len]

      rows = qwen3.kv_view(jax.vmap(take, out_axes=1)(slots))  # [L, W, T, K, H]
      if layout.mesh is not None and layout.slot_axes is not None:
        rows = jax.lax.psum(rows, layout.slot_axes)
      out.append(rows)
    return tuple(out)

  P = PartitionSpec
  cache_spec = P(None, layout.slot_axes, layout.head_axes, None, None)
  out_spec = P(None, None, None, layout.head_axes, None)
  fn = layout.local(
      local, (cache_spec, cache_spec, P(layout.slot_axes, None), P()), (out_spec, out_spec)
  )
  return fn(state.kv.k, state.kv.v, table_SxJ, slots_W)


def extract_routes(state: SlotState, slots_W: jax.Array, length: int) -> jax.Array:
  """W slots' recorded routes at positions < length (entries < 0 are padding): uint8
  [W, length, Ls, k], one transfer."""
  return state.routes[jnp.maximum(slots_W, 0), :length]


def mark_done(state: SlotState, mask_S: jax.Array) -> SlotState:
  return state.replace(done=state.done | mask_S)


@dataclasses.dataclass(frozen=True)
class DeviceFns:
  """The jitted device functions for one model config, slot shape and mesh."""

  init: Any
  prefill_kv: Any
  insert: Any
  decode: Any
  extract_rows: Any
  extract_kv: Any
  extract_routes: Any
  write_rows: Any
  mark_done: Any
  feed: Any
  speculate: Any = None  # speculative.decode, with speculative_tokens > 0
  shards: int = 1  # the slot axes' devices: slots and pages split this many ways
  pages_per_shard: int = 0  # pool pages of each shard, its scratch page included
  state_sharding: Any = None  # SlotState of NamedShardings (None without a mesh)
  kv_sharding: Any = None  # where sequences' KV [L, R, T, K, H] lie before insert

  def cache_sizes(self) -> dict[str, int]:
    """Compiled variants per function (to check that steady state compiles nothing)."""
    fns = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return {name: fn._cache_size() for name, fn in fns.items() if hasattr(fn, "_cache_size")}


FEED_BLOCK = 256  # pooled positions a feed call's attention reads per block


def chunk_pages_for(decode_block: int, page_size: int, pool_pages: int) -> int:
  """Pages per chunk of decode attention: decode_block positions, or the pool's
  `pool_pages` usable pages when that is fewer (a wider chunk would gather padding)."""
  return max(1, min(decode_block // page_size, pool_pages))


def _speculate(cfg, s: DeviceSettings, layout, state_sh, block_pages: int, traced):
  """speculative.decode jitted (None without speculation): its verify pass reads the
  pool as feed does, block_pages pages a block."""
  if not s.speculative_tokens:
    return None
  K, ngram = s.speculative_tokens, s.speculative_ngram
  verify = functools.partial(speculative.decode, layout, cfg, s.sync_every, K, ngram, block_pages)
  pin = {} if state_sh is None else {"out_shardings": (state_sh,) + (None,) * 4}
  return jax.jit(traced(verify), donate_argnums=1, **pin)


def _placement(init, mesh, rules):
  """(cache layout, SlotState of shardings, sequences' KV sharding); no mesh: none."""
  if mesh is None:
    return _CacheLayout(), None, None
  state_sh = sharding.named_shardings(state_logical_axes(), jax.eval_shape(init), mesh, rules)
  # Pages split exactly as the slots do (shards divides the pool by construction).
  slot_axes, head_axes = state_sh.length.spec[0], state_sh.kv.k.spec[2]
  pool_sh = NamedSharding(mesh, PartitionSpec(None, slot_axes, head_axes, None, None))
  state_sh = state_sh.replace(kv=qwen3.KVCache(pool_sh, pool_sh))
  # Prefilled KV and KV restored from the host arrive in one sharding (KV heads as in
  # the cache, replicated over slots), so `insert` compiles once per bucket and row
  # count whichever path the sequences came by, and each device receives only its heads.
  kv_sh = NamedSharding(mesh, PartitionSpec(None, None, None, head_axes, None))
  return _CacheLayout(mesh, slot_axes, head_axes), state_sh, kv_sh


def kv_shardings(cfg: qwen3.Qwen3Config, kv_sh) -> qwen3.KVCache:
  """Where sequences' KV lie before insert: k, v in kv_sh, a Qwen3-MoE model's routes
  replicated (None without a mesh)."""
  if kv_sh is None:
    return None
  routes = NamedSharding(kv_sh.mesh, PartitionSpec()) if cfg.num_experts else None
  return qwen3.KVCache(kv_sh, kv_sh, routes)


@functools.lru_cache(maxsize=32)
def device_fns(
    cfg: qwen3.Qwen3Config, settings: DeviceSettings, mesh=None, rules=sharding.DECODE_RULES
) -> DeviceFns:
  """Builds (once, then cached) the jitted functions for these static settings
  (EngineConfig.device_settings).

  `rules` place the slot state and the activations (the sampler's: DECODE_RULES). The
  pool has `usable_pages` pages, split over the slot axes' shards, plus one scratch page
  per shard. Attention reads decode_block // page_size pages per chunk, or a shard's
  whole pool when that is fewer: a chunk wider than the pool would gather padding."""
  s = settings
  num_slots, max_len, page_size = s.num_slots, s.max_len, s.page_size
  shards = 1
  if mesh is not None:
    spec = sharding.logical_to_spec(("batch",), (num_slots,), mesh, rules)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    shards = math.prod(mesh.shape[a] for a in axes)
  per_shard = -(-s.usable_pages // shards) + 1
  chunk_pages = chunk_pages_for(s.decode_block, page_size, per_shard - 1)
  # A feed's T queries score a block's positions at once: blocks of FEED_BLOCK positions
  # keep that tile small and read little past a short slot's KV.
  feed_pages = chunk_pages_for(min(s.decode_block, FEED_BLOCK), page_size, per_shard - 1)
  init = lambda: init_state(
      cfg, num_slots, max_len, jnp.dtype(s.kv_dtype), page_size, shards * per_shard
  )
  traced = lambda fn: sharding.traced_under(fn, mesh, rules)
  layout, state_sh, kv_sh = _placement(init, mesh, rules)
  pin = {} if state_sh is None else {"out_shardings": state_sh}
  pin_first = {} if state_sh is None else {"out_shardings": (state_sh, None, None)}
  pin_kv = {} if kv_sh is None else {"out_shardings": kv_shardings(cfg, kv_sh)}
  return DeviceFns(
      speculate=_speculate(cfg, s, layout, state_sh, feed_pages, traced),
      shards=shards,
      pages_per_shard=per_shard,
      state_sharding=state_sh,
      kv_sharding=kv_sh,
      init=jax.jit(init, **pin),
      prefill_kv=jax.jit(traced(functools.partial(prefill_kv, cfg)), **pin_kv),
      insert=jax.jit(functools.partial(insert, layout), donate_argnums=0, **pin),
      decode=jax.jit(
          traced(
              functools.partial(decode, layout, cfg, s.sync_every, chunk_pages, s.decode_attention)
          ),
          donate_argnums=1,
          **pin_first,
      ),
      extract_rows=jax.jit(extract_rows),
      extract_kv=jax.jit(functools.partial(extract_kv, layout), static_argnums=2),
      extract_routes=jax.jit(extract_routes, static_argnums=2),
      write_rows=jax.jit(write_rows, donate_argnums=0, **pin),
      mark_done=jax.jit(mark_done, donate_argnums=0, **pin),
      feed=jax.jit(
          traced(functools.partial(feed, layout, cfg, feed_pages)),
          donate_argnums=1,
          static_argnums=4,
          **pin,
      ),
  )
