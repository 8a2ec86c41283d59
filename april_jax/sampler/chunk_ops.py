"""Chunks of tokens through given slots' pages: attention over each slot's pooled KV
(and causally over its chunk), and the chunk's KV written into its pages.

  chunk_attend(layout, state, slots[W], start[W], block_pages) -> chunk_kv's `attend`
  write_chunks(layout, state, k, v, slots[W], positions[W, T], live[W, T]) -> KVCache

W slots anywhere on the mesh: each device attends over, and writes into, the pages of
the slots it holds (its rows of the page table; `own_rows`), and the rows are summed
over the slot axes, one of them nonzero. Used by feed (given tokens, slot_ops.py) and
by the speculative verify pass (speculative.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from april_jax.models import paged_attention, qwen3
from april_jax.sampler.state import SlotState


def own_rows(layout, table, slots_W):
  """Each device's view of W global slots: their rows of its page table, -1 for a
  slot another device holds (or padding), and which it holds."""
  S_local = table.shape[0]
  at = slots_W - layout.first_local_slot(S_local)
  mine = (slots_W >= 0) & (at >= 0) & (at < S_local)
  rows = table[jnp.clip(at, 0, S_local - 1)]
  return jnp.where(mine[:, None], rows, -1), mine


def chunk_attend(layout, state: SlotState, slots_W, start_W, block_pages: int):
  """chunk_kv's `attend`: paged_attention.paged_chunk_attention, per device over its
  own slots' pages and its heads; the device holding a slot gives its rows, the others
  zeros, summed over the slot axes."""
  P = PartitionSpec
  s, h = layout.slot_axes, layout.head_axes
  cache_spec = P(None, s, h, None, None)

  def local(q, k_new, v_new, pool_k, pool_v, layer, table, slots, start):
    rows, mine = own_rows(layout, table, slots)
    out = paged_attention.paged_chunk_attention(
        q, k_new, v_new, pool_k, pool_v, layer, start, rows, block_pages, qwen3.kv_view
    )
    if layout.mesh is None or s is None:
      return out
    return jax.lax.psum(jnp.where(mine[:, None, None, None, None], out, 0), s)

  fn = layout.local(
      local,
      (P(None, None, h, None, None), P(None, None, h, None), P(None, None, h, None))
      + (cache_spec, cache_spec, P(), P(s, None), P(), P()),
      P(None, None, h, None, None),
  )
  return lambda q, k_new, v_new, layer: fn(
      q, k_new, v_new, state.kv.k, state.kv.v, layer, state.page_table, slots_W, start_W
  )


def write_chunks(layout, state: SlotState, k, v, slots_W, positions_WxT, live_WxT):
  """The chunks' k, v [L, W, T, K, H] into their slots' pages at their positions, each
  device into its own (paged_attention.write_pages, W x T entries in one scatter)."""

  def local(ck, cv, nk, nv, table, slots, positions, live):
    rows, mine = own_rows(layout, table, slots)
    L, W, T, K, H = nk.shape
    flat = lambda x: qwen3.kv_store(x.reshape(L, W * T, K, H), ck.dtype)
    rows = jnp.repeat(rows, T, axis=0)  # [W * T, J]
    live = (live & mine[:, None]).reshape(-1)
    return paged_attention.write_pages(
        (ck, cv), flat(nk), flat(nv), rows, positions.reshape(-1), live, ck.shape[1] - 1
    )

  P = PartitionSpec
  cache_spec = P(None, layout.slot_axes, layout.head_axes, None, None)
  new_spec = P(None, None, None, layout.head_axes, None)
  fn = layout.local(
      local,
      (cache_spec, cache_spec, new_spec, new_spec, P(layout.slot_axes, None), P(), P(), P()),
      (cache_spec, cache_spec),
  )
  out = fn(state.kv.k, state.kv.v, k, v, state.page_table, slots_W, positions_WxT, live_WxT)
  return qwen3.KVCache(*out)
