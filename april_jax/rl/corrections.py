"""Corrections for tokens that older params drew: importance weights pi_prox / pi_behav.

With APRIL a trained sample may hold tokens of several policy versions, and even tokens
of the current version differ slightly between the sampler and the learner (bfloat16,
another kernel). Two logprobs of every drawn token are known when the update starts:
  prox_logp      the learner's, under the params at the start of this step's update
                 (the old-logprob pass): the proximal policy, the PPO ratio's anchor;
  behavior_logp  the sampler's, recorded as the token was drawn.
The ratio r = pi_theta / pi_prox is clipped by the policy loss; each token's term is then
multiplied by an importance weight w built from log w_t = prox_logp_t - behavior_logp_t:

  level "token"      w_t = exp(log w_t)
        "sequence"   w = exp(sum_t log w_t), the same for every token of the sample
        "geometric"  w = exp(mean_t log w_t), the sequence weight per token (length-free)
  mode  "truncate"   min(w, high)                 TIS (slime --use-tis, high 2)
        "mask"       w inside [low, high]; outside, the token (token level) or the whole
                     sample (sequence, geometric) leaves the loss: it no longer counts in
                     the loss's token or sequence totals either. Token level with
                     [0.5, 5] is IcePop; sequence and geometric are slime's MIS masks;
                     token level with low 0 is AReaL's capped behaviour weight.

Together with the proximal anchor this is AReaL's decoupled PPO objective,
E_behav[(pi_prox / pi_behav) * min(r A, clip(r) A)]. Without a weight (`train.tis_cap`
0, the upper bound `high` here) the behaviour logprobs only feed the metrics.

The weights carry no gradient (nothing here depends on the trained params), so they are
computed once per RL step, on the host, with float64 exponents (a sequence weight can be
exp(hundreds)); they reach the jitted update as one more [B, T] array.

Metrics (over the trained tokens, before the weight is applied, `train/` in the logs):
  is_weight_mean / is_weight_min / is_weight_max   the raw weights (at their level)
  is_outside_frac    tokens whose weight was truncated or masked
  is_masked_frac     tokens that left the loss (mask mode)
  is_clamped_frac    tokens whose log-weight (at its level) passed +-20 and was clamped
  prox_behav_kl      KL(pi_behav || pi_prox), the k3 estimate r - 1 - log r averaged over
                     the drawn tokens with r = pi_prox / pi_behav (0 when they agree)
"""

from __future__ import annotations

import dataclasses

import numpy as np

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")
# The PPO / GSPO ratio's anchor: the proximal policy (the params at the start of the
# update, as the old-logprob pass computes them), or the sampler's recorded logprobs
# (coupled PPO: no old-logprob pass, and no weight).
ANCHORS = ("proximal", "behavior")
# log w is clamped to [-20, 20] before its exp, as verl's rollout correction does
# (SAFETY_BOUND): a weight of e^20 (4.9e8) is far outside any bound already.
LOG_WEIGHT_CLAMP = 20.0


@dataclasses.dataclass(frozen=True)
class Weights:
  """The weights [B, T] to multiply the policy term by (1 off the trained tokens), which
  tokens stay in the loss, and the step's metrics."""

  weight_BxT: np.ndarray
  keep_BxT: np.ndarray
  metrics: dict[str, float]


def log_weights(level: str, prox_logp_BxT, behavior_logp_BxT, mask_BxT) -> np.ndarray:
  """log w per token at `level` (0 off the mask), float64."""
  mask = np.asarray(mask_BxT) > 0
  log_w = np.where(
      mask, np.asarray(prox_logp_BxT, np.float64) - np.asarray(behavior_logp_BxT, np.float64), 0.0
  )
  if level == "token":
    return log_w
  total_B = log_w.sum(axis=-1)
  if level == "geometric":
    total_B = total_B / np.maximum(mask.sum(axis=-1), 1)
  elif level != "sequence":
    raise ValueError(f"importance weight level must be one of {LEVELS}, got {level!r}")
  return np.where(mask, total_B[:, None], 0.0)


def importance_weights(
    level: str,
    mode: str,
    low: float,
    high: float | None,
    prox_logp_BxT,
    behavior_logp_BxT,
    mask_BxT,
) -> Weights:
  """The step's weights (see the module docstring); no `high` (None or 0) gives weights of
  1 and only the metrics."""
  if mode not in MODES:
    raise ValueError(f"importance weight mode must be one of {MODES}, got {mode!r}")
  mask = np.asarray(mask_BxT) > 0
  log_w = log_weights(level, prox_logp_BxT, behavior_logp_BxT, mask)
  clamped = mask & (np.abs(log_w) > LOG_WEIGHT_CLAMP)
  raw = np.exp(np.clip(log_w, -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP))
  token_log_w = np.clip(
      log_weights("token", prox_logp_BxT, behavior_logp_BxT, mask),
      -LOG_WEIGHT_CLAMP,
      LOG_WEIGHT_CLAMP,
  )
  kl = np.expm1(token_log_w) - token_log_w
  if not high:
    weight, outside = np.ones_like(raw), np.zeros_like(mask)
  elif mode == "truncate":
    weight, outside = np.minimum(raw, high), raw > high
  else:
    outside = (raw < low) | (raw > high)
    weight = np.where(outside, 0.0, raw)
  outside &= mask
  keep = mask & ~outside if mode == "mask" else mask
  weight = np.where(mask, weight, 1.0)
  n = max(int(mask.sum()), 1)
  live = raw[mask] if mask.any() else np.ones(1)
  metrics = {
      "is_weight_mean": float(live.mean()),
      "is_weight_min": float(live.min()),
      "is_weight_max": float(live.max()),
      "is_outside_frac": float(outside.sum() / n),
      "is_masked_frac": float((mask & ~keep).sum() / n),
      "is_clamped_frac": float(clamped.sum() / n),
      "prox_behav_kl": float(kl[mask].sum() / n),
  }
  return Weights(weight.astype(np.float32), keep, metrics)


def problems(level: str, mode: str, low: float, high: float | None, anchor: str) -> list[str]:
  """What is wrong with a correction's settings, each naming its config field (high: the
  weight's upper bound, train.tis_cap; None or 0 is no weight)."""
  out = []
  if level not in LEVELS:
    out.append(f"is_level={level!r}: must be one of {list(LEVELS)}")
  if mode not in MODES:
    out.append(f"is_mode={mode!r}: must be one of {list(MODES)}")
  if anchor not in ANCHORS:
    out.append(f"ratio_anchor={anchor!r}: must be one of {list(ANCHORS)}")
  if not high:  # no weight: only measured, so nothing may bound it
    if mode == "mask":
      out.append("is_mode='mask' needs an upper bound: tis_cap > 1 (tis_cap 0 is no weight)")
    if low:
      out.append(f"is_low={low!r} bounds a weight, and tis_cap 0 is none: leave it at 0")
    return out
  if anchor == "behavior":
    out.append(
        f"tis_cap={high!r} with ratio_anchor='behavior': the ratio is already "
        "taken against the sampler's logprobs, so there is no pi_prox / pi_behav to weight "
        "by; set tis_cap=0 or ratio_anchor='proximal' (decoupled PPO)"
    )
  if not high > 1:
    out.append(f"tis_cap={high!r}: the weight's upper bound must be > 1")
  if mode == "mask" and not 0 <= low < 1:
    out.append(f"is_low={low!r}: the mask's lower bound must be in [0, 1)")
  if mode == "truncate" and low:
    out.append(
        f"is_low={low!r}: truncation has no lower bound (it is for is_mode='mask'); "
        "leave it at 0"
    )
  return out
