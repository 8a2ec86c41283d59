"""The sampler's device functions: prefill, insert, decode, extract (all pure).

  prefill_kv(params, tokens[1, T])          -> the KV of one sequence, [L, 1, T, K, H]
  insert(state, kv, rows, slots[W])         -> state with W slots written: their rows
                                               (SlotRows) and KV, [L, W, T, K, H] (each
                                               its own) or [L, 1, T, K, H] (one shared)
  decode(params, state, version, stop_ids, leave_on_finish)
                                            -> state advanced by up to `sync_every` tokens
  extract_rows(state, slots[W])             -> the rows of several slots, one transfer
  extract_kv(state, slots[W], T)            -> several slots' KV up to T, one transfer
  mark_done(state, mask)                    -> state with those slots stopped

Sequences' KV travel as [L, R, T, K, H] (R rows: prefill's output, the host buffer's
format); the slot cache is [L, S, K, M, H]. Writes into and reads out of the cache run
per device on its own slots (`shard_map` with local slot indices): a slot index is traced, and a
dynamic slice at a traced index along a sharded axis would make XLA gather the whole
cache onto every device. `DeviceFns` jits them once per (model config, slot shapes,
mesh): T is bucketed by the caller, so steady state compiles nothing new. The state is
donated everywhere and, on a mesh, pinned to its shardings on the way out.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from april_jax import sharding
from april_jax.models import qwen3
from april_jax.sampler.sampling import sample_tokens
from april_jax.sampler.state import SlotRows, SlotState, init_state, state_logical_axes


def prefill_kv(cfg: qwen3.Qwen3Config, params, tokens_1xT: jax.Array) -> qwen3.KVCache:
  """The KV of one (right-padded) sequence: k, v [L, 1, T, K, H]."""
  _, kv = qwen3.hidden_states(cfg, params, tokens_1xT, return_kv=True)
  return kv


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
    layout: _CacheLayout, cache: qwen3.KVCache, kv: qwen3.KVCache, slots_W: jax.Array
) -> qwen3.KVCache:
  """Copies sequences' KV [L, R, T, K, H] into the slots slots_W (entries < 0 are
  padding), positions < T, each device into its own slots. Slot i takes KV row
  min(i, R - 1): R = W gives each its own, R = 1 shares one (a prompt's samples)."""

  def local(ck, cv, nk, nv, slots):
    S_local = ck.shape[1]
    first = layout.first_local_slot(S_local)

    def put(i, caches):
      at = slots[i] - first
      ok = (slots[i] >= 0) & (at >= 0) & (at < S_local)
      at = jnp.clip(at, 0, S_local - 1)
      out = []
      for c, n in zip(caches, (nk, nv)):
        row = jnp.minimum(i, n.shape[1] - 1)
        seq_LxTxKxH = jax.lax.dynamic_index_in_dim(n, row, 1, keepdims=False)
        new = qwen3.kv_store(seq_LxTxKxH.transpose(0, 2, 1, 3)[:, None], c.dtype)  # [L,1,K,T,H]
        start = (0, at, 0, 0, 0)
        old = jax.lax.dynamic_slice(c, start, new.shape)
        out.append(jax.lax.dynamic_update_slice(c, jnp.where(ok, new, old), start))
      return tuple(out)

    return jax.lax.fori_loop(0, slots.shape[0], put, (ck, cv))

  P = PartitionSpec
  cache_spec = P(None, layout.slot_axes, layout.head_axes, None, None)
  new_spec = P(None, None, None, layout.head_axes, None)
  fn = layout.local(
      local, (cache_spec, cache_spec, new_spec, new_spec, P()), (cache_spec, cache_spec)
  )
  return qwen3.KVCache(*fn(cache.k, cache.v, kv.k, kv.v, slots_W))


def _write_positions(
    layout: _CacheLayout, cache: qwen3.KVCache, new_k_LxBxKxH, new_v_LxBxKxH, positions_B
) -> qwen3.KVCache:
  """qwen3.write_positions, run per device on its own slots."""

  def local(ck, cv, nk, nv, pos):
    return tuple(qwen3.write_positions(qwen3.KVCache(ck, cv), nk, nv, pos))

  P = PartitionSpec
  cache_spec = P(None, layout.slot_axes, layout.head_axes, None, None)
  new_spec = P(None, layout.slot_axes, layout.head_axes, None)
  fn = layout.local(
      local,
      (cache_spec, cache_spec, new_spec, new_spec, P(layout.slot_axes)),
      (cache_spec, cache_spec),
  )
  return qwen3.KVCache(*fn(cache.k, cache.v, new_k_LxBxKxH, new_v_LxBxKxH, positions_B))


def insert(
    layout: _CacheLayout,
    state: SlotState,
    kv_LxRxTxKxH: qwen3.KVCache,
    rows: SlotRows,
    slots_W: jax.Array,
) -> SlotState:
  """Writes W slots: their KV (positions < T; see _write_kv) and their rows. Entries of
  slots_W < 0 are padding and change nothing. The slots start undone.

  W and R are fixed per call site (one compile per T bucket, whatever the group size).
  """
  S = state.tokens.shape[0]
  at = jnp.where(slots_W >= 0, slots_W, S)  # out of range: dropped by the scatters below
  put = lambda a, v: a.at[at].set(v, mode="drop")
  rows = rows.replace(rng=jax.random.wrap_key_data(rows.rng))  # host key data -> typed keys
  fields = {
      f.name: put(getattr(state, f.name), getattr(rows, f.name)) for f in dataclasses.fields(rows)
  }
  return state.replace(
      kv=_write_kv(layout, state.kv, kv_LxRxTxKxH, slots_W), done=put(state.done, False), **fields
  )


def decode(
    layout: _CacheLayout,
    cfg: qwen3.Qwen3Config,
    sync_every: int,
    block: int,
    params,
    state: SlotState,
    version: jax.Array,
    stop_ids_E: jax.Array,
    leave_on_finish: jax.Array = True,
):
  """Up to `sync_every` decode steps; leaves early once any slot finishes, if
  `leave_on_finish` (the host has a sample waiting for the freed slot), else once all do.

  Returns (state, steps run, tokens kept). Each token is tagged min(version, kv_version):
  the oldest params its forward pass saw. A slot finishes on a stop token or when its
  length reaches its limit; both are checked here, on device. Attention reads the
  cache in blocks of `block` keys up to the longest live slot (qwen3.decode_step), so
  short sequences do not pay for max_len and no length compiles a new program.
  """
  S, M = state.tokens.shape
  rows = jnp.arange(S)
  write_kv = functools.partial(_write_positions, layout)

  def step(carry):
    state, i, kept, _ = carry
    live = ~state.done
    pos = jnp.maximum(state.length - 1, 0)
    last = state.tokens[rows, pos]
    logits, kv = qwen3.decode_step(cfg, params, last, pos, state.kv, live, block, write_kv)
    keys = jax.vmap(jax.random.fold_in)(state.rng, state.length)
    new_tok, new_lp = sample_tokens(logits, keys, state.temperature, state.top_k, state.top_p)
    at = jnp.minimum(state.length, M - 1)
    write = lambda a, v: a.at[rows, at].set(jnp.where(live, v, a[rows, at]))
    length = state.length + live
    finished = live & (jnp.isin(new_tok, stop_ids_E) | (length >= state.limit))
    state = state.replace(
        tokens=write(state.tokens, new_tok),
        logprobs=write(state.logprobs, new_lp),
        versions=write(state.versions, jnp.minimum(version, state.kv_version)),
        kv=kv,
        length=length,
        done=state.done | finished,
    )
    return state, i + 1, kept + jnp.sum(live), jnp.any(finished)

  def keep_going(carry):
    state, i, _, any_finished = carry
    return (i < sync_every) & ~(any_finished & leave_on_finish) & jnp.any(~state.done)

  zero = jnp.zeros((), jnp.int32)
  state, steps, kept, _ = jax.lax.while_loop(
      keep_going, step, (state, zero, zero, jnp.zeros((), bool))
  )
  return state, steps, kept


def extract_rows(state: SlotState, slots_W: jax.Array):
  """Rows of W slots at once (entries < 0 are padding): tokens, logprobs, versions
  [W, M] and int32 [W, 3] (length, prompt_len, kv_version). One transfer for many
  samples."""
  idx = jnp.maximum(slots_W, 0)
  meta = jnp.stack([state.length[idx], state.prompt_len[idx], state.kv_version[idx]], axis=-1)
  return state.tokens[idx], state.logprobs[idx], state.versions[idx], meta


def extract_kv(layout: _CacheLayout, state: SlotState, slots_W: jax.Array, kv_len: int):
  """The KV of W slots for positions < kv_len (entries < 0 are padding, zeros):
  k, v [L, W, kv_len, K, H]. Each device reads its own slots; the W rows are summed
  over the slot axes (one of them nonzero), so no device gathers the cache."""

  def local(ck, cv, slots):
    S_local = ck.shape[1]
    first = layout.first_local_slot(S_local)
    out = []
    for c in (ck, cv):
      L, _, K, _, H = c.shape

      def take(slot):
        at = slot - first
        ok = (slot >= 0) & (at >= 0) & (at < S_local)
        x = jax.lax.dynamic_slice(
            c, (0, jnp.clip(at, 0, S_local - 1), 0, 0, 0), (L, 1, K, kv_len, H)
        )[:, 0]
        return jnp.where(ok, x, jnp.zeros_like(x))

      rows_WxLxKxTxH = jax.vmap(take)(slots)
      rows = qwen3.kv_view(rows_WxLxKxTxH.transpose(1, 0, 3, 2, 4))  # [L, W, T, K, H]
      if layout.mesh is not None and layout.slot_axes is not None:
        rows = jax.lax.psum(rows, layout.slot_axes)
      out.append(rows)
    return tuple(out)

  P = PartitionSpec
  cache_spec = P(None, layout.slot_axes, layout.head_axes, None, None)
  out_spec = P(None, None, None, layout.head_axes, None)
  fn = layout.local(local, (cache_spec, cache_spec, P()), (out_spec, out_spec))
  return fn(state.kv.k, state.kv.v, slots_W)


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
  mark_done: Any
  state_sharding: Any = None  # SlotState of NamedShardings (None without a mesh)
  kv_sharding: Any = None  # where sequences' KV [L, R, T, K, H] lie before insert

  def cache_sizes(self) -> dict[str, int]:
    """Compiled variants per function (to check that steady state compiles nothing)."""
    fns = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return {name: fn._cache_size() for name, fn in fns.items() if hasattr(fn, "_cache_size")}


@functools.lru_cache(maxsize=32)
def device_fns(
    cfg: qwen3.Qwen3Config,
    num_slots: int,
    max_len: int,
    sync_every: int,
    kv_dtype: str = "float32",
    mesh=None,
    rules=sharding.DECODE_RULES,
    decode_block: int = 1024,
) -> DeviceFns:
  """Builds (once, then cached) the jitted functions for these static settings.

  `rules` place the slot state and the activations (the sampler's: DECODE_RULES)."""
  init = lambda: init_state(cfg, num_slots, max_len, jnp.dtype(kv_dtype))
  traced = lambda fn: sharding.traced_under(fn, mesh, rules)
  if mesh is None:
    layout, state_sh, kv_sh = _CacheLayout(), None, None
  else:
    state_sh = sharding.named_shardings(state_logical_axes(), jax.eval_shape(init), mesh, rules)
    cache_spec = state_sh.kv.k.spec
    layout = _CacheLayout(mesh, cache_spec[1], cache_spec[2])
    # Prefilled KV and KV restored from the host arrive in one sharding (KV heads as in
    # the cache, replicated over slots), so `insert` compiles once per bucket and row
    # count whichever path the sequences came by, and each device receives only its heads.
    kv_sh = NamedSharding(mesh, PartitionSpec(None, None, None, layout.head_axes, None))
  pin = {} if state_sh is None else {"out_shardings": state_sh}
  pin_first = {} if state_sh is None else {"out_shardings": (state_sh, None, None)}
  pin_kv = {} if kv_sh is None else {"out_shardings": qwen3.KVCache(kv_sh, kv_sh)}
  return DeviceFns(
      state_sharding=state_sh,
      kv_sharding=kv_sh,
      init=jax.jit(init, **pin),
      prefill_kv=jax.jit(traced(functools.partial(prefill_kv, cfg)), **pin_kv),
      insert=jax.jit(functools.partial(insert, layout), donate_argnums=0, **pin),
      decode=jax.jit(
          traced(functools.partial(decode, layout, cfg, sync_every, decode_block)),
          donate_argnums=1,
          **pin_first,
      ),
      extract_rows=jax.jit(extract_rows),
      extract_kv=jax.jit(functools.partial(extract_kv, layout), static_argnums=2),
      mark_done=jax.jit(mark_done, donate_argnums=0, **pin),
  )
