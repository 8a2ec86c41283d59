"""Next-token sampling with per-row parameters: greedy, temperature, top-k, top-p.

Every row (slot) carries its own temperature, top_k and top_p as device arrays, so one
compiled function serves any mix. The recorded behavior logprob is
log_softmax(logits / T)[token], the temperature-scaled distribution before any top-k /
top-p truncation; that is the quantity the learner recomputes (as verl and slime do).
For greedy rows (T == 0) it is log_softmax(logits)[token].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def _inverse_cdf_draw(masked_SxV, keys_S):
  """One uniform per row through the CDF: exact, and far cheaper than Gumbel noise
  over the whole vocabulary. u is in (0, 1], so a token of probability 0 (masked) can
  never be the first whose cumulative mass reaches u * total."""
  probs = jax.nn.softmax(masked_SxV, axis=-1)
  cdf = jnp.cumsum(probs, axis=-1)
  u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_S)
  target = u * cdf[:, -1]
  index = jnp.sum(cdf < target[:, None], axis=-1)
  return jnp.minimum(index, masked_SxV.shape[-1] - 1).astype(jnp.int32)


def sample_tokens(logits_SxV: jax.Array, keys_S: jax.Array, temperature_S: jax.Array,
                  top_k_S: jax.Array, top_p_S: jax.Array):
  """Draws one token per row; returns (tokens int32 [S], behavior logprobs float32 [S]).

  keys_S are typed PRNG keys, one per row. The sort needed for top-k / top-p only runs
  when some row asks for truncation.
  """
  logits_SxV = logits_SxV.astype(jnp.float32)
  greedy_S = temperature_S <= 0.0
  safe_t = jnp.where(greedy_S, 1.0, temperature_S)[:, None]
  scaled = logits_SxV / safe_t
  truncate = jnp.any(((top_k_S > 0) | (top_p_S < 1.0)) & ~greedy_S)
  keep = jax.lax.cond(truncate, _truncation_mask,
                      lambda s, k, p: jnp.ones(s.shape, bool), scaled, top_k_S, top_p_S)
  masked = jnp.where(keep, scaled, -jnp.inf)
  drawn = jax.lax.cond(jnp.all(greedy_S), lambda m, k: jnp.zeros(m.shape[:1], jnp.int32),
                       _inverse_cdf_draw, masked, keys_S)
  tokens = jnp.where(greedy_S, jnp.argmax(logits_SxV, axis=-1), drawn).astype(jnp.int32)
  logprobs = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, None],
                                 axis=-1)[:, 0]
  return tokens, logprobs
