"""Per-token estimates of KL(pi || ref) from the two logprobs of a drawn token, by name
(J. Schulman, "Approximating KL divergence", 2020), as verl's `kl_penalty` computes them.

With d = logp - ref_logp (the token was drawn from pi):

  k1           d                             unbiased, can be negative
  k2           d^2 / 2                       its gradient is KL's (verl's "mse")
  k3           exp(-d) + d - 1               unbiased, never negative; clamped as low_var_kl
  low_var_kl   k3 (the same clamps)
  abs          |d|

k3 and low_var_kl are one estimator, computed as verl computes both: -d clamped to
[-20, 20] before the exp (so the exp stays finite and a far token's gradient is 0, not
inf * 0 = NaN), the estimate clamped to [-10, 10]. slime leaves its k3 unclamped
(docs/algorithms.md).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

K3_LOG_RATIO_CLAMP = 20.0  # on ref_logp - logp, before the exp
K3_CLAMP = 10.0  # on the estimate


def _k1(d_BxT):
  return d_BxT


def _k2(d_BxT):
  return 0.5 * jnp.square(d_BxT)


def _k3(d_BxT):
  log_ratio_BxT = jnp.clip(-d_BxT, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
  return jnp.clip(jnp.exp(log_ratio_BxT) - log_ratio_BxT - 1.0, -K3_CLAMP, K3_CLAMP)


def _abs(d_BxT):
  return jnp.abs(d_BxT)


# Each takes d = logp - ref_logp and returns the per-token estimate.
KL_PENALTIES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
    "abs": _abs,
}


def kl_penalty(
    logp_BxT: jax.Array, ref_logp_BxT: jax.Array, kl_type: str, mask_BxT: jax.Array | None = None
) -> jax.Array:
  """Per-token KL estimate of kl_type between the current policy and the reference
  (0 on tokens outside mask_BxT, when given)."""
  if kl_type not in KL_PENALTIES:
    raise KeyError(f"unknown kl_type {kl_type!r}; known kl types: {sorted(KL_PENALTIES)}")
  logp_BxT = jnp.asarray(logp_BxT, jnp.float32)
  ref_logp_BxT = jnp.asarray(ref_logp_BxT, jnp.float32)
  if mask_BxT is None:
    mask_BxT = jnp.ones(jnp.shape(logp_BxT), jnp.float32)
  # Off the mask d is 0, so padding (which may hold -inf) never reaches an exp.
  d_BxT = jnp.where(jnp.asarray(mask_BxT) > 0, logp_BxT - ref_logp_BxT, 0.0)
  return KL_PENALTIES[kl_type](d_BxT)
