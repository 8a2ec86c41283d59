"""A short supervised warm-start (cross-entropy on reference answers) before RL.

Used by the tiny config so that RL starts from a policy that sometimes succeeds on the
built-in task; a pretrained Qwen3 does not need it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from april_jax.distributed import to_host
from april_jax.models import qwen3


def _sft_step(cfg, optimizer, params, opt_state, tokens, targets, mask):
  def loss_fn(p):
    logp, _ = qwen3.token_logprobs(cfg, p, tokens, targets, chunk_size=256)
    return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def warm_start(cfg: qwen3.Qwen3Config, params, batches, lr: float):
  """Runs one Adam step per batch (tokens, targets, mask); returns (params, losses)."""
  optimizer = optax.adam(lr)
  opt_state = optimizer.init(params)
  step = jax.jit(functools.partial(_sft_step, cfg, optimizer), donate_argnums=(0, 1))
  losses = []
  for tokens, targets, mask in batches:
    params, opt_state, loss = step(params, opt_state, tokens, targets, mask)
    losses.append(loss)
  return params, [float(x) for x in to_host(losses)]
