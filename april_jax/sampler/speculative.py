"""Speculative decoding that draws exactly the tokens plain decoding draws.

  decode(params, state, version, stop_ids, leave_after, table, draft_inputs)
      -> (state, verify passes run, tokens drawn, stats [3, len(drafts.SOURCES)],
          the pass each slot finished at [S] (-1: none))

The decode call of slot_ops.decode, with up to K tokens guessed per live slot and
checked in one pass. Each pass (one iteration of the call's loop):
  1. drafts.propose guesses up to K tokens for each slot's next positions, bounded by
     the pages the slot holds (a guess's KV must land in its own pages), its token
     budget, and none while its next token is given (an observation, fed as plain
     decoding feeds it);
  2. one forward pass over each slot's pending token and its drafts (K + 1 positions,
     the chunked path feed uses: qwen3.chunk_kv with logits, attending to the slot's
     pages) gives the logits after every position and writes their KV into its pages;
  3. at each position L + j the token is drawn as plain decoding draws it there: from
     that position's logits, with that position's key fold_in(rng, L + j), its
     temperature, top-k and top-p (sampling.sample_tokens);
  4. drafts.accepted keeps the draws up to the first one that differs from its draft or
     is a stop token, that one included: 1 to K + 1 tokens. The slot's length moves past
     them; the KV written for rejected drafts lies past it, where the next pass
     overwrites it, and the slot's pages stay.
A draw depends only on the position's key and the logits there, and those are the
logits plain decoding computes after the same tokens. So the tokens are plain
decoding's, whichever drafts were right; the behaviour logprobs are the verify pass's
(equal in float32 up to the order of the attention's sums, docs/speculative.md). A pass
reads every weight once for up to K + 1 tokens a slot, which is what speeds the tail of
a step, where few slots are live.

A slot moves while its pending token's position lies in its pages: the host reserves
sync_every + K positions a call (kv_manager.window), so a slot whose drafts were taken
stops moving once it has used them, and the call ends when no slot can move (or after
sync_every passes, or once leave_after slots finished). Everything runs per device on
its own slots and pages, as decode does (slot_ops._CacheLayout).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from april_jax.models import paged_attention, qwen3
from april_jax.sampler import drafts
from april_jax.sampler.sampling import sample_tokens
from april_jax.sampler.state import SlotState


def _held_end(state: SlotState) -> jax.Array:
  """Positions each slot's pages hold: int32 [S]."""
  page = state.kv.k.shape[3]
  return jnp.sum(state.page_table >= 0, axis=1, dtype=jnp.int32) * page


def _movable(state: SlotState) -> jax.Array:
  """Slots that can run a pass: live, their pending token's position in their pages."""
  return ~state.done & (state.length - 1 < _held_end(state))


def _attend(layout, state: SlotState, start_S, block_pages: int):
  """chunk_kv's `attend` over every slot's chunk, per device on its own slots, pages
  and heads (paged_attention.paged_chunk_attention)."""
  P = PartitionSpec
  s, h = layout.slot_axes, layout.head_axes
  cache_spec = P(None, s, h, None, None)

  def local(q, k_new, v_new, pool_k, pool_v, layer, table, start):
    return paged_attention.paged_chunk_attention(
        q, k_new, v_new, pool_k, pool_v, layer, start, table, block_pages, qwen3.kv_view
    )

  fn = layout.local(
      local,
      (P(s, None, h, None, None), P(s, None, h, None), P(s, None, h, None))
      + (cache_spec, cache_spec, P(), P(s, None), P(s)),
      P(s, None, h, None, None),
  )
  return lambda q, k_new, v_new, layer: fn(
      q, k_new, v_new, state.kv.k, state.kv.v, layer, state.page_table, start_S
  )


def _write(layout, state: SlotState, k, v, positions_SxT, live_SxT) -> qwen3.KVCache:
  """Every slot's chunk k, v [L, S, T, K, H] into its pages at its positions (live
  entries only), each device into its own (one scatter)."""

  def local(ck, cv, nk, nv, table, positions, live):
    L, S, T, K, H = nk.shape
    flat = lambda x: qwen3.kv_store(x.reshape(L, S * T, K, H), ck.dtype)
    rows = jnp.repeat(table, T, axis=0)
    return paged_attention.write_pages(
        (ck, cv), flat(nk), flat(nv), rows, positions.reshape(-1), live.reshape(-1), ck.shape[1] - 1
    )

  P = PartitionSpec
  s = layout.slot_axes
  cache_spec = P(None, s, layout.head_axes, None, None)
  new_spec = P(None, s, None, layout.head_axes, None)
  fn = layout.local(
      local,
      (cache_spec, cache_spec, new_spec, new_spec, P(s, None), P(s, None), P(s, None)),
      (cache_spec, cache_spec),
  )
  out = fn(state.kv.k, state.kv.v, k, v, state.page_table, positions_SxT, live_SxT)
  return qwen3.KVCache(*out)


def _draws(logits_SxTxV, state: SlotState, positions_SxT):
  """The token plain decoding draws at each position, and its behaviour logprob: the
  slot's sampling params, the position's own key. [S, T] each."""
  S, T, V = logits_SxTxV.shape
  fold = jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)))
  keys = fold(jax.random.wrap_key_data(state.rng), positions_SxT)
  per_row = lambda x: jnp.repeat(x, T, axis=0)
  tokens, logprobs = sample_tokens(
      logits_SxTxV.reshape(S * T, V),
      keys.reshape(S * T),
      per_row(state.temperature),
      per_row(state.top_k),
      per_row(state.top_p),
  )
  return tokens.reshape(S, T), logprobs.reshape(S, T)


def _pass(layout, cfg, K, ngram, block_pages, params, state, version, stop_ids_E, inputs):
  """One verify pass of every movable slot: (state, tokens drawn [S], finished [S],
  stats [3, sources]: drafts verified, drafts accepted, passes with drafts)."""
  S, M = state.tokens.shape
  rows = jnp.arange(S)
  L = state.length
  live = _movable(state)
  given = L < state.forced_end
  guess = drafts.propose(state.tokens, L, state.group, inputs, K, ngram)
  room = jnp.minimum(_held_end(state) - L, state.limit - 1 - L)
  n = jnp.where(live & ~given, jnp.clip(jnp.minimum(guess.count, room), 0, K), 0)
  j = jnp.arange(K + 1)[None, :]
  draft_tokens = jnp.where(j[:, :K] < n[:, None], guess.tokens, 0)
  pos0 = jnp.maximum(L - 1, 0)
  chunk = jnp.concatenate([state.tokens[rows, pos0][:, None], draft_tokens], axis=1)
  positions = pos0[:, None] + j  # the chunk's positions: pending token, then drafts
  # A slot that cannot move reads nothing of the pool (its length may be a freed
  # sample's): the pass's blocks follow the longest live slot.
  attend = _attend(layout, state, jnp.where(live, pos0, 0), block_pages)
  logits, kv = qwen3.chunk_kv(cfg, params, chunk, positions, attend, logits=True)
  kv = _write(layout, state, kv.k, kv.v, positions, live[:, None] & (j <= n[:, None]))
  drawn, logprobs = _draws(logits, state, positions + 1)
  stop = jnp.isin(drawn, stop_ids_E)
  e = drafts.accepted(draft_tokens, drawn, n, stop)
  kept = live[:, None] & ~given[:, None] & (j <= e[:, None])  # [S, K + 1]
  at = jnp.where(kept, L[:, None] + j, M)  # past the row: dropped
  put = lambda a, v: a.at[rows[:, None], at].set(v, mode="drop")
  last = drawn[rows, e]
  length = L + jnp.where(live, e + 1, 0)
  stopped = live & ~given & jnp.isin(last, stop_ids_E)
  finished = live & (stopped | (length >= state.limit))
  tag = jnp.broadcast_to(jnp.minimum(version, state.kv_version)[:, None], drawn.shape)
  state = state.replace(
      tokens=put(state.tokens, drawn),
      logprobs=put(state.logprobs, logprobs),
      versions=put(state.versions, tag),
      kv=kv,
      length=length,
      done=state.done | finished,
  )
  right = e + (
      (e < n) & (drawn[rows, jnp.minimum(e, K - 1)] == draft_tokens[rows, jnp.minimum(e, K - 1)])
  )
  by_source = jax.nn.one_hot(guess.source - 1, len(drafts.SOURCES), dtype=jnp.int32)  # [S, N]
  with_drafts = (n > 0).astype(jnp.int32)
  stats = jnp.stack([n, jnp.where(n > 0, right, 0), with_drafts])  # [3, S]
  return state, jnp.sum(kept, axis=1), finished, stats @ by_source


def decode(
    layout,
    cfg: qwen3.Qwen3Config,
    sync_every: int,
    K: int,
    ngram: int,
    block_pages: int,
    params,
    state: SlotState,
    version: jax.Array,
    stop_ids_E: jax.Array,
    leave_after: jax.Array,
    table_SxJ: jax.Array,
    inputs: drafts.DraftInputs,
):
  """Up to sync_every verify passes (module docstring); leaves early once leave_after
  slots finished in this call (0: only when no slot can move). inputs: what the host
  sends for drafting (drafts.DraftInputs: suggested tokens, history rows). Returns
  (state, passes run, tokens drawn, stats int32 [3, len(drafts.SOURCES)]: drafts
  verified, accepted, and passes that verified any, by source; finished_at int32 [S]:
  the pass each slot finished at in this call, -1 for none: the order they finished)."""
  state = state.replace(page_table=table_SxJ)
  one = functools.partial(_pass, layout, cfg, K, ngram, block_pages, params)

  def step(carry):
    state, i, drawn_n, finished_at, stats = carry
    state, drawn, finished, st = one(state, version, stop_ids_E, inputs)
    finished_at = jnp.where(finished, i, finished_at)
    return state, i + 1, drawn_n + jnp.sum(drawn), finished_at, stats + st

  def keep_going(carry):
    state, i, _, finished_at, _ = carry
    enough = (leave_after > 0) & (jnp.sum(finished_at >= 0) >= leave_after)
    return (i < sync_every) & ~enough & jnp.any(_movable(state))

  zero = jnp.zeros((), jnp.int32)
  stats = jnp.zeros((3, len(drafts.SOURCES)), jnp.int32)
  never = jnp.full(state.length.shape, -1, jnp.int32)
  state, passes, drawn_n, finished_at, stats = jax.lax.while_loop(
      keep_going, step, (state, zero, zero, never, stats)
  )
  return state, passes, drawn_n, stats, finished_at
