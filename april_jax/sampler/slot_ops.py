"""The sampler's device functions: prefill, insert, decode, extract (all pure).

  prefill_kv(params, tokens[1, T])          -> the KV of one sequence, [L, T, K, H]
  insert(state, kv, slots[W], rows...)      -> state with one sequence copied into slots
  insert_rows(state, kv, slots[W], rows...) -> state with W sequences (own KV) put back
  decode(window, params, state, version, stop_ids, leave_on_finish)
                                            -> state advanced by up to `sync_every` tokens
  extract_rows(state, slots[W])             -> the rows of several slots, one transfer
  extract_kv(state, slots[W], T)            -> several slots' KV up to T, one transfer
  mark_done(state, mask)                    -> state with those slots stopped

`DeviceFns` jits them once per (model config, slot shapes, mesh): T is bucketed by
the caller, so steady state compiles nothing new. The state is donated everywhere
and, on a mesh, pinned to its shardings on the way out.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from april_jax import sharding
from april_jax.models import qwen3
from april_jax.sampler.sampling import sample_tokens
from april_jax.sampler.state import SlotState, state_logical_axes


def prefill_kv(cfg: qwen3.Qwen3Config, params, tokens_1xT: jax.Array) -> qwen3.KVCache:
  """The KV of one (right-padded) sequence: k, v [L, T, K, H]."""
  _, kv = qwen3.hidden_states(cfg, params, tokens_1xT, return_kv=True)
  return qwen3.KVCache(kv.k[:, 0], kv.v[:, 0])


def _put_slots(state: SlotState, slots_W: jax.Array, kv_of, **rows_W) -> SlotState:
  """Writes W slots: kv_of(i) gives slot i's (k, v) [L, 1, T, K, H], copied in place with
  dynamic_update_slice (no [L, W, ...] scatter); rows_W gives [W, ...] per state field.
  Entries of slots_W < 0 are padding and change nothing. The slots start undone."""
  S = state.tokens.shape[0]
  valid_W = slots_W >= 0
  rows = jnp.where(valid_W, slots_W, S)  # out of range: dropped by the scatters below

  def put_kv(i, caches):
    slot = jnp.maximum(slots_W[i], 0)
    out = []
    for cache, new in zip(caches, kv_of(i)):
      new = new.astype(cache.dtype)
      old = jax.lax.dynamic_slice(cache, (0, slot, 0, 0, 0), new.shape)
      out.append(jax.lax.dynamic_update_slice(cache, jnp.where(valid_W[i], new, old),
                                              (0, slot, 0, 0, 0)))
    return tuple(out)

  k, v = jax.lax.fori_loop(0, slots_W.shape[0], put_kv, (state.kv.k, state.kv.v))
  put = lambda a, v: a.at[rows].set(v, mode="drop")
  fields = {name: put(getattr(state, name), value) for name, value in rows_W.items()}
  return state.replace(kv=qwen3.KVCache(k, v), done=put(state.done, False), **fields)


def insert(state: SlotState, kv_LxTxKxH: qwen3.KVCache, slots_W: jax.Array,
           tokens_M: jax.Array, logprobs_M: jax.Array, versions_M: jax.Array,
           length: jax.Array, prompt_len: jax.Array, limit_W: jax.Array,
           temperature_W: jax.Array, top_k_W: jax.Array, top_p_W: jax.Array,
           rng_Wx2: jax.Array) -> SlotState:
  """Copies one sequence (its KV for positions < T, its rows) into the slots `slots_W`.

  slots_W has a fixed width W (one compile per T bucket, whatever the group size);
  entries < 0 are padding and change nothing.
  """
  W = slots_W.shape[0]
  row = lambda a: jnp.broadcast_to(a, (W,) + a.shape)
  return _put_slots(
      state, slots_W, lambda i: tuple(x[:, None] for x in kv_LxTxKxH),
      tokens=row(tokens_M), logprobs=row(logprobs_M), versions=row(versions_M),
      length=row(length), prompt_len=row(prompt_len), limit=limit_W,
      temperature=temperature_W, top_k=top_k_W, top_p=top_p_W, rng=rng_Wx2)


def insert_rows(state: SlotState, kv_LxWxTxKxH: qwen3.KVCache, slots_W: jax.Array,
                tokens_WxM: jax.Array, logprobs_WxM: jax.Array, versions_WxM: jax.Array,
                length_W: jax.Array, prompt_len_W: jax.Array, limit_W: jax.Array,
                temperature_W: jax.Array, top_k_W: jax.Array, top_p_W: jax.Array,
                rng_Wx2: jax.Array) -> SlotState:
  """Puts W partial samples back, each with its own KV (positions < T) and rows.

  The batched path for resuming held samples: one call (and one host-to-device copy)
  per W samples. Entries of slots_W < 0 are padding and change nothing.
  """
  kv_of = lambda i: tuple(jax.lax.dynamic_slice_in_dim(x, i, 1, axis=1) for x in kv_LxWxTxKxH)
  return _put_slots(
      state, slots_W, kv_of, tokens=tokens_WxM, logprobs=logprobs_WxM,
      versions=versions_WxM, length=length_W, prompt_len=prompt_len_W, limit=limit_W,
      temperature=temperature_W, top_k=top_k_W, top_p=top_p_W, rng=rng_Wx2)


def decode(cfg: qwen3.Qwen3Config, sync_every: int, window: int, params, state: SlotState,
           version: jax.Array, stop_ids_E: jax.Array, leave_on_finish: jax.Array = True):
  """Up to `sync_every` decode steps; leaves early once any slot finishes, if
  `leave_on_finish` (the host has a sample waiting for the freed slot), else once all do.

  Returns (state, steps run, tokens kept). A slot finishes on a stop token or when its
  length reaches its limit; both are checked here, on device. Attention reads the
  first `window` cache entries only (static; the host picks a bucket above every live
  slot's length + sync_every), so short sequences do not pay for max_len.
  """
  S, M = state.tokens.shape
  rows = jnp.arange(S)

  def step(carry):
    state, i, kept, _ = carry
    live = ~state.done
    pos = jnp.maximum(state.length - 1, 0)
    logits, kv = qwen3.decode_step(cfg, params, state.tokens[rows, pos], pos, state.kv,
                                   window)
    keys = jax.vmap(lambda d, t: jax.random.fold_in(jax.random.wrap_key_data(d), t))(
        state.rng, state.length)
    new_tok, new_lp = sample_tokens(logits, keys, state.temperature, state.top_k,
                                    state.top_p)
    at = jnp.minimum(state.length, M - 1)
    write = lambda a, v: a.at[rows, at].set(jnp.where(live, v, a[rows, at]))
    length = state.length + live
    finished = live & (jnp.isin(new_tok, stop_ids_E) | (length >= state.limit))
    state = state.replace(
        tokens=write(state.tokens, new_tok), logprobs=write(state.logprobs, new_lp),
        versions=write(state.versions, jnp.broadcast_to(version, (S,))), kv=kv,
        length=length, done=state.done | finished)
    return state, i + 1, kept + jnp.sum(live), jnp.any(finished)

  def keep_going(carry):
    state, i, _, any_finished = carry
    return (i < sync_every) & ~(any_finished & leave_on_finish) & jnp.any(~state.done)

  zero = jnp.zeros((), jnp.int32)
  state, steps, kept, _ = jax.lax.while_loop(keep_going, step,
                                             (state, zero, zero, jnp.zeros((), bool)))
  return state, steps, kept


def extract_rows(state: SlotState, slots_W: jax.Array):
  """Rows of W slots at once (entries < 0 are padding): tokens, logprobs, versions
  [W, M] and int32 [W, 2] (length, prompt_len). One transfer for many samples."""
  idx = jnp.maximum(slots_W, 0)
  meta = jnp.stack([state.length[idx], state.prompt_len[idx]], axis=-1)
  return state.tokens[idx], state.logprobs[idx], state.versions[idx], meta


def extract_kv(state: SlotState, slots_W: jax.Array, kv_len: int):
  """The KV of W slots for positions < kv_len (entries < 0 are padding):
  k, v [L, W, kv_len, K, H]. One transfer for several samples."""
  idx = jnp.maximum(slots_W, 0)
  take = lambda cache: cache[:, idx, :kv_len]
  return take(state.kv.k), take(state.kv.v)


def mark_done(state: SlotState, mask_S: jax.Array) -> SlotState:
  return state.replace(done=state.done | mask_S)


@dataclasses.dataclass(frozen=True)
class DeviceFns:
  """The jitted device functions for one model config, slot shape and mesh."""
  init: Any
  prefill_kv: Any
  insert: Any
  insert_rows: Any
  decode: Any
  extract_rows: Any
  extract_kv: Any
  mark_done: Any
  kv_sharding: Any = None   # where one sequence's KV lives between prefill and insert
  kv_rows_sharding: Any = None  # where W restored sequences' KV [L, W, T, K, H] lands

  def cache_sizes(self) -> dict[str, int]:
    """Compiled variants per function (to check that steady state compiles nothing)."""
    fns = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return {name: fn._cache_size() for name, fn in fns.items() if hasattr(fn, "_cache_size")}


@functools.lru_cache(maxsize=32)
def device_fns(cfg: qwen3.Qwen3Config, num_slots: int, max_len: int, sync_every: int,
               kv_dtype: str = "float32", mesh=None,
               rules=sharding.DEFAULT_RULES) -> DeviceFns:
  """Builds (once, then cached) the jitted functions for these static settings."""
  from april_jax.sampler.state import init_state  # pylint: disable=g-import-not-at-top
  init = lambda: init_state(cfg, num_slots, max_len, jnp.dtype(kv_dtype))
  if mesh is None:
    state_sh = None
  else:
    shapes = jax.eval_shape(init)
    state_sh = sharding.named_shardings(state_logical_axes(), shapes, mesh, rules)
  pin = {} if state_sh is None else {"out_shardings": state_sh}
  pin_first = {} if state_sh is None else {"out_shardings": (state_sh, None, None)}
  kv_sh = kv_rows_sh = None
  if mesh is not None:
    # Prefilled KV and KV restored from the host arrive in one sharding, so `insert`
    # compiles once per bucket whichever path the sequence came by.
    spec = sharding.logical_to_spec(("layers", "cache_seq", "kv_heads", "head_dim"),
                                    (cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim),
                                    mesh, rules)
    kv_sh = jax.sharding.NamedSharding(mesh, spec)
    rows_spec = sharding.logical_to_spec(
        ("layers", None, "cache_seq", "kv_heads", "head_dim"),
        (cfg.num_layers, 1, 1, cfg.num_kv_heads, cfg.head_dim), mesh, rules)
    kv_rows_sh = jax.sharding.NamedSharding(mesh, rows_spec)
  pin_kv = {} if kv_sh is None else {"out_shardings": qwen3.KVCache(kv_sh, kv_sh)}
  return DeviceFns(
      kv_sharding=kv_sh, kv_rows_sharding=kv_rows_sh,
      init=jax.jit(init, **pin),
      prefill_kv=jax.jit(functools.partial(prefill_kv, cfg), **pin_kv),
      insert=jax.jit(insert, donate_argnums=0, **pin),
      insert_rows=jax.jit(insert_rows, donate_argnums=0, **pin),
      decode=jax.jit(functools.partial(decode, cfg, sync_every), static_argnums=0,
                     donate_argnums=2, **pin_first),
      extract_rows=jax.jit(extract_rows),
      extract_kv=jax.jit(extract_kv, static_argnums=2),
      mark_done=jax.jit(mark_done, donate_argnums=0, **pin),
  )
