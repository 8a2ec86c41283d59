"""The tokens Clip-Cov and KL-Cov treat apart (arXiv 2505.22617, "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models").

Entropy collapses through tokens whose logprob and advantage move together. Each token's
covariance term is

    cov_t = (A_t - mean(A)) * (logp_t - mean(logp))      means over the batch's tokens

  clip_cov  picks n = max(1, floor(cov_ratio * N)) tokens at random among those with
            clip_cov_lb < cov_t < clip_cov_ub (fewer if fewer qualify) whose term the
            PPO clip does not already clip (none, on the proximal logprobs a step's
            selection uses); their terms are detached.
  kl_cov    picks the n tokens of largest cov_t; they get a |log r| penalty.

verl selects per micro-batch on the current logprobs. Here the selection is made once an
RL step, on the host, over the whole batch's trained tokens and the ratio's anchor (the
proximal logprobs of the old-logprob pass; the sampler's with ratio_anchor "behavior"),
so the microbatching never changes it and a resumed run draws the same tokens. On the
first update of an on-policy step, in one micro-batch, the current logprobs are the
proximal ones and no token is clipped, so the two agree there (docs/algorithms.md).
"""

from __future__ import annotations

import numpy as np


def covariances(advantages, logp_BxT, mask_BxT) -> np.ndarray:
  """cov_t of every token [B, T] (float64; 0 off the mask). advantages [B] or [B, T]."""
  mask = np.asarray(mask_BxT) > 0
  adv = np.asarray(advantages, np.float64)
  adv = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, mask.shape)
  logp = np.asarray(logp_BxT, np.float64)
  if not mask.any():
    return np.zeros(mask.shape)
  cov = (adv - adv[mask].mean()) * (logp - logp[mask].mean())
  return np.where(mask, cov, 0.0)


def count(ratio: float, mask_BxT) -> int:
  """How many tokens a mode selects: max(1, floor(ratio * N))."""
  return max(int(ratio * int((np.asarray(mask_BxT) > 0).sum())), 1)


def clip_cov(advantages, logp_BxT, mask_BxT, ratio, lb, ub, rng, clipped_BxT=None) -> np.ndarray:
  """Clip-Cov's selection [B, T] bool: `count` tokens drawn by rng (a numpy Generator)
  among the masked ones with lb < cov < ub and not in clipped_BxT."""
  mask = np.asarray(mask_BxT) > 0
  cov = covariances(advantages, logp_BxT, mask)
  candidates = mask & (cov > lb) & (cov < ub)
  if clipped_BxT is not None:
    candidates &= ~np.asarray(clipped_BxT, bool)
  flat = np.flatnonzero(candidates)
  chosen = rng.permutation(flat)[: count(ratio, mask)]
  selected = np.zeros(mask.size, bool)
  selected[chosen] = True
  return selected.reshape(mask.shape)


def kl_cov(advantages, logp_BxT, mask_BxT, ratio) -> np.ndarray:
  """KL-Cov's selection [B, T] bool: the `count` masked tokens of largest covariance
  (ties broken by position)."""
  mask = np.asarray(mask_BxT) > 0
  selected = np.zeros(mask.size, bool)
  if not mask.any():
    return selected.reshape(mask.shape)
  cov = np.where(mask, covariances(advantages, logp_BxT, mask), -np.inf).reshape(-1)
  n = count(ratio, mask)
  selected[np.argsort(-cov, kind="stable")[:n]] = True
  return selected.reshape(mask.shape)


def select(cfg, advantages, logp_BxT, mask_BxT, rng) -> np.ndarray:
  """cfg.policy_loss's selection (a LossConfig of clip_cov or kl_cov), float32 [B, T]."""
  if cfg.policy_loss == "clip_cov":
    chosen = clip_cov(
        advantages, logp_BxT, mask_BxT, cfg.cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub, rng
    )
  elif cfg.policy_loss == "kl_cov":
    chosen = kl_cov(advantages, logp_BxT, mask_BxT, cfg.cov_ratio)
  else:
    raise ValueError(f"policy_loss {cfg.policy_loss!r} selects no tokens by covariance")
  return chosen.astype(np.float32)
