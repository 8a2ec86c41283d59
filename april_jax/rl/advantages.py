"""Advantage estimators by name, and DAPO's overlong reward shaping.

An estimator turns the rewards of G groups of n samples (all n answer the same prompt)
into one advantage per sample:

    fn(rewards_GxN, eps=1e-6) -> advantages_GxN   (float32)

  grpo    (r - group mean) / (group std + eps), std unbiased (ddof=1) as torch.std in
          verl and slime; needs n >= 2. A group whose rewards are all equal gets zeros.
  drgrpo  Dr. GRPO: r - group mean, with no division by the std.

`overlong_penalty` is added to the rewards before the estimator runs.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from april_jax.registry import Registry

AdvantageFn = Callable[..., jax.Array]

ADVANTAGES = Registry("advantage")
register_advantage = ADVANTAGES.register
get_advantage = ADVANTAGES.lookup


def _centered(rewards_GxN: jax.Array) -> jax.Array:
  rewards_GxN = jnp.asarray(rewards_GxN, jnp.float32)
  return rewards_GxN - jnp.mean(rewards_GxN, axis=-1, keepdims=True)


@register_advantage("grpo")
def grpo_advantages(rewards_GxN: jax.Array, eps: float = 1e-6) -> jax.Array:
  n = jnp.shape(rewards_GxN)[-1]
  if n < 2:
    raise ValueError(
        f"grpo advantages need n >= 2 samples per group (an unbiased std); " f"got n={n}"
    )
  centered_GxN = _centered(rewards_GxN)
  std_Gx1 = jnp.sqrt(jnp.sum(centered_GxN**2, axis=-1, keepdims=True) / (n - 1))
  return centered_GxN / (std_Gx1 + eps)


@register_advantage("drgrpo")
def drgrpo_advantages(rewards_GxN: jax.Array, eps: float = 1e-6) -> jax.Array:
  del eps  # No std division, so nothing to guard.
  return _centered(rewards_GxN)


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
