"""Ragged decode attention over a paged KV pool: a step reads each slot's live pages only.

The pool holds every slot's KV in fixed-size pages, k, v [L, P, K, page, H]; a slot's
page table lists its pages in order (entry j holds positions j*page .. j*page+page-1).
One decode step gives each slot one query and one new key; the slot attends to its own
first past[s] cached positions and to that new key.

How the work follows the live tokens (pure XLA, static shapes, so CPU, CUDA and ROCm
alike):
  1. `page_owners` inverts the page tables: each page's owning slot and first position.
  2. The live pages (owned by a live slot, holding at least one position < past) are
     sorted to the front of a static list; `num_live` counts them.
  3. A loop over chunks of `chunk_pages` pages runs ceil(num_live / chunk_pages)
     times. Each chunk gathers its pages' keys and values (nothing else of the pool is
     read), scores them against their owners' queries and reduces each page to a
     partial online softmax (max, sum, weighted values).
  4. The partials are merged into their slots with segment max / sum: the per-slot
     online-softmax combine of split-K flash decoding, where the split is the page.
A step therefore reads live pages (plus at most one chunk of rounding), whatever the
longest slot or the table's width; a long-tailed mix of lengths costs what a uniform
mix of the same live tokens costs.

Shapes: S slots, K kv heads, G query heads per kv head, H head dim, P pool pages,
J pages per slot (table width), C pages per chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30  # a finite "minus infinity": exp(_NEG - m) == 0 and never NaN


def page_owners(table_SxJ: jax.Array, num_pages: int, page_size: int):
  """Each pool page's owner slot (-1: unowned) and the position of its first entry.

  Table entries < 0 are unused. int32 [P] both."""
  S, J = table_SxJ.shape
  used = table_SxJ >= 0
  at = jnp.where(used, table_SxJ, num_pages).reshape(-1)  # unused: dropped
  slot = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[:, None], (S, J)).reshape(-1)
  start = jnp.broadcast_to(jnp.arange(J, dtype=jnp.int32)[None, :] * page_size, (S, J))
  owner_P = jnp.full((num_pages,), -1, jnp.int32).at[at].set(slot, mode="drop")
  start_P = jnp.zeros((num_pages,), jnp.int32).at[at].set(start.reshape(-1), mode="drop")
  return owner_P, start_P


def live_pages(owner_P, start_P, past_S, live_S, chunk_pages: int):
  """The pages holding a live slot's cached positions, first, in a list padded to a
  multiple of chunk_pages: (page ids int32 [P'], how many are live).

  Live pages are listed by (slot, position), not by page id: which physical pages a
  slot got does not change the order of the sums, so results are the same bits
  whatever the pool's history (a resumed run equals the uninterrupted one)."""
  P = owner_P.shape[0]
  slot = jnp.maximum(owner_P, 0)
  live = (owner_P >= 0) & live_S[slot] & (start_P < past_S[slot])
  rank = jnp.where(live, slot, live_S.shape[0])  # the dead sort last
  order = jnp.lexsort((start_P, rank)).astype(jnp.int32)
  pad = -P % chunk_pages
  order = jnp.concatenate([order, jnp.zeros((pad,), jnp.int32)])
  return order, jnp.sum(live, dtype=jnp.int32)


def paged_decode_attention(
    q_SxKxGxH,
    k_new_SxKxH,
    v_new_SxKxH,
    pool_k_LxPxKxTxH,
    pool_v_LxPxKxTxH,
    layer,
    past_S,
    owner_P,
    start_P,
    pages_Pp,
    num_live,
    chunk_pages: int,
    view=lambda x: x,
) -> jax.Array:
  """Attention of each slot's query over its first past_S[s] pooled positions and its
  own new key. pages_Pp, num_live: `live_pages`; owner_P, start_P: `page_owners`.
  `view` turns the pool's storage into values (qwen3.kv_view). [S, K, G, H] in the
  pool's value dtype."""
  S, K, G, H = q_SxKxGxH.shape
  T = pool_k_LxPxKxTxH.shape[3]
  C = chunk_pages
  dtype = view(pool_k_LxPxKxTxH[:0]).dtype
  q = q_SxKxGxH.astype(dtype)
  scale = H**-0.5
  # The slot's own key opens its online softmax: m = its score, l = 1, o = its value.
  m = jnp.einsum("skgh,skh->skg", q, k_new_SxKxH.astype(dtype), preferred_element_type=jnp.float32)
  m = m * scale
  o = jnp.broadcast_to(v_new_SxKxH.astype(jnp.float32)[:, :, None, :], q.shape)
  l = jnp.ones(m.shape, jnp.float32)

  def chunk(c, carry):
    o, m, l = carry
    ids_C = jax.lax.dynamic_slice_in_dim(pages_Pp, c * C, C)
    in_list = c * C + jnp.arange(C) < num_live
    slot_C = jnp.where(in_list, jnp.maximum(owner_P[ids_C], 0), S)  # S: the dump row
    k_c = view(pool_k_LxPxKxTxH[layer, ids_C])  # [C, K, T, H]
    v_c = view(pool_v_LxPxKxTxH[layer, ids_C])
    q_c = q[jnp.minimum(slot_C, S - 1)]  # [C, K, G, H]
    s = jnp.einsum("ckgh,ckth->ckgt", q_c, k_c, preferred_element_type=jnp.float32) * scale
    pos_CxT = start_P[ids_C][:, None] + jnp.arange(T)[None, :]
    valid = in_list[:, None] & (pos_CxT < past_S[jnp.minimum(slot_C, S - 1)][:, None])
    s = jnp.where(valid[:, None, None, :], s, _NEG)
    m_c = jnp.max(s, axis=-1)  # [C, K, G]
    p = jnp.where(valid[:, None, None, :], jnp.exp(s - m_c[..., None]), 0.0)
    l_c = jnp.sum(p, axis=-1)
    o_c = jnp.einsum("ckgt,ckth->ckgh", p.astype(dtype), v_c, preferred_element_type=jnp.float32)
    # Merge each page's partial softmax into its slot (row S collects the padding).
    m_new = jnp.concatenate([m, jnp.full((1, K, G), _NEG, jnp.float32)]).at[slot_C].max(m_c)[:S]
    w_c = jnp.exp(m_c - jnp.concatenate([m_new, jnp.zeros((1, K, G), jnp.float32)])[slot_C])
    corr = jnp.exp(m - m_new)
    l = (l * corr).at[slot_C].add(l_c * w_c, mode="drop")
    o = (o * corr[..., None]).at[slot_C].add(o_c * w_c[..., None], mode="drop")
    return o, m_new, l

  num_chunks = (num_live + C - 1) // C
  o, m, l = jax.lax.fori_loop(0, num_chunks, chunk, (o, m, l))
  return (o / l[..., None]).astype(dtype)


def write_pages(pool, new_k_LxSxKxH, new_v_LxSxKxH, table_SxJ, positions_S, live_S, scratch: int):
  """The pool with slot s's new k, v written at position positions_S[s] (its page
  table's page positions // page, entry positions % page), every layer. Slots not
  live write to page `scratch`, which no table lists. In place on a donated pool: one
  dynamic_update_slice per slot in a loop. Returns (k, v)."""
  pool_k, pool_v = pool
  T = pool_k.shape[3]
  S = table_SxJ.shape[0]
  rows = jnp.arange(S)
  page_S = table_SxJ[rows, jnp.clip(positions_S // T, 0, table_SxJ.shape[1] - 1)]
  page_S = jnp.where(live_S & (page_S >= 0), page_S, scratch)
  off_S = jnp.where(live_S, positions_S % T, 0)

  def put(s, pool):
    k, v = pool
    at = (0, page_S[s], 0, off_S[s], 0)
    k = jax.lax.dynamic_update_slice(k, new_k_LxSxKxH[:, s, :, None, None, :].swapaxes(1, 2), at)
    v = jax.lax.dynamic_update_slice(v, new_v_LxSxKxH[:, s, :, None, None, :].swapaxes(1, 2), at)
    return k, v

  return jax.lax.fori_loop(0, S, put, (pool_k, pool_v))
