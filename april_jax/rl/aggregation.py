"""How per-token loss values [B, T] become one scalar: the loss aggregations by name.

A sequence is a row, or in packed rows (rl/layout.py, `segments_BxT` given) the tokens of
a row that share a segment id: every per-sequence reduction goes through `seq_sums`, so
packed and unpacked layouts give the same values.

For gradient accumulation the caller passes the whole minibatch's `total_tokens` and
`total_seqs` (`batch_totals`) with every microbatch; then each aggregation is additive:
summed over microbatches it equals the minibatch's value. With S sequences and N tokens
in the minibatch (x masked to its tokens):

  token_mean               sum(x) / N                  DAPO: every token weighs the same
  seq_mean_token_mean      mean over sequences of each sequence's token mean
                                                       GRPO, GSPO: every sequence does
  seq_mean_token_sum       sum(x) / S                  each sequence's token sum, averaged
  seq_mean_token_sum_norm  sum(x) / (S * norm_len)     Dr. GRPO as its paper writes it: a
                                                       constant normaliser, averaged over
                                                       sequences
  token_sum_norm           sum(x) / norm_len           verl's "seq-mean-token-sum-norm"
                                                       (S times the paper's, on one micro-
                                                       batch a minibatch)

docs/algorithms.md sets them beside verl's and slime's.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def seq_sums(x_BxT: jax.Array, segments_BxT=None) -> tuple[jax.Array, jax.Array]:
  """Sums of x over every sequence [S], and each token's sequence index [B, T] (to read
  them per token: sums[index]). Without segments a sequence is a row (S = B); with them,
  the tokens of a row sharing a segment id (ids in [0, T): S = B * T, most empty)."""
  B, T = x_BxT.shape
  if segments_BxT is None:
    return jnp.sum(x_BxT, axis=-1), jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  index_BxT = segments_BxT + T * jnp.arange(B)[:, None]
  return jax.ops.segment_sum(x_BxT.reshape(-1), index_BxT.reshape(-1), B * T), index_BxT


def batch_totals(mask_BxT: jax.Array, segments_BxT=None) -> tuple[jax.Array, jax.Array]:
  """(total_tokens, total_seqs) of a batch: masked tokens, and sequences with >= 1 of
  them (all-padding rows do not count as sequences)."""
  mask_BxT = jnp.asarray(mask_BxT, jnp.float32)
  lengths_S = seq_sums(mask_BxT, segments_BxT)[0]
  return jnp.sum(mask_BxT), jnp.sum(lengths_S > 0).astype(jnp.float32)


def _norm(norm_len, mode: str) -> float:
  if not norm_len or norm_len <= 0:
    raise ValueError(f"{mode} needs norm_len > 0; got norm_len={norm_len}")
  return float(norm_len)


def _token_mean(x_BxT, mask_BxT, total_tokens, total_seqs, norm_len, segments_BxT=None):
  del mask_BxT, total_seqs, norm_len, segments_BxT
  return jnp.sum(x_BxT) / jnp.maximum(total_tokens, 1.0)


def _seq_mean_token_mean(x_BxT, mask_BxT, total_tokens, total_seqs, norm_len, segments_BxT=None):
  del total_tokens, norm_len
  sums_S = seq_sums(x_BxT, segments_BxT)[0]
  per_seq_S = sums_S / jnp.maximum(seq_sums(mask_BxT, segments_BxT)[0], 1.0)
  return jnp.sum(per_seq_S) / jnp.maximum(total_seqs, 1.0)


def _seq_mean_token_sum(x_BxT, mask_BxT, total_tokens, total_seqs, norm_len, segments_BxT=None):
  del mask_BxT, total_tokens, norm_len, segments_BxT
  return jnp.sum(x_BxT) / jnp.maximum(total_seqs, 1.0)


def _seq_mean_token_sum_norm(
    x_BxT, mask_BxT, total_tokens, total_seqs, norm_len, segments_BxT=None
):
  del mask_BxT, total_tokens, segments_BxT
  norm = _norm(norm_len, "seq_mean_token_sum_norm")
  return jnp.sum(x_BxT) / (jnp.maximum(total_seqs, 1.0) * norm)


def _token_sum_norm(x_BxT, mask_BxT, total_tokens, total_seqs, norm_len, segments_BxT=None):
  del mask_BxT, total_tokens, total_seqs, segments_BxT
  return jnp.sum(x_BxT) / _norm(norm_len, "token_sum_norm")


AGGREGATIONS: dict[str, Callable[..., jax.Array]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
    "token_sum_norm": _token_sum_norm,
}
NEED_NORM_LEN = ("seq_mean_token_sum_norm", "token_sum_norm")


def aggregate(
    x_BxT: jax.Array,
    mask_BxT: jax.Array,
    mode: str,
    *,
    total_tokens=None,
    total_seqs=None,
    norm_len: int | None = None,
    segments_BxT=None,
) -> jax.Array:
  """Reduces per-token values to a scalar; totals default to this batch's (batch_totals).

  Masked-out positions contribute nothing, even when they hold inf or NaN.
  """
  if mode not in AGGREGATIONS:
    raise KeyError(f"unknown aggregation {mode!r}; known aggregations: {sorted(AGGREGATIONS)}")
  mask_BxT = jnp.asarray(mask_BxT, jnp.float32)
  x_BxT = jnp.where(mask_BxT > 0, jnp.asarray(x_BxT, jnp.float32), 0.0)
  own_tokens, own_seqs = batch_totals(mask_BxT, segments_BxT)
  total_tokens = own_tokens if total_tokens is None else jnp.asarray(total_tokens, jnp.float32)
  total_seqs = own_seqs if total_seqs is None else jnp.asarray(total_seqs, jnp.float32)
  return AGGREGATIONS[mode](x_BxT, mask_BxT, total_tokens, total_seqs, norm_len, segments_BxT)
