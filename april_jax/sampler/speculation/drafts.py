"""Speculation's two pure rules on the device: where a slot's drafts come from, and how
many of them a verify pass keeps.

  propose(tokens, length, group, inputs, K, ngram, at) -> Drafts of the slots `at`
  accepted(drafts, drawn, count, stop)               -> e: tokens kept are drawn[:e + 1]

Drafts need no draft model. A slot's next tokens are guessed, in this order, from
  suggested  tokens a caller wrote for the slot's next positions (SlotEngine.suggest: a
             benchmark's controlled acceptance, or a caller that knows a continuation),
  own        the slot's own tokens: its last `ngram` tokens (or fewer, down to one) are
             found earlier in its row, prompt included, and what followed them there is
             the guess (prompt-lookup / n-gram decoding),
  group      the rows of the other slots of its prompt group (state.group): samples of
             the same prompt, drawn at the same time, or finished and still in their
             slot, matched the same way;
  history    its prompt's earlier samples, which the host remembers (draft_history.py)
             and sends with the slot: its group's samples that finished in an earlier
             step, the prompt's rollouts of an earlier epoch.
The longest match wins (then own, group, history in that order; then the latest
position). A guess is
only a guess: the verify pass draws every position with that position's own key
(sampler/speculative.py), so which source guessed, or whether one did, changes how many
tokens a call yields, never which tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from april_jax.sampler.contract import DRAFT_SOURCES as SOURCES  # Drafts.source: index + 1

PEERS = 16  # a slot's group rows searched for drafts, at most


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Drafts:
  tokens: jax.Array  # int32 [S, K]: the guessed tokens at positions length .. length+K-1
  count: jax.Array  # int32 [S]: how many of them are guesses (0 .. K)
  source: jax.Array  # int32 [S]: 1 + SOURCES index, 0 where count is 0


def _suggested(suggested_SxM, length_S, K: int):
  """The caller's tokens at positions length .. length+K-1, up to the first unset (-1)."""
  S, M = suggested_SxM.shape
  pos = length_S[:, None] + jnp.arange(K)[None, :]
  tokens = jnp.take_along_axis(suggested_SxM, jnp.minimum(pos, M - 1), axis=1)
  ok = (tokens >= 0) & (pos < M)
  count = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
  return jnp.maximum(tokens, 0), count


def _peers(group_S, S: int, G: int):
  """[S, G] slots sharing each slot's group (not itself; -1 past the last)."""
  rows = jnp.arange(S)
  same = (group_S[:, None] == group_S[None, :]) & (group_S[:, None] >= 0)
  same = same & (rows[:, None] != rows[None, :])
  score = jnp.where(same, S - rows[None, :], 0)  # lowest slots first
  top, idx = jax.lax.top_k(score, G)
  return jnp.where(top > 0, idx, -1).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftInputs:
  """What the host sends for drafting (DeviceSlots keeps it, sent again after a change)."""

  suggested: jax.Array  # int32 [S, M]: a caller's tokens per position, -1 where none
  history: jax.Array  # int32 [S, H, M]: each slot's prompt's past samples, -1 padded
  history_len: jax.Array  # int32 [S, H]: their lengths (0: no row)


def _candidate(c, tokens_SxM, length_S, in_slots, history, history_len):
  """Candidate row c of each of W slots (0: its own; 1..G: its group's, in_slots'
  columns [W, 1 + G]; then its history rows, [W, H, M]): the rows [W, M], their
  lengths [W], their source (1 + SOURCES index) and their rank on a tie (own, group,
  history)."""
  G, H = in_slots.shape[1] - 1, history.shape[1]
  slot = jax.lax.dynamic_index_in_dim(in_slots, jnp.minimum(c, G), 1, keepdims=False)
  row = tokens_SxM[jnp.maximum(slot, 0)]
  length = jnp.where(slot >= 0, length_S[jnp.maximum(slot, 0)], 0)
  if H:
    h = jnp.clip(c - 1 - G, 0, H - 1)
    from_history = c > G
    row = jnp.where(from_history, jax.lax.dynamic_index_in_dim(history, h, 1, False), row)
    past = jax.lax.dynamic_index_in_dim(history_len, h, 1, False)
    length = jnp.where(from_history, past, length)
  source = jnp.where(c == 0, 2, jnp.where(c <= G, 3, 4))
  rank = jnp.where(c == 0, 2, jnp.where(c <= G, 1, 0))
  return row, length, source, rank


def _best_match(row_SxM, row_len_S, suffix, length_S, rank, K: int):
  """The latest longest match of each slot's suffix (its last tokens, suffix[i] = the
  token i before its last) in one candidate row: (score [S], -1 for none; the K tokens
  after it [S, K]; how many of them the row holds [S])."""
  S, M = row_SxM.shape
  j = jnp.arange(M)
  # run[s, j]: how many of the slot's last tokens end at position j of the row, in a row.
  run = jnp.zeros((S, M), jnp.int32)
  still = jnp.ones((S, M), bool)
  for i, want in enumerate(suffix):
    shifted = jnp.pad(row_SxM, ((0, 0), (i, 0)), constant_values=-1)[:, :M]
    still = still & (shifted == want[:, None]) & (j >= i)[None] & (length_S > i)[:, None]
    run = run + still
  # A match needs a token after it in its row (j <= len - 2); in the slot's own row that
  # is also what keeps the suffix from matching itself.
  valid = (run > 0) & (j[None, :] <= row_len_S[:, None] - 2)
  score = jnp.where(valid, run * (4 * M) + rank * M + j[None, :], -1)
  at = jnp.argmax(score, axis=1)
  pos = jnp.minimum(at[:, None] + 1 + jnp.arange(K)[None, :], M - 1)
  count = jnp.clip(jnp.minimum(K, row_len_S - 1 - at), 0, K)
  return jnp.max(score, axis=1), jnp.take_along_axis(row_SxM, pos, axis=1), count


def _lookup(tokens_SxM, length_S, group_S, history, history_len, K: int, ngram: int, at_W):
  """n-gram drafts for the W slots at_W from each one's own row, its group's rows and
  its history rows (history [W, H, M]): (tokens [W, K], count [W], source [W]: 1 +
  SOURCES index). The candidate rows are searched one at a time (a loop), so a pass
  holds a few [W, M] arrays, not one per candidate."""
  S, _ = tokens_SxM.shape
  W, G, H = at_W.shape[0], min(PEERS, S - 1), history.shape[1]
  peers = _peers(group_S, S, G)[at_W] if G > 0 else jnp.zeros((W, 0), jnp.int32)
  in_slots = jnp.concatenate([at_W[:, None].astype(jnp.int32), peers], axis=1)  # [W, 1 + G]
  length_W = length_S[at_W]
  own = tokens_SxM[at_W]
  suffix = [
      jnp.take_along_axis(own, jnp.maximum(length_W - 1 - i, 0)[:, None], 1)[:, 0]
      for i in range(ngram)
  ]

  def search(c, best):
    row, row_len, source, rank = _candidate(c, tokens_SxM, length_S, in_slots, history, history_len)
    score, tokens, count = _best_match(row, row_len, suffix, length_W, rank, K)
    better = score > best[0]  # the first of equal scores stays
    pick = lambda new, old: jnp.where(better.reshape((W,) + (1,) * (new.ndim - 1)), new, old)
    source = jnp.broadcast_to(source, (W,))
    return (jnp.maximum(score, best[0]),) + tuple(map(pick, (tokens, count, source), best[1:]))

  none = (jnp.full((W,), -1, jnp.int32), jnp.zeros((W, K), jnp.int32))
  none += (jnp.zeros((W,), jnp.int32), jnp.zeros((W,), jnp.int32))
  _, tokens, count, source = jax.lax.fori_loop(0, 1 + G + H, search, none)
  return tokens, count.astype(jnp.int32), source.astype(jnp.int32)


def propose(tokens_SxM, length_S, group_S, inputs: DraftInputs, K: int, ngram: int, at_W=None):
  """Up to K drafts for positions length .. length+K-1 of the W slots at_W (default:
  every slot), [W] rows (module docstring). The caller bounds `count` further (pages,
  budget, given tokens)."""
  if at_W is None:
    at_W = jnp.arange(tokens_SxM.shape[0])
  length_W = length_S[at_W]
  s_tokens, s_count = _suggested(inputs.suggested[at_W], length_W, K)
  n_tokens, n_count, n_source = _lookup(
      tokens_SxM, length_S, group_S, inputs.history[at_W], inputs.history_len[at_W], K, ngram, at_W
  )
  use_s = s_count > 0
  count = jnp.where(use_s, s_count, n_count)
  source = jnp.where(use_s, 1, n_source)
  return Drafts(
      tokens=jnp.where(use_s[:, None], s_tokens, n_tokens),
      count=count,
      source=jnp.where(count > 0, source, 0).astype(jnp.int32),
  )


def accepted(drafts_SxK, drawn_SxK1, count_S, stop_SxK1):
  """The verify pass's rule: e [S], the index of the last token kept, so drawn[:e + 1]
  are the tokens a slot gains. drawn[:, j] is the token drawn at the j-th new position
  with that position's key; it is kept while every earlier draft equalled its draw and
  was no stop token. So e is the first j < count where the draw differs from the draft
  or is a stop token, else count: the token drawn where the drafts ran out (or were
  refused) is kept too, which is what plain decoding would have drawn there."""
  K = drafts_SxK.shape[1]
  j = jnp.arange(K)[None, :]
  ends = (drawn_SxK1[:, :K] != drafts_SxK) | stop_SxK1[:, :K] | (j >= count_S[:, None])
  ends = jnp.concatenate([ends, jnp.ones_like(ends[:, :1])], axis=1)  # j = K always ends
  return jnp.argmax(ends, axis=1).astype(jnp.int32)
