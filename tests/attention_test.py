"""Blockwise (flash) attention equals the dense reference, forward and backward, for any
chunk, sequence length and GQA grouping; `auto` never picks dense."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.models import attention


def _qkv(B=2, T=37, N=4, K=2, H=8, seed=0, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (B, T, N, H), dtype)
  k = jax.random.normal(keys[1], (B, T, K, H), dtype)
  v = jax.random.normal(keys[2], (B, T, K, H), dtype)
  return q, k, v


# 37 keys in chunks of 8 or 16 (a ragged last chunk), or one chunk of 37.
@pytest.mark.parametrize("chunk", [8, 16, 37])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)])
def test_blockwise_attention_equals_dense_forward_and_gradients(chunk, heads):
  N, K = heads
  q, k, v = _qkv(N=N, K=K)
  dense = lambda q, k, v: attention.causal_attention(q, k, v, "dense")
  block = lambda q, k, v: attention.causal_attention(q, k, v, "blockwise", chunk)
  np.testing.assert_allclose(block(q, k, v), dense(q, k, v), atol=2e-6, rtol=1e-5)
  weights = jax.random.normal(jax.random.key(9), q.shape)
  loss = lambda fn: lambda *a: jnp.sum(fn(*a) * weights)
  g_dense = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
  g_block = jax.grad(loss(block), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_block, g_dense):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def _fwd_bwd_temp_bytes(T, chunk, impl):
  q, k, v = (
      jax.ShapeDtypeStruct(x.shape[:1] + (T,) + x.shape[2:], x.dtype)
      for x in _qkv(B=1, T=1, N=4, K=2, H=16)
  )
  fwd_bwd = jax.jit(
      jax.grad(
          lambda q, k, v: jnp.sum(attention.causal_attention(q, k, v, impl, chunk)),
          argnums=(0, 1, 2),
      )
  )
  return fwd_bwd.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_attention_memory_grows_linearly_in_t_dense_quadratically():
  block = [_fwd_bwd_temp_bytes(T, 128, "blockwise") for T in (2048, 4096)]
  dense = [_fwd_bwd_temp_bytes(T, 128, "dense") for T in (2048, 4096)]
  assert block[1] / block[0] < 2.5 and dense[1] / dense[0] > 3.5
  assert block[1] < dense[1] / 4  # [4 heads, T, T] float32 scores are 268 MB at 4096


def test_auto_picks_blockwise_off_nvidia_and_rejects_unknown_names():
  assert attention.resolve("auto", jnp.bfloat16) == "blockwise"  # CPU here
  assert attention.resolve("dense", jnp.float32) == "dense"
  with pytest.raises(ValueError, match="attention must be one of"):
    attention.resolve("flash3", jnp.float32)
