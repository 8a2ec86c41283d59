"""Packed attention on this device against each sample alone: a check the step benchmark
runs before it times anything, so a device's run also says whether the learner's packed
rows (cuDNN's segment layout on NVIDIA Hopper, blockwise elsewhere) attend as a row per
sample does.

Random queries, keys and values at a model's head counts and the compute dtype, one row
of three samples and trailing padding, through `models.attention.causal_attention` with
the config's implementation (as `auto` resolves it here), forward and gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from april_jax.models import attention

LENGTHS = (300, 500, 150)  # the samples of the packed row; then padding to ROW
ROW = 1024
# The largest |difference| allowed, relative to the largest |value| it compares.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}


def run(cfg, dtype: str, seed: int = 0) -> dict:
  """{"implementation", "max_rel_diff" (outputs and gradients: max |difference| over max
  |value|, the worst of them), "tolerance", "ok"}."""
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  keys = jax.random.split(jax.random.key(seed), 4)
  normal = lambda key, heads: jax.random.normal(key, (1, ROW, heads, H), jnp.dtype(dtype))
  q, k, v, cot = normal(keys[0], N), normal(keys[1], K), normal(keys[2], K), normal(keys[3], N)
  segments = np.zeros((1, ROW), np.int32)
  starts = np.cumsum((0,) + LENGTHS)
  for i, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
    segments[0, a:b] = i + 1
  impl = attention.resolve(cfg.attention, jnp.dtype(dtype), segments=True)

  def attend(q, k, v, cot, seg):
    out = attention.causal_attention(q, k, v, impl, cfg.attention_chunk, seg)
    return jnp.sum((out * cot).astype(jnp.float32)), out

  grad = jax.jit(jax.value_and_grad(attend, argnums=(0, 1, 2), has_aux=True))
  (_, packed), packed_grads = grad(q, k, v, cot, jnp.asarray(segments))
  worst = 0.0
  for a, b in zip(starts[:-1], starts[1:]):
    cut = lambda x: x[:, a:b]
    (_, alone), alone_grads = grad(cut(q), cut(k), cut(v), cut(cot), None)
    pairs = [(packed[:, a:b], alone)] + [(g[:, a:b], h) for g, h in zip(packed_grads, alone_grads)]
    for x, y in pairs:
      x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
      diff = float(np.nan_to_num(np.abs(x - y), nan=np.inf).max())
      worst = max(worst, diff / max(float(np.abs(y).max()), 1e-30))
  tolerance = TOLERANCE.get(str(jnp.dtype(dtype)), 2e-2)
  return {"implementation": impl, "max_rel_diff": worst, "tolerance": tolerance,
          "ok": worst <= tolerance}  # fmt: skip
