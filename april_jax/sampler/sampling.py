"""Next-token sampling with per-row parameters: greedy, temperature, top-k, top-p.

Every row (slot) carries its own temperature, top_k and top_p as device arrays, so one
compiled function serves any mix. A sampled row draws exactly from softmax(masked / T),
the mask being its top-k / top-p truncation, and the recorded behavior logprob is that of
the distribution sampled: log_softmax of the truncated, temperature-scaled logits at the
drawn token. Importance weights against the learner's full distribution are therefore
exact; with top_k = 0 and top_p = 1 the two distributions are the same. For greedy rows
(T == 0) it is log_softmax(logits)[token].

The draw stays in log space (float32 Gumbel-max) without noise over the whole vocabulary:
a block of _BLOCK tokens is drawn with its share of the mass (from the blocks'
logsumexps, by the same draw one level up), then a token within it. P(block) *
P(token | block) is the softmax, so the levels make one exact draw, with at most _BLOCK
noise values per level (three levels for a 152k vocabulary) instead of one per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BLOCK = 64


def _truncation_mask(scaled_SxV, top_k_S, top_p_S):
  """True for tokens that survive top-k (k > 0) and top-p (p < 1) truncation."""
  V = scaled_SxV.shape[-1]
  sorted_desc = -jnp.sort(-scaled_SxV, axis=-1)
  k = jnp.where(top_k_S > 0, jnp.minimum(top_k_S, V), V)
  kth_value = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
  keep = scaled_SxV >= kth_value
  # top-p over the top-k survivors: keep the smallest prefix whose mass reaches p.
  sorted_masked = jnp.where(jnp.arange(V)[None] < k[:, None], sorted_desc, -jnp.inf)
  probs = jax.nn.softmax(sorted_masked, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  in_nucleus = mass_before < top_p_S[:, None]
  # The smallest logit still inside the nucleus is the cut-off value.
  cutoff = jnp.min(jnp.where(in_nucleus, sorted_masked, jnp.inf), axis=-1, keepdims=True)
  return keep & (scaled_SxV >= cutoff)


def _gumbel_max(key, logits_N):
  """argmax(logits_N + Gumbel noise): an exact draw from softmax(logits_N). int32 [].

  mode="high" resolves the noise's upper tail to ~2^-46 (the default mode, to 2^-23), so
  even a candidate far less likely than 2^-23 is drawn at its own rate.
  """
  return jax.random.categorical(key, logits_N, mode="high").astype(jnp.int32)


def draw_token(logits_V: jax.Array, key: jax.Array) -> jax.Array:
  """One exact draw from softmax(logits_V); -inf entries are never drawn. int32 [].

  The row is cut into blocks of _BLOCK (padded with -inf, which has probability 0); a
  block is drawn from the blocks' logsumexps by this same draw, one level up, then a token
  from that block's logits by Gumbel-max. Vmapped over keys with logits_V unbatched, the
  logsumexps are computed once.
  """
  V = logits_V.shape[-1]
  if V <= _BLOCK:
    return _gumbel_max(key, logits_V)
  n_blocks = -(-V // _BLOCK)
  blocks_NxB = jnp.pad(logits_V, (0, n_blocks * _BLOCK - V), constant_values=-jnp.inf).reshape(
      n_blocks, _BLOCK
  )
  block_key, token_key = jax.random.split(key)
  # An all -inf block has logsumexp -inf: it is never drawn.
  block = draw_token(jax.nn.logsumexp(blocks_NxB, axis=-1), block_key)
  return block * _BLOCK + _gumbel_max(token_key, blocks_NxB[block])


def _logprob_at(logits_SxV, tokens_S):
  """log_softmax(logits_SxV)[row, tokens_S[row]], without materialising log_softmax."""
  picked_S = jnp.take_along_axis(logits_SxV, tokens_S[:, None], axis=-1)[:, 0]
  return picked_S - jax.nn.logsumexp(logits_SxV, axis=-1)


def sample_tokens(
    logits_SxV: jax.Array,
    keys_S: jax.Array,
    temperature_S: jax.Array,
    top_k_S: jax.Array,
    top_p_S: jax.Array,
):
  """Draws one token per row; returns (tokens int32 [S], behavior logprobs float32 [S]).

  keys_S are typed PRNG keys, one per row. The sort needed for top-k / top-p only runs
  when some row asks for truncation, and the draw only when some row samples; a row's
  result never depends on the other rows.
  """
  logits_SxV = logits_SxV.astype(jnp.float32)
  greedy_S = temperature_S <= 0.0
  # Greedy rows keep T = 1 and no truncation, so their masked row is the raw logits.
  safe_t = jnp.where(greedy_S, 1.0, temperature_S)[:, None]
  scaled_SxV = logits_SxV / safe_t
  truncates_S = ((top_k_S > 0) | (top_p_S < 1.0)) & ~greedy_S
  keep_SxV = jax.lax.cond(
      jnp.any(truncates_S),
      _truncation_mask,
      lambda s, k, p: jnp.ones(s.shape, bool),
      scaled_SxV,
      top_k_S,
      top_p_S,
  )
  # A row that asks for no truncation keeps every token whatever its neighbours ask
  # (the nucleus's float cumsum could reach 1 before its last tokens), so a row's draw
  # never depends on the batch it is drawn in.
  keep_SxV = keep_SxV | ~truncates_S[:, None]
  masked_SxV = jnp.where(keep_SxV, scaled_SxV, -jnp.inf)
  drawn_S = jax.lax.cond(
      jnp.all(greedy_S),
      lambda m, k: jnp.zeros(m.shape[:1], jnp.int32),
      jax.vmap(draw_token),
      masked_SxV,
      keys_S,
  )
  tokens_S = jnp.where(greedy_S, jnp.argmax(logits_SxV, axis=-1), drawn_S).astype(jnp.int32)
  return tokens_S, _logprob_at(masked_SxV, tokens_S)
