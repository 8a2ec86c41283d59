"""The policy terms by name: each token's loss from the learner's logprobs, the ratio's
anchor and the advantages, before importance weights and aggregation (rl/losses.py).

    fn(cfg, logp_BxT, old_logp_BxT, advantages, mask_BxT, *, segments_BxT=None,
       selected_BxT=None) -> Term

advantages are per sample [B] or per token [B, T]; segments_BxT are packed rows' segment
ids (a term that reduces per sequence reduces with `seq_sums`); selected_BxT marks the
tokens clip_cov and kl_cov treat apart (rl/cov_tokens.py picks them). With
r = exp(logp - old_logp) and A the advantage:

  ppo_clip  max(-A r, -A clip(r, 1 - eps, 1 + eps_high)); dual clip caps it at -A c for
            A < 0 (arXiv 1912.09729)
  gspo      the same on the sequence's length-normalised ratio s = exp(mean_t log r), in
            token form sg(s) r_t / sg(r_t) (arXiv 2507.18071)
  clip_cov  ppo_clip, with the selected tokens' terms detached (value and gradient 0)
            (arXiv 2505.22617)
  kl_cov    -A r (no clip), plus kl_cov_coef |log r| on the selected tokens (same paper;
            0 within float32 rounding of r = 1, where |x| has no gradient, and in a
            step of one update, where r is 1 but for rounding)
  gmpo      per sequence -mean_t(A) exp(mean_t m_t), m_t the log-ratio clipped to
            [-eps, eps_high] on the side its advantage's sign makes pessimistic: the
            geometric mean of the token ratios (arXiv 2507.20673)
  cispo     -sg(clip(r, 1 - eps, 1 + eps_high)) A logp: every token keeps its gradient,
            the weight is clipped (arXiv 2506.13585)

Safety clamps, as verl's: a token's log-ratio is clamped to [-20, 20] before its exp (PPO,
clip_cov, kl_cov, GMPO, CISPO), GSPO's sequence log-ratio to at most 10; a clamped value
carries no gradient. `Term.clamped_BxT` marks the tokens a clamp changed.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from april_jax.registry import Registry
from april_jax.rl.aggregation import seq_sums

LOG_RATIO_CLAMP = 20.0  # |log r| of a token, before the exp
GSPO_LOG_RATIO_MAX = 10.0  # GSPO's mean log r of a sequence, from above
# kl_cov's |log r| counts as 0 (value and gradient) below this: the old-logprob pass's
# float32 rounding. |x| has no gradient at 0; verl's on-policy step, whose anchor is the
# current logprob detached, gives 0 there, where JAX's abs would give 1. A step of one
# update (cfg.one_update) drops the term whatever the rounding (bfloat16's is larger).
KL_COV_DEAD_BAND = 1e-6


class Term(NamedTuple):
  """A policy term per token: its loss; where the clip changed it; the ratio it used;
  where a safety clamp changed the log-ratio; where the dual clip capped it (A < 0)."""

  loss_BxT: jax.Array
  clipped_BxT: jax.Array
  ratio_BxT: jax.Array
  clamped_BxT: jax.Array
  dual_clipped_BxT: jax.Array


POLICY_TERMS = Registry("policy loss")
register_policy_term = POLICY_TERMS.register
get_policy_term = POLICY_TERMS.lookup
# The terms that read `selected_BxT`: a token selection by covariance (rl/cov_tokens.py).
COVARIANCE_TERMS = ("clip_cov", "kl_cov")
PolicyTermFn = Callable[..., Term]


def per_token(advantages) -> jax.Array:
  """Advantages [B] as [B, 1], or [B, T] as they are: either broadcasts over tokens."""
  return advantages[:, None] if advantages.ndim == 1 else advantages


def masked_log_ratio(a_BxT, b_BxT, mask_BxT):
  """a - b on masked tokens, 0 elsewhere, so padding never reaches an exp."""
  return jnp.where(mask_BxT > 0, a_BxT - b_BxT, 0.0)


def clamped_log_ratio(logp_BxT, old_logp_BxT, mask_BxT):
  """(log r clamped to +-LOG_RATIO_CLAMP, 0 off the mask; where the clamp bound)."""
  log_ratio_BxT = masked_log_ratio(logp_BxT, old_logp_BxT, mask_BxT)
  clamped_BxT = jnp.abs(log_ratio_BxT) > LOG_RATIO_CLAMP
  return jnp.clip(log_ratio_BxT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), clamped_BxT


def _clipped_surrogate(cfg, ratio_BxT, adv_BxT):
  """PPO's pessimistic surrogate; returns (loss_BxT, clipped_BxT)."""
  pg_BxT = -adv_BxT * ratio_BxT
  pg_clipped_BxT = -adv_BxT * jnp.clip(ratio_BxT, 1.0 - cfg.eps_clip, 1.0 + cfg.clip_high)
  return jnp.maximum(pg_BxT, pg_clipped_BxT), pg_clipped_BxT > pg_BxT


def _selection(name: str, selected_BxT) -> jax.Array:
  if selected_BxT is None:
    raise ValueError(f"{name} needs selected_BxT, the tokens rl/cov_tokens.py selects")
  return jnp.asarray(selected_BxT, jnp.float32)


def _no(x_BxT):
  return jnp.zeros(jnp.shape(x_BxT), bool)


@register_policy_term("ppo_clip")
def ppo_clip(cfg, logp_BxT, old_logp_BxT, advantages, mask_BxT, **_) -> Term:
  """Token-level PPO-clip (clip-higher when eps_clip_high > eps_clip), dual-clipped when
  cfg.dual_clip_c is set: for A < 0 the loss is capped at -A * dual_clip_c."""
  adv_BxT = per_token(advantages)
  log_ratio_BxT, clamped_BxT = clamped_log_ratio(logp_BxT, old_logp_BxT, mask_BxT)
  ratio_BxT = jnp.exp(log_ratio_BxT)
  loss_BxT, clipped_BxT = _clipped_surrogate(cfg, ratio_BxT, adv_BxT)
  dual_BxT = _no(loss_BxT)
  if cfg.dual_clip_c is not None:
    cap_BxT = -adv_BxT * cfg.dual_clip_c
    dual_BxT = (adv_BxT < 0) & (loss_BxT > cap_BxT)
    loss_BxT = jnp.where(adv_BxT < 0, jnp.minimum(loss_BxT, cap_BxT), loss_BxT)
  return Term(loss_BxT, clipped_BxT, ratio_BxT, clamped_BxT, dual_BxT)


@register_policy_term("gspo")
def gspo(cfg, logp_BxT, old_logp_BxT, advantages, mask_BxT, *, segments_BxT=None, **_) -> Term:
  """GSPO in its token form: s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)), where
  s_i = exp(mean_t (logp - old_logp)) is the length-normalised sequence ratio. Its
  value is s_i on every token and its gradient that of sequence-level GSPO; a sequence
  whose mean log-ratio passes GSPO_LOG_RATIO_MAX is held there, with no gradient."""
  log_ratio_BxT = masked_log_ratio(logp_BxT, old_logp_BxT, mask_BxT)
  log_ratio_S, index_BxT = seq_sums(log_ratio_BxT, segments_BxT)
  log_s_S = log_ratio_S / jnp.maximum(seq_sums(mask_BxT, segments_BxT)[0], 1.0)
  clamped_S = log_s_S > GSPO_LOG_RATIO_MAX
  log_s_S = jax.lax.stop_gradient(jnp.minimum(log_s_S, GSPO_LOG_RATIO_MAX))
  live_logp_BxT = jnp.where(mask_BxT > 0, logp_BxT, 0.0)  # padding may hold -inf
  moving_BxT = jnp.where(
      clamped_S[index_BxT], 0.0, live_logp_BxT - jax.lax.stop_gradient(live_logp_BxT)
  )
  ratio_BxT = jnp.exp(log_s_S[index_BxT] + moving_BxT)
  loss_BxT, clipped_BxT = _clipped_surrogate(cfg, ratio_BxT, per_token(advantages))
  clamped_BxT = clamped_S[index_BxT] & (mask_BxT > 0)
  return Term(loss_BxT, clipped_BxT, ratio_BxT, clamped_BxT, _no(loss_BxT))


@register_policy_term("clip_cov")
def clip_cov(cfg, logp_BxT, old_logp_BxT, advantages, mask_BxT, *, selected_BxT, **_) -> Term:
  """ppo_clip with the selected tokens (high covariance of advantage and logprob, picked
  at random in rl/cov_tokens.py) detached: their loss is 0 and carries no gradient."""
  keep_BxT = 1.0 - jax.lax.stop_gradient(_selection("clip_cov", selected_BxT))
  term = ppo_clip(cfg, logp_BxT, old_logp_BxT, advantages, mask_BxT)
  return term._replace(loss_BxT=term.loss_BxT * keep_BxT)


@register_policy_term("kl_cov")
def kl_cov(cfg, logp_BxT, old_logp_BxT, advantages, mask_BxT, *, selected_BxT, **_) -> Term:
  """The unclipped surrogate -A r, plus kl_cov_coef |log r| on the selected tokens (the
  largest covariances of advantage and logprob, rl/cov_tokens.py)."""
  selected_BxT = jax.lax.stop_gradient(_selection("kl_cov", selected_BxT))
  log_ratio_BxT, clamped_BxT = clamped_log_ratio(logp_BxT, old_logp_BxT, mask_BxT)
  ratio_BxT = jnp.exp(log_ratio_BxT)
  distance_BxT = jnp.abs(log_ratio_BxT)
  distance_BxT = jnp.where(distance_BxT > KL_COV_DEAD_BAND, distance_BxT, 0.0)
  if cfg.one_update:
    distance_BxT = jnp.zeros_like(distance_BxT)
  loss_BxT = -per_token(advantages) * ratio_BxT + cfg.kl_cov_coef * selected_BxT * distance_BxT
  return Term(loss_BxT, _no(loss_BxT), ratio_BxT, clamped_BxT, _no(loss_BxT))


@register_policy_term("gmpo")
def gmpo(cfg, logp_BxT, old_logp_BxT, advantages, mask_BxT, *, segments_BxT=None, **_) -> Term:
  """Geometric-Mean Policy Optimization: each sequence's loss -A_s * exp(mean_t m_t) on
  every one of its tokens (so a mean over sequences of token means is the mean over
  sequences), where m_t is log r_t clipped to [-eps_clip, eps_clip_high] only where that
  is pessimistic for the sign of A_t, and A_s the sequence's mean advantage."""
  mask_BxT = jnp.asarray(mask_BxT, jnp.float32)
  adv_BxT = jnp.broadcast_to(per_token(advantages), mask_BxT.shape)
  log_ratio_BxT, clamped_BxT = clamped_log_ratio(logp_BxT, old_logp_BxT, mask_BxT)
  sign_BxT = jnp.sign(adv_BxT)
  clipped_log_BxT = jnp.clip(log_ratio_BxT, -cfg.eps_clip, cfg.clip_high)
  m_BxT = sign_BxT * jnp.minimum(sign_BxT * log_ratio_BxT, sign_BxT * clipped_log_BxT)
  m_S, index_BxT = seq_sums(m_BxT * mask_BxT, segments_BxT)
  length_S = jnp.maximum(seq_sums(mask_BxT, segments_BxT)[0], 1.0)
  ratio_S = jnp.exp(m_S / length_S)
  adv_S = seq_sums(adv_BxT * mask_BxT, segments_BxT)[0] / length_S
  loss_BxT = (-adv_S * ratio_S)[index_BxT]
  clipped_BxT = (m_BxT != log_ratio_BxT) & (sign_BxT != 0) & (mask_BxT > 0)
  return Term(loss_BxT, clipped_BxT, ratio_S[index_BxT], clamped_BxT, _no(loss_BxT))


@register_policy_term("cispo")
def cispo(cfg, logp_BxT, old_logp_BxT, advantages, mask_BxT, **_) -> Term:
  """CISPO: -sg(clip(r, 1 - eps_clip, 1 + eps_clip_high)) * A * logp. The weight is
  clipped, never the gradient: a token past the clip still teaches, by its logprob's
  gradient at a bounded weight."""
  log_ratio_BxT, clamped_BxT = clamped_log_ratio(logp_BxT, old_logp_BxT, mask_BxT)
  ratio_BxT = jnp.exp(log_ratio_BxT)
  weight_BxT = jnp.clip(ratio_BxT, 1.0 - cfg.eps_clip, 1.0 + cfg.clip_high)
  live_logp_BxT = jnp.where(mask_BxT > 0, logp_BxT, 0.0)  # padding may hold -inf
  loss_BxT = -jax.lax.stop_gradient(weight_BxT) * per_token(advantages) * live_logp_BxT
  clipped_BxT = (weight_BxT != ratio_BxT) & (mask_BxT > 0)
  return Term(loss_BxT, clipped_BxT, ratio_BxT, clamped_BxT, _no(loss_BxT))
