"""A plain static-batch greedy sampler, the yardstick for the slot engine's overhead.

Every sequence has the same prompt length and runs the same number of steps: one
prefill, then one `lax.while_loop` of `qwen3.decode_step` over a full-size cache (as
gemma's and tunix's samplers decode), argmax only, no per-slot state, no host round
trips. Same model code and weights as the slot engine, so the difference between the
two is what refillable slots cost.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from april_jax.models import qwen3


@functools.partial(jax.jit, static_argnums=(0, 3))
def greedy(cfg: qwen3.Qwen3Config, params, prompts_BxP: jax.Array, new_tokens: int):
  """new_tokens greedy tokens per row: int32 [B, new_tokens]."""
  B, P = prompts_BxP.shape
  logits, kv = qwen3.prefill(cfg, params, prompts_BxP, jnp.full((B,), P, jnp.int32))
  pad = ((0, 0), (0, 0), (0, new_tokens), (0, 0), (0, 0))
  cache = qwen3.KVCache(
      *(
          qwen3.kv_store(jnp.pad(x, pad).transpose(0, 1, 3, 2, 4), qwen3.kv_storage_dtype(x.dtype))
          for x in (kv.k, kv.v)
      )
  )
  first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  out = jnp.zeros((B, new_tokens), jnp.int32).at[:, 0].set(first)

  def body(carry):
    i, token, cache, out = carry
    logits, cache = qwen3.decode_step(cfg, params, token, jnp.full((B,), P + i - 1), cache)
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return i + 1, token, cache, out.at[:, i].set(token)

  _, _, _, out = jax.lax.while_loop(
      lambda c: c[0] < new_tokens, body, (jnp.int32(1), first, cache, out)
  )
  return out
