"""One layer's decode attention, paged (the slot engine's) against dense (the static
sampler's), at the same slots and lengths; and the paged side's page gathers alone.

Where a decode step's time goes at the equal-batch setting of `--mode=sampler`: the
paged attention gathers each live page's keys and values out of the pool into a chunk
(a copy), then scores the chunk; the dense attention slices each block of a contiguous
[slots, max_len] cache. `gather_us` is the paged side's two gathers (k and v) and a sum
that reads what they copied, nothing else, so paged_us - gather_us is what the scoring
and the per-slot merge add. Each is timed as `layers` applications inside one program
(a scan, as the decode step runs its layers), best of `repeats`, per layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from april_jax.benchmarks import common
from april_jax.models import attention, paged_attention, qwen3
from april_jax.sampler import pages as pages_lib
from april_jax.sampler import slot_ops


def _per_layer_us(fn, args, layers: int, repeats: int, calls: int = 50) -> float:
  """Microseconds per layer of `fn(q, layer, *args) -> [S, K, G, H]`, run `layers` times
  in one scan whose each step's query depends on the last (nothing is hoisted)."""

  @jax.jit
  def run(q, *args):
    def body(carry, i):
      out = fn(q + 1e-9 * carry, i % 2, *args)
      return carry + out.astype(carry.dtype), None

    return jax.lax.scan(body, jnp.zeros_like(q), jnp.arange(layers))[0]

  def many_calls():
    return jax.block_until_ready([run(*args) for _ in range(calls)])

  many_calls()  # compiles
  best, _ = common.best_of(max(repeats, 3), many_calls)
  return 1e6 * best / calls / layers


def _as_dense(pool, table: np.ndarray):
  """A dense cache [2, S, K, positions, H] holding what each slot's pages of `pool`
  [2, P, K, T, H] hold, in the order of the slot's row of `table` [S, pages a slot]."""
  _, _, K, page_size, H = pool.shape
  slots, per_slot = table.shape
  return pool[:, table].transpose(0, 1, 3, 2, 4, 5).reshape(2, slots, K, per_slot * page_size, H)


def _page_gathers(page_size: int, chunk: int):
  """The paged side's page gathers alone, as a function like its attention's: the k and v
  gathers of each chunk of `chunk` pages, summed into the output so that they are read."""

  def gathers(q, layer, pool_k, pool_v, past, table):
    plan = paged_attention.plan_pages(past, table, page_size, chunk)

    def one_chunk(c, total):
      _, page_C, _ = jax.lax.dynamic_slice_in_dim(plan.pairs_3xE, c * chunk, chunk, axis=1)
      k_c, v_c = pool_k[layer, page_C], pool_v[layer, page_C]  # [C, K, T, H]
      return total + jnp.sum(k_c, axis=(0, 2))[:, None] + jnp.sum(v_c, axis=(0, 2))[:, None]

    return jax.lax.fori_loop(0, plan.num_chunks, one_chunk, jnp.zeros_like(q))

  return gathers


def run(
    cfg: qwen3.Qwen3Config,
    slots: int,
    length: int,
    page_size: int,
    decode_block: int,
    repeats: int = 3,
    layers: int = 16,
    seed: int = 0,
    dtype: str = "float32",
) -> dict:
  """Per-layer microseconds (paged_us, dense_us, gather_us) with every slot at `length`
  cached positions, the engine's pages in shuffled pool order and the dense cache
  holding the same keys and values (in `dtype`); max_abs_diff between their outputs."""
  rng = np.random.default_rng(seed)
  K, H, G = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
  per_slot = pages_lib.pages_for(length, page_size)
  P = slots * per_slot + 1  # and a scratch page, as the engine's pool
  chunk = slot_ops.chunk_pages_for(decode_block, page_size, P - 1)
  table = rng.permutation(P - 1).astype(np.int32).reshape(slots, per_slot)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  pool_k, pool_v = normal(2, P, K, page_size, H), normal(2, P, K, page_size, H)
  dense_k, dense_v = _as_dense(pool_k, table), _as_dense(pool_v, table)
  q, new = normal(slots, K, G, H), normal(slots, K, H)
  past = jnp.full((slots,), length, jnp.int32)
  table = jnp.asarray(table)

  def paged(q, layer, pool_k, pool_v, past, table):
    return paged_attention.paged_decode_attention(
        q, new, new, pool_k, pool_v, layer, past, table, chunk
    )

  def dense(q, layer, cache_k, cache_v, past):
    return attention.decode_attention(q, new, new, cache_k, cache_v, layer, past, decode_block)

  gathers = _page_gathers(page_size, chunk)

  differ = jnp.max(
      jnp.abs(paged(q, 1, pool_k, pool_v, past, table) - dense(q, 1, dense_k, dense_v, past))
  )
  return {
      "max_abs_diff": float(differ),  # the two compute the same attention
      "paged_us": _per_layer_us(paged, (q, pool_k, pool_v, past, table), layers, repeats),
      "dense_us": _per_layer_us(dense, (q, dense_k, dense_v, past), layers, repeats),
      "gather_us": _per_layer_us(gathers, (q, pool_k, pool_v, past, table), layers, repeats),
      "chunk_pages": chunk,
      "live_pages": slots * per_slot,
  }
