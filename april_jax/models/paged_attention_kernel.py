"""Ragged decode attention as one Pallas kernel that reads each page where it lies.

paged_attention.paged_decode_attention, the XLA path, gathers a chunk of pages and then
scores it; XLA writes the gathered pages out before the products read them (on the CPU
and on an H200 alike: BENCHMARKS.md), so a step may move its KV three times. This kernel
computes the same function with no gather. Program (s, k, i) of a grid over slots, KV
heads and splits walks the i-th run of `pages_per_split` entries of slot s's page-table
row (within its first ceil(past[s] / page) pages), loads each page of head k straight
from the pool, BLOCK positions at a time and no further than the slot's length, scores
them against the slot's G queries and keeps an online softmax (max, sum, weighted
values) across them; a split past the slot's pages does nothing. The
splits' partial softmaxes then merge per slot (split-K flash decoding, in XLA: small),
and the slot's new key opens the softmax, as on the XLA path. Nothing is copied,
nothing past a slot's length is read, and since no program walks more than
pages_per_split pages, the longest slot of a long-tailed mix does not hold the kernel up:
its pages are spread over as many programs as it needs.

Pallas lowers it for Triton (NVIDIA and AMD GPUs). On the CPU it runs in Pallas' interpret
mode: slow, for tests, which hold it to the XLA path as its reference. The order of the
sums is fixed by the slot's length, whatever pages it holds, so a resumed run equals the
uninterrupted one bit for bit here too.

Shapes: S slots, K kv heads, G query heads per kv head, H head dim, L layers, P pool
pages, T positions per page, J pages per slot (table width).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

_NEG = -1e30  # as paged_attention: exp(_NEG - m) == 0, never NaN
_MIN_ROWS = 16  # a GPU matrix product takes at least 16 rows: the G queries are padded
SPLIT_POSITIONS = 2048  # pooled positions one program reads at most (pages_per_split's default)
BLOCK = 64  # positions scored per loop step: a block of K and V, not a page, in fast memory


def _kernel(
    layer_ref,
    past_ref,
    table_ref,
    q_ref,
    pool_k_ref,
    pool_v_ref,
    m_ref,
    l_ref,
    o_ref,
    *,
    view,
    pages_per_split,
    block,
):
  """Program (s, k, i): the i-th run of pages_per_split of slot s's cached pages, KV head
  k, `block` positions at a time up to the slot's length; an online softmax over them."""
  s, k, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer, past = layer_ref[0], past_ref[s]
  T, H = pool_k_ref.shape[3], pool_k_ref.shape[4]
  q = q_ref[...]  # [G', H] in the values' dtype
  rows = q.shape[0]
  per_page = T // block

  def step(b, carry):
    m, l, o = carry
    j, offset = b // per_page, (b % per_page) * block
    at = table_ref[s, j]
    k_blk = view(pool_k_ref[layer, at, k, pl.ds(offset, block), :])  # [block, H], in place
    v_blk = view(pool_v_ref[layer, at, k, pl.ds(offset, block), :])
    scores = jax.lax.dot_general(
        q, k_blk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    scores = scores * H**-0.5  # [G', block]
    valid = b * block + jax.lax.broadcasted_iota(jnp.int32, (rows, block), 1) < past
    scores = jnp.where(valid, scores, _NEG)
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    p = jnp.where(valid, jnp.exp(scores - m_new[:, None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=1)
    pv = jax.lax.dot_general(
        p.astype(v_blk.dtype), v_blk, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return m_new, l, o * corr[:, None] + pv

  init = (
      jnp.full((rows,), _NEG, jnp.float32),
      jnp.zeros((rows,), jnp.float32),
      jnp.zeros((rows, H), jnp.float32),
  )
  # Block b holds positions b * block ..: this split's pages, up to the slot's length.
  first = i * pages_per_split * per_page
  end = jnp.minimum((past + block - 1) // block, first + pages_per_split * per_page)
  m, l, o = jax.lax.fori_loop(first, jnp.maximum(end, first), step, init)
  m_ref[...], l_ref[...], o_ref[...] = m, l, o


def cached_partials(
    q_SxKxGxH,
    pool_k_LxPxKxTxH,
    pool_v_LxPxKxTxH,
    layer,
    past_S,
    table_SxJ,
    view=lambda x: x,
    interpret: bool | None = None,
    pages_per_split: int | None = None,
):
  """Each slot's online softmax over its first past_S[s] pooled positions: m, l [S, K, G]
  and o [S, K, G, H] (float32, o not yet divided by l). A slot with past 0 gets m = _NEG,
  l = 0, o = 0. `interpret`: None runs Pallas' interpreter on the CPU only.
  pages_per_split: pages one program reads at most (None: SPLIT_POSITIONS' worth)."""
  S, K, G, H = q_SxKxGxH.shape
  J = table_SxJ.shape[1]
  dtype = view(pool_k_LxPxKxTxH[:0]).dtype
  rows = max(G, _MIN_ROWS)
  q = jnp.pad(q_SxKxGxH.astype(dtype), ((0, 0), (0, 0), (0, rows - G), (0, 0)))
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  T = pool_k_LxPxKxTxH.shape[3]
  if not interpret and (T & (T - 1) or H & (H - 1)):
    raise ValueError(
        f"the decode-attention kernel tiles whole pages: page_size {T} and head_dim {H} "
        "must be powers of two on a GPU (rollout.decode_attention='xla' takes any)"
    )
  if pages_per_split is None:
    pages_per_split = max(1, SPLIT_POSITIONS // T)
  splits = max(1, -(-J // pages_per_split))
  anywhere = pl.BlockSpec(memory_space=pl.ANY)
  # The query block of slot s, head k (every split reads it); each split's own outputs.
  query = pl.BlockSpec((None, None, rows, H), lambda s, k, i: (s, k, 0, 0))
  per_split = lambda *tail: pl.BlockSpec(
      (None, None, None, rows) + tail, lambda s, k, i: (s, k, i, 0) + (0,) * len(tail)
  )
  m, l, o = pl.pallas_call(
      functools.partial(_kernel, view=view, pages_per_split=pages_per_split, block=min(BLOCK, T)),
      out_shape=(
          jax.ShapeDtypeStruct((S, K, splits, rows), jnp.float32),
          jax.ShapeDtypeStruct((S, K, splits, rows), jnp.float32),
          jax.ShapeDtypeStruct((S, K, splits, rows, H), jnp.float32),
      ),
      grid=(S, K, splits),
      in_specs=[anywhere, anywhere, anywhere, query, anywhere, anywhere],
      out_specs=(per_split(), per_split(), per_split(H)),
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
      name="paged_decode_attention",
  )(
      jnp.reshape(layer, (1,)).astype(jnp.int32),
      past_S.astype(jnp.int32),
      table_SxJ.astype(jnp.int32),
      q,
      pool_k_LxPxKxTxH,
      pool_v_LxPxKxTxH,
  )
  # Merge the splits of each slot (a split with no pages has l = 0, o = 0).
  m, l, o = m[:, :, :, :G], l[:, :, :, :G], o[:, :, :, :G]
  m_all = jnp.max(m, axis=2)  # [S, K, G]
  w = jnp.exp(m - m_all[:, :, None])
  return m_all, jnp.sum(w * l, axis=2), jnp.sum(w[..., None] * o, axis=2)


def paged_decode_attention(
    q_SxKxGxH,
    k_new_SxKxH,
    v_new_SxKxH,
    pool_k_LxPxKxTxH,
    pool_v_LxPxKxTxH,
    layer,
    past_S,
    table_SxJ,
    view=lambda x: x,
    interpret: bool | None = None,
    pages_per_split: int | None = None,
) -> jax.Array:
  """paged_attention.paged_decode_attention through the kernel: each slot's query over
  its first past_S[s] pooled positions and its own new key. [S, K, G, H] in the pool's
  value dtype. pages_per_split: as cached_partials."""
  H = q_SxKxGxH.shape[-1]
  dtype = view(pool_k_LxPxKxTxH[:0]).dtype
  m_c, l_c, o_c = cached_partials(
      q_SxKxGxH,
      pool_k_LxPxKxTxH,
      pool_v_LxPxKxTxH,
      layer,
      past_S,
      table_SxJ,
      view,
      interpret,
      pages_per_split,
  )
  q = q_SxKxGxH.astype(dtype)
  m0 = jnp.einsum("skgh,skh->skg", q, k_new_SxKxH.astype(dtype), preferred_element_type=jnp.float32)
  m0 = m0 * H**-0.5
  m = jnp.maximum(m0, m_c)
  own, cached = jnp.exp(m0 - m), jnp.exp(m_c - m)  # cached == 0 for a slot with past 0
  v_new = v_new_SxKxH.astype(jnp.float32)[:, :, None, :]
  o = own[..., None] * v_new + cached[..., None] * o_c
  return (o / (own + cached * l_c)[..., None]).astype(dtype)
