"""Ragged decode attention over a paged KV pool: a step reads each slot's live pages only.

The pool holds every slot's KV in fixed-size pages, k, v [L, P, K, page, H]; a slot's
page table lists its pages in order (entry j holds positions j*page .. j*page+page-1).
One decode step gives each slot one query and one new key; the slot attends to its own
first past[s] cached positions and to that new key.

How the work follows the live tokens (pure XLA, static shapes, so CPU, CUDA and ROCm
alike):
  1. Slot s reads n[s] = ceil(past[s] / page) pages. Number the live (slot, page) pairs
     0 .. sum(n) - 1 in (slot, position) order: pair e belongs to the slot whose range
     of the running sum of n holds e. Nothing is sorted or scattered to list them.
  2. A loop over chunks of `chunk_pages` pairs runs ceil(sum(n) / chunk_pages) times.
     Each chunk looks its pairs' pages up in the tables, gathers their keys and values
     (nothing else of the pool is read), scores them against their slots' queries and
     reduces each page to a partial online softmax (max, sum, weighted values).
  3. The partials merge into their slots through a one-hot [chunk, S] matrix (a max
     and two small matmuls): the per-slot combine of split-K flash decoding, where the
     split is the page. No scatter, so no atomics and no order that varies run to run.
     A page whose partial is not finite enters the products as 0 and marks its own slot
     NaN, so a NaN in one slot's KV never spreads (0 x NaN) to the other slots.
A step therefore reads live pages (plus at most one chunk of rounding), whatever the
longest slot or the table's width; a long-tailed mix of lengths costs what a uniform
mix of the same live tokens costs. The order of the sums depends on the slots' lengths
only, never on which physical pages they hold, so a resumed run equals the
uninterrupted one bit for bit.

Shapes: S slots, K kv heads, G query heads per kv head, H head dim, P pool pages,
J pages per slot (table width), C pages per chunk.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_NEG = -1e30  # a finite "minus infinity": exp(_NEG - m) == 0 and never NaN


def pages_read(past_S: jax.Array, page_size: int) -> jax.Array:
  """Pages each slot reads: ceil(past / page). int32 [S]."""
  return (past_S + page_size - 1) // page_size


def chunk_pairs(first: jax.Array, size: int, ends_S: jax.Array):
  """The live (slot, page index) pairs first .. first + size - 1, where slot s owns the
  pairs ends_S[s] - n[s] .. ends_S[s] - 1 (ends_S: the running sum of pages_read).
  Returns slot [size] (S past the last pair) and page index j [size]."""
  e = first + jnp.arange(size, dtype=jnp.int32)
  slot = jnp.sum(ends_S[None, :] <= e[:, None], axis=1, dtype=jnp.int32)  # [size]
  begins_S = jnp.concatenate([jnp.zeros((1,), ends_S.dtype), ends_S])  # begins_S[S]: the total
  return slot, e - begins_S[slot]


class PagePlan(NamedTuple):
  """One decode step's live (slot, page) pairs, listed once and read by every layer.

  pairs_3xE: for pair e, in (slot, position) order and padded to whole chunks, the
  slot (S for padding), its physical page (0 for padding) and how many of the page's
  positions the slot has written (0 for padding). num_chunks: the chunks that hold
  live pairs."""

  pairs_3xE: jax.Array
  num_chunks: jax.Array


def plan_pages(past_S: jax.Array, table_SxJ: jax.Array, page_size: int, chunk_pages: int):
  """The PagePlan for slots that attend to their first past_S[s] positions. Its size is
  static: room for every page the table can list, rounded up to whole chunks."""
  S, J = table_SxJ.shape
  C = chunk_pages
  size = -(-(S * J) // C) * C
  ends_S = jnp.cumsum(pages_read(past_S, page_size), dtype=jnp.int32)
  slot_E, j_E = chunk_pairs(jnp.int32(0), size, ends_S)
  row_E = jnp.minimum(slot_E, S - 1)
  page_E = table_SxJ[row_E, jnp.clip(j_E, 0, J - 1)]
  live_E = (slot_E < S) & (page_E >= 0)
  count_E = jnp.clip(past_S[row_E] - j_E * page_size, 0, page_size)
  pairs = jnp.stack([slot_E, jnp.where(live_E, page_E, 0), jnp.where(live_E, count_E, 0)]).astype(
      jnp.int32
  )
  return PagePlan(pairs, (ends_S[-1] + C - 1) // C)


def page_partials(q_CxKxGxH, pool_k_LxPxKxTxH, pool_v_LxPxKxTxH, layer, page_C, count_C, view):
  """The part of a chunk that reads the pool: pages page_C of one layer, each scored
  against its slot's query (q_CxKxGxH: the query of the slot that owns page c) over its
  first count_C[c] positions, and reduced to a partial online softmax. Returns m, l
  [C, K, G] and o [C, K, G, H] (float32; o not yet divided by l)."""
  k_c = view(pool_k_LxPxKxTxH[layer, page_C])  # [C, K, T, H]
  v_c = view(pool_v_LxPxKxTxH[layer, page_C])
  return score_pages(q_CxKxGxH, k_c, v_c, count_C)


def score_pages(q_CxKxGxH, k_CxKxTxH, v_CxKxTxH, count_C):
  """page_partials after its gather: C pages' keys and values, in hand, scored against
  their slots' queries over each page's first count_C[c] positions."""
  T, H = k_CxKxTxH.shape[2], q_CxKxGxH.shape[-1]
  q = q_CxKxGxH.astype(k_CxKxTxH.dtype)
  s = jnp.einsum("ckgh,ckth->ckgt", q, k_CxKxTxH, preferred_element_type=jnp.float32) * H**-0.5
  valid = (jnp.arange(T)[None, :] < count_C[:, None])[:, None, None, :]  # [C, 1, 1, T]
  s = jnp.where(valid, s, _NEG)
  m_c = jnp.max(s, axis=-1)  # [C, K, G]
  p = jnp.where(valid, jnp.exp(s - m_c[..., None]), 0.0)
  l_c = jnp.sum(p, axis=-1)
  o_c = jnp.einsum(
      "ckgt,ckth->ckgh", p.astype(v_CxKxTxH.dtype), v_CxKxTxH, preferred_element_type=jnp.float32
  )
  return m_c, l_c, o_c


def paged_decode_attention(
    q_SxKxGxH,
    k_new_SxKxH,
    v_new_SxKxH,
    pool_k_LxPxKxTxH,
    pool_v_LxPxKxTxH,
    layer,
    past_S,
    table_SxJ,
    chunk_pages: int,
    view=lambda x: x,
    plan: PagePlan | None = None,
) -> jax.Array:
  """Attention of each slot's query over its first past_S[s] pooled positions (through
  its page table row) and its own new key; a slot with past 0 sees its new key only.
  `view` turns the pool's storage into values (qwen3.kv_view). `plan`: the step's
  plan_pages (made here when None; a decode step makes it once for all layers).
  [S, K, G, H] in the pool's value dtype."""
  S, K, G, H = q_SxKxGxH.shape
  T = pool_k_LxPxKxTxH.shape[3]
  C = chunk_pages
  if plan is None:
    plan = plan_pages(past_S, table_SxJ, T, C)
  dtype = view(pool_k_LxPxKxTxH[:0]).dtype
  q = q_SxKxGxH.astype(dtype)
  scale = H**-0.5
  # The slot's own key opens its online softmax: m = its score, l = 1, o = its value.
  m = jnp.einsum("skgh,skh->skg", q, k_new_SxKxH.astype(dtype), preferred_element_type=jnp.float32)
  m = m * scale
  o = jnp.broadcast_to(v_new_SxKxH.astype(jnp.float32)[:, :, None, :], q.shape)
  l = jnp.ones(m.shape, jnp.float32)

  def chunk(c, carry):
    o, m, l, bad_S = carry
    slot_C, page_C, count_C = jax.lax.dynamic_slice_in_dim(plan.pairs_3xE, c * C, C, axis=1)
    row_C = jnp.minimum(slot_C, S - 1)
    m_c, l_c, o_c = page_partials(
        q[row_C], pool_k_LxPxKxTxH, pool_v_LxPxKxTxH, layer, page_C, count_C, view
    )
    # Merge each page's partial softmax into its slot (padding pairs own no slot).
    hot_CxS = slot_C[:, None] == jnp.arange(S)[None, :]
    finite_C = jnp.isfinite(o_c).all((1, 2, 3)) & jnp.isfinite(m_c + l_c).all((1, 2))
    bad_S = bad_S | jnp.any(hot_CxS & ~finite_C[:, None], axis=0)
    m_c = jnp.where(finite_C[:, None, None], m_c, _NEG)
    l_c = jnp.where(finite_C[:, None, None], l_c, 0.0)
    o_c = jnp.where(finite_C[:, None, None, None], o_c, 0.0)
    m_new = jnp.maximum(m, jnp.max(jnp.where(hot_CxS[..., None, None], m_c[:, None], _NEG), 0))
    w_c = jnp.where((count_C > 0)[:, None, None], jnp.exp(m_c - m_new[row_C]), 0.0)
    hot = hot_CxS.astype(jnp.float32)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.einsum("cs,ckg->skg", hot, l_c * w_c)
    o = o * corr[..., None] + jnp.einsum("cs,ckgh->skgh", hot, o_c * w_c[..., None])
    return o, m_new, l, bad_S

  bad = jnp.zeros((S,), bool)
  o, m, l, bad = jax.lax.fori_loop(0, plan.num_chunks, chunk, (o, m, l, bad))
  return jnp.where(bad[:, None, None, None], jnp.nan, o / l[..., None]).astype(dtype)


def write_pages(pool, new_k_LxSxKxH, new_v_LxSxKxH, table_SxJ, positions_S, live_S, scratch: int):
  """The pool with slot s's new k, v written at position positions_S[s] (its page
  table's page positions // page, entry positions % page), every layer. Slots not
  live write to page `scratch`, which no table lists. One scatter, in place on a
  donated pool. Returns (k, v)."""
  pool_k, pool_v = pool
  T = pool_k.shape[3]
  S = table_SxJ.shape[0]
  rows = jnp.arange(S)
  page_S = table_SxJ[rows, jnp.clip(positions_S // T, 0, table_SxJ.shape[1] - 1)]
  page_S = jnp.where(live_S & (page_S >= 0), page_S, scratch)
  off_S = jnp.where(live_S, positions_S % T, 0)
  # Indexing dims 1 and 3 with [S] arrays puts S first: updates are [S, L, K, H].
  put = lambda pool, new: pool.at[:, page_S, :, off_S, :].set(new.transpose(1, 0, 2, 3))
  return put(pool_k, new_k_LxSxKxH), put(pool_v, new_v_LxSxKxH)


def _chunk_self(q_WxTxKxGxH, k_WxTxKxH, v_WxTxKxH, scale: float):
  """The chunk's own keys, causally: the online softmax's start (o, m, l), each query
  seeing at least itself."""
  T = q_WxTxKxGxH.shape[1]
  s = jnp.einsum("wtkgh,wukh->wkgtu", q_WxTxKxGxH, k_WxTxKxH, preferred_element_type=jnp.float32)
  causal = (jnp.arange(T)[:, None] >= jnp.arange(T)[None, :])[None, None, None]
  s = jnp.where(causal, s * scale, _NEG)
  m = jnp.max(s, axis=-1)  # [W, K, G, T]
  p = jnp.where(causal, jnp.exp(s - m[..., None]), 0.0)
  o = jnp.einsum("wkgtu,wukh->wkgth", p, v_WxTxKxH.astype(jnp.float32))
  return o, m, jnp.sum(p, axis=-1)


def paged_chunk_attention(
    q_WxTxKxGxH,
    k_new_WxTxKxH,
    v_new_WxTxKxH,
    pool_k_LxPxKxTxH,
    pool_v_LxPxKxTxH,
    layer,
    start_W,
    table_WxJ,
    block_pages: int,
    view=lambda x: x,
) -> jax.Array:
  """Attention of W chunks of T queries each (a slot's given tokens, fed in one call):
  chunk w's query t sits at position start_W[w] + t and attends to the slot's first
  start_W[w] pooled positions (through its page table row table_WxJ[w]; a row of -1
  reads nothing) and, causally, to its chunk's own keys 0..t. The pool is read in
  blocks of `block_pages` pages, as many blocks as the longest start needs (a loop, so
  no past length compiles a new program), merged by online softmax in float32, the
  scores of decode attention's: operands in the pool's value dtype. [W, T, K, G, H] in
  that dtype."""
  W, T, K, G, H = q_WxTxKxGxH.shape
  J, page = table_WxJ.shape[1], pool_k_LxPxKxTxH.shape[3]
  dtype = view(pool_k_LxPxKxTxH[:0]).dtype
  q = q_WxTxKxGxH.astype(dtype)
  scale = H**-0.5
  # The chunk's keys and values as the pool stores them: as a decode step reads them.
  o, m, l = _chunk_self(q, k_new_WxTxKxH.astype(dtype), v_new_WxTxKxH.astype(dtype), scale)
  span = block_pages * page

  def block(b, carry):
    o, m, l = carry
    j = b * block_pages + jnp.arange(block_pages)
    ids = table_WxJ[:, jnp.clip(j, 0, J - 1)]  # [W, C]
    ok = (ids >= 0) & (j < J)[None, :]
    gather = lambda pool: view(pool[layer, jnp.maximum(ids, 0)]).transpose(0, 2, 1, 3, 4)
    k_b = gather(pool_k_LxPxKxTxH).reshape(W, K, span, H)  # [W, K, C*page, H]
    v_b = gather(pool_v_LxPxKxTxH).reshape(W, K, span, H)
    pos = (j[:, None] * page + jnp.arange(page)[None, :]).reshape(-1)
    valid = (pos[None, :] < start_W[:, None]) & jnp.repeat(ok, page, axis=1)  # [W, C*page]
    valid = valid[:, None, None, None, :]
    s = jnp.einsum("wtkgh,wkch->wkgtc", q, k_b, preferred_element_type=jnp.float32) * scale
    s = jnp.where(valid, s, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=-1)
    o = o * corr[..., None] + jnp.einsum(
        "wkgtc,wkch->wkgth", p.astype(dtype), v_b, preferred_element_type=jnp.float32
    )
    return o, m_new, l

  num_blocks = (jnp.max(start_W) + span - 1) // span
  o, m, l = jax.lax.fori_loop(0, num_blocks, block, (o, m, l))
  return (o / l[..., None]).transpose(0, 3, 1, 2, 4).astype(dtype)
