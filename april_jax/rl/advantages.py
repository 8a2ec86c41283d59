"""Advantage estimators by name, and DAPO's overlong reward shaping.

An estimator turns the rewards of G groups of n samples (all n answer the same prompt)
into one advantage per sample:

    fn(rewards_GxN, eps=1e-6, lengths_GxN=None, whitening="bessel")
        -> advantages_GxN   (float32)

lengths_GxN: each sample's trained (drawn) response tokens, for the estimators that
normalise over the batch's tokens (default: one token each, i.e. over samples).
whitening: how those estimators whiten (`whiten`).

  grpo    (r - group mean) / (group std + eps), std unbiased (ddof=1) as torch.std in
          verl and slime. A group whose rewards are all equal gets zeros.
  drgrpo  Dr. GRPO: r - group mean, with no division by the std.
  rloo    REINFORCE leave-one-out: r_i - mean of the group's other n - 1 rewards
          = n / (n - 1) * (r_i - group mean).
  reinforce_plus_plus
          REINFORCE++ with gamma = 1 and no KL in the reward: every token's return is the
          sample's reward r, whitened over the batch's response tokens.
  reinforce_plus_plus_baseline
          r - group mean, then whitened over the batch's tokens as above: the group
          baseline removes the prompt's difficulty, the batch scale keeps steps alike.

          With train.reward_kl_coef = beta > 0, REINFORCE++ puts the KL in the reward, per
          token (`reinforce_pp_kl_advantages`, run by rl/learn.py once the old and
          reference logprobs are known): r_t = -beta (logp_t - ref_logp_t) on every drawn
          token, the sample's reward added at its last; G_t = sum_{s >= t} r_s; G
          whitened over the batch's tokens.
  gae     PPO with a learned critic: per-token advantages by GAE over the critic's values
          (rl/critic.py); not in this registry, since it needs the values.

grpo, drgrpo, rloo and reinforce_plus_plus_baseline compare a sample with its group
(NEED_GROUPS): with one sample per prompt they would train on zeros (or, with verl's
convention of a lone sample's mean 0 and std 1, on raw rewards without a baseline), so
they are refused, naming n.

Whitening over the batch's tokens (weights: each value counted once per token):
  bessel      (x - mu) / sqrt(sigma^2 N / (N - 1) + 1e-8), N = sum w: verl's
              masked_whiten and slime's distributed_masked_whiten, exactly (the default)
  population  (x - mu) / (sigma + eps), sigma^2 = sum w (x - mu)^2 / sum w: the
              population std, eps outside the root

`overlong_penalty` is added to the rewards before the estimator runs.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from april_jax.registry import Registry

AdvantageFn = Callable[..., jax.Array]

ADVANTAGES = Registry("advantage")
register_advantage = ADVANTAGES.register
get_advantage = ADVANTAGES.lookup
NEED_GROUPS = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline")  # need n >= 2
WHITENINGS = ("bessel", "population")
BESSEL_EPS = 1e-8  # inside the root, as verl's masked_whiten
# Per-token advantages from a learned critic (rl/critic.py), not from rewards alone.
CRITIC_ADVANTAGES = ("gae",)


def _centered(rewards_GxN: jax.Array) -> jax.Array:
  rewards_GxN = jnp.asarray(rewards_GxN, jnp.float32)
  return rewards_GxN - jnp.mean(rewards_GxN, axis=-1, keepdims=True)


def _group_size(rewards_GxN, name: str) -> int:
  n = jnp.shape(rewards_GxN)[-1]
  if n < 2:
    raise ValueError(f"{name} advantages need n >= 2 samples per group; got n={n}")
  return n


def whiten(x, weights, whitening: str, eps: float) -> np.ndarray:
  """x whitened over the values counted by `weights` (float64 NumPy; see the module
  docstring): "bessel" verl's and slime's (x - mu) / sqrt(var_unbiased + 1e-8), where eps
  is not used; "population" (x - mu) / (sigma + eps)."""
  x, w = np.asarray(x, np.float64), np.asarray(weights, np.float64)
  total = w.sum()
  if total <= 0:
    return np.zeros_like(x)
  mu = (w * x).sum() / total
  var = (w * (x - mu) ** 2).sum() / total
  if whitening == "population":
    return (x - mu) / (np.sqrt(var) + eps)
  if whitening == "bessel":
    bessel = total / (total - 1.0) if total > 1 else 0.0
    return (x - mu) / np.sqrt(var * bessel + BESSEL_EPS)
  raise ValueError(f"whitening must be one of {WHITENINGS}, got {whitening!r}")


def _token_whitened(x_GxN, lengths_GxN, eps: float, whitening: str) -> jax.Array:
  """x whitened over the batch's tokens: each sample's x counted once per token (lengths;
  None: once per sample)."""
  w_GxN = np.ones(np.shape(x_GxN)) if lengths_GxN is None else lengths_GxN
  return jnp.asarray(whiten(x_GxN, w_GxN, whitening, eps), jnp.float32)


@register_advantage("grpo")
def grpo_advantages(rewards_GxN, eps: float = 1e-6, lengths_GxN=None, whitening=None) -> jax.Array:
  del lengths_GxN, whitening
  n = _group_size(rewards_GxN, "grpo")
  centered_GxN = _centered(rewards_GxN)
  std_Gx1 = jnp.sqrt(jnp.sum(centered_GxN**2, axis=-1, keepdims=True) / (n - 1))
  return centered_GxN / (std_Gx1 + eps)


@register_advantage("drgrpo")
def drgrpo_advantages(rewards_GxN, eps: float = 1e-6, lengths_GxN=None, whitening=None):
  del eps, lengths_GxN, whitening  # No std division, so nothing to guard.
  _group_size(rewards_GxN, "drgrpo")
  return _centered(rewards_GxN)


@register_advantage("rloo")
def rloo_advantages(rewards_GxN, eps: float = 1e-6, lengths_GxN=None, whitening=None):
  del eps, lengths_GxN, whitening
  n = _group_size(rewards_GxN, "rloo")
  return _centered(rewards_GxN) * (n / (n - 1))


@register_advantage("reinforce_plus_plus")
def reinforce_pp_advantages(rewards_GxN, eps: float = 1e-6, lengths_GxN=None, whitening="bessel"):
  return _token_whitened(rewards_GxN, lengths_GxN, eps, whitening)


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_pp_baseline_advantages(
    rewards_GxN, eps: float = 1e-6, lengths_GxN=None, whitening="bessel"
) -> jax.Array:
  _group_size(rewards_GxN, "reinforce_plus_plus_baseline")
  return _token_whitened(_centered(rewards_GxN), lengths_GxN, eps, whitening)


def whiten_tokens(x_BxT, mask_BxT, eps: float = 1e-8, whitening="bessel") -> np.ndarray:
  """x whitened over the masked tokens (`whiten`), 0 off them (NumPy, float32)."""
  mask = np.asarray(mask_BxT) > 0
  if not mask.any():
    return np.zeros(np.shape(x_BxT), np.float32)
  return np.where(mask, whiten(x_BxT, mask, whitening, eps), 0.0).astype(np.float32)


def reinforce_pp_kl_advantages(
    rewards_B,
    logp_BxT,
    ref_logp_BxT,
    mask_BxT,
    kl_coef: float,
    eps: float = 1e-6,
    whiten_mask=None,
    whitening="bessel",
) -> np.ndarray:
  """REINFORCE++ with the KL in the reward: per-token advantages [B, T] (see the module
  docstring). logp are the policy's before the update, ref_logp the reference's; the KL is
  k1 (logp - ref_logp), as OpenRLHF's reward KL. The returns run over mask_BxT (the drawn
  tokens); the whitening's statistics over whiten_mask (the trained ones; default: the
  same)."""
  mask = np.asarray(mask_BxT) > 0
  kl = np.asarray(logp_BxT, np.float64) - np.asarray(ref_logp_BxT, np.float64)
  r = np.where(mask, -kl_coef * kl, 0.0)
  T = mask.shape[1]
  last = T - 1 - np.argmax(mask[:, ::-1], axis=1)
  rows = np.flatnonzero(mask.any(axis=1))
  r[rows, last[rows]] += np.asarray(rewards_B, np.float64)[rows]
  returns = np.cumsum(r[:, ::-1], axis=1)[:, ::-1]  # G_t = sum over s >= t
  return whiten_tokens(returns, mask if whiten_mask is None else whiten_mask, eps, whitening)


def overlong_penalty(
    lengths_B: jax.Array, max_len: int, buffer_len: int, factor: float = 1.0
) -> jax.Array:
  """DAPO's soft overlong punishment, in tokens, float32 [B].

  0 up to max_len - buffer_len tokens, then falling linearly to -factor at max_len
  (and staying there beyond it).
  """
  if buffer_len <= 0 or buffer_len > max_len:
    raise ValueError(
        f"overlong buffer_len must be in (0, max_len={max_len}]; " f"got buffer_len={buffer_len}"
    )
  excess_B = jnp.asarray(lengths_B, jnp.float32) - (max_len - buffer_len)
  return -factor * jnp.clip(excess_B / buffer_len, 0.0, 1.0)
