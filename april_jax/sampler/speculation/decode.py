"""Speculative decoding that draws exactly the tokens plain decoding draws.

  decode(params, state, version, stop_ids, leave_after, table, draft_inputs, slots[W])
      -> (state, verify passes run, tokens drawn, stats [3, len(drafts.SOURCES)],
          the pass each of the W slots finished at [W] (-1: none))

The decode call of slot_ops.decode, with up to K tokens guessed per live slot and
checked in one pass. A pass computes only the W slots the host names (those that
decode, padded to the narrowest of `widths`): in the tail of a step, with few slots
live, it costs a few rows, where a plain decode step computes every slot. Each pass
(one iteration of the call's loop):
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
sync_every passes, or once leave_after slots finished). The W slots may lie on any
device of the mesh: as feed does, each device attends over and writes into the pages of
those it holds (chunk_ops.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from april_jax.models import qwen3
from april_jax.sampler import chunk_ops
from april_jax.sampler.speculation import drafts
from april_jax.sampler.sampling import sample_tokens
from april_jax.sampler import state as state_lib
from april_jax.sampler.state import SlotState


def widths(num_slots: int) -> list[int]:
  """The verify pass's row counts (one program each): powers of two from 8 up to the
  slots, and the slots themselves."""
  out, w = [], min(8, num_slots)
  while w < num_slots:
    out.append(w)
    w *= 2
  return out + [num_slots]


def width_for(live: int, num_slots: int) -> int:
  """The narrowest verify width that holds `live` slots."""
  return next(w for w in widths(num_slots) if w >= live)


def _held_end(state: SlotState) -> jax.Array:
  """Positions each slot's pages hold: int32 [S]."""
  page = state.kv.k.shape[3]
  return jnp.sum(state.page_table >= 0, axis=1, dtype=jnp.int32) * page


def _movable(state: SlotState, slots_W) -> jax.Array:
  """Which of the W slots can run a pass: named, live, their pending token's position
  in their pages. bool [W]."""
  at = jnp.maximum(slots_W, 0)
  moving = ~state.done[at] & (state.length[at] - 1 < _held_end(state)[at])
  return (slots_W >= 0) & moving


def _draws(logits_WxTxV, state: SlotState, at_W, positions_WxT):
  """The token plain decoding draws at each position, and its behaviour logprob: the
  slot's sampling params, the position's own key. [W, T] each."""
  W, T, V = logits_WxTxV.shape
  fold = jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)))
  keys = fold(jax.random.wrap_key_data(state.rng[at_W]), positions_WxT)
  per_row = lambda x: jnp.repeat(x[at_W], T, axis=0)
  tokens, logprobs = sample_tokens(
      logits_WxTxV.reshape(W * T, V),
      keys.reshape(W * T),
      per_row(state.temperature),
      per_row(state.top_k),
      per_row(state.top_p),
  )
  return tokens.reshape(W, T), logprobs.reshape(W, T)


def _pass(layout, cfg, K, ngram, block_pages, params, state, version, stop_ids_E, inputs, slots_W):
  """One verify pass of the W slots slots_W (-1: padding) that can move: (state,
  tokens drawn [W], finished [W], stats [3, sources]: drafts verified, drafts accepted,
  passes with drafts)."""
  S, M = state.tokens.shape
  at = jnp.maximum(slots_W, 0)
  live = _movable(state, slots_W)
  L = jnp.where(live, state.length[at], 1)
  limit = state.limit[at]
  given = L < state.forced_end[at]
  guess = drafts.propose(state.tokens, state.length, state.group, inputs, K, ngram, at)
  room = jnp.minimum(_held_end(state)[at] - L, limit - 1 - L)
  n = jnp.where(live & ~given, jnp.clip(jnp.minimum(guess.count, room), 0, K), 0)
  j = jnp.arange(K + 1)[None, :]
  draft_tokens = jnp.where(j[:, :K] < n[:, None], guess.tokens, 0)
  pos0 = L - 1
  chunk = jnp.concatenate([state.tokens[at, pos0][:, None], draft_tokens], axis=1)
  positions = pos0[:, None] + j  # the chunk's positions: pending token, then drafts
  named = jnp.where(live, slots_W, -1)  # a slot that cannot move reads and writes nothing
  attend = chunk_ops.chunk_attend(layout, state, named, jnp.where(live, pos0, 0), block_pages)
  logits, kv, experts = qwen3.chunk_kv(
      cfg, params, chunk, positions, attend, logits=True, return_experts=True
  )
  written = j <= n[:, None]
  kv = chunk_ops.write_chunks(layout, state, kv.k, kv.v, named, positions, written)
  drawn, logprobs = _draws(logits, state, at, positions + 1)
  stop = jnp.isin(drawn, stop_ids_E)
  e = drafts.accepted(draft_tokens, drawn, n, stop)
  rows = jnp.arange(slots_W.shape[0])
  kept = live[:, None] & ~given[:, None] & (j <= e[:, None])  # [W, K + 1]
  back = jnp.where(live, slots_W, S)[:, None]  # rows that did not move: dropped
  cols = jnp.where(kept, L[:, None] + j, M)
  put = lambda a, v: a.at[back, cols].set(v, mode="drop")
  length = L + e + 1
  stopped = live & ~given & jnp.isin(drawn[rows, e], stop_ids_E)
  finished = live & (stopped | (length >= limit))
  tag = jnp.broadcast_to(jnp.minimum(version, state.kv_version[at])[:, None], drawn.shape)
  state = state.replace(
      tokens=put(state.tokens, drawn),
      logprobs=put(state.logprobs, logprobs),
      versions=put(state.versions, tag),
      kv=kv,
      length=state.length.at[back[:, 0]].set(length, mode="drop"),
      done=state.done.at[back[:, 0]].set(finished, mode="drop"),
      routes=state_lib.record_routes(state.routes, experts, positions, live[:, None] & written, at),
  )
  last = jnp.minimum(e, K - 1)
  right = e + ((e < n) & (drawn[rows, last] == draft_tokens[rows, last]))
  by_source = jax.nn.one_hot(guess.source - 1, len(drafts.SOURCES), dtype=jnp.int32)  # [W, N]
  stats = jnp.stack([n, jnp.where(n > 0, right, 0), (n > 0).astype(jnp.int32)])  # [3, W]
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
    slots_W: jax.Array,
):
  """Up to sync_every verify passes of the W slots slots_W (module docstring; -1:
  padding); leaves early once leave_after slots finished in this call (0: only when
  none of them can move). inputs: what the host sends for drafting
  (drafts.DraftInputs: suggested tokens, history rows). Returns (state, passes run,
  tokens drawn, stats int32 [3, len(drafts.SOURCES)]: drafts verified, accepted, and
  passes that verified any, by source; finished_at int32 [W]: the pass each of the W
  slots finished at in this call, -1 for none: the order they finished)."""
  state = state.replace(page_table=table_SxJ)
  one = functools.partial(_pass, layout, cfg, K, ngram, block_pages, params)

  def step(carry):
    state, i, drawn_n, finished_at, stats = carry
    state, drawn, finished, st = one(state, version, stop_ids_E, inputs, slots_W)
    finished_at = jnp.where(finished, i, finished_at)
    return state, i + 1, drawn_n + jnp.sum(drawn), finished_at, stats + st

  def keep_going(carry):
    state, i, _, finished_at, _ = carry
    enough = (leave_after > 0) & (jnp.sum(finished_at >= 0) >= leave_after)
    return (i < sync_every) & ~enough & jnp.any(_movable(state, slots_W))

  zero = jnp.zeros((), jnp.int32)
  stats = jnp.zeros((3, len(drafts.SOURCES)), jnp.int32)
  never = jnp.full(slots_W.shape, -1, jnp.int32)
  state, passes, drawn_n, finished_at, stats = jax.lax.while_loop(
      keep_going, step, (state, zero, zero, never, stats)
  )
  return state, passes, drawn_n, stats, finished_at
