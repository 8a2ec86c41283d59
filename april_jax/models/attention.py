"""Causal attention for whole sequences, and decode attention over a slot cache.

Whole sequences (prefill, training), grouped-query, causal from position 0; with
`segments` [B, T] (packed training rows: a segment id per token), a query attends only
to the keys of its own segment:
  "dense"      the reference: [B, K, G, T, S] float32 scores. Short sequences only.
  "blockwise"  online softmax over KV chunks of `chunk` keys (a flash attention in
               pure JAX, forward and a hand-written backward): scores exist for one
               chunk at a time, O(T x chunk) memory. Runs everywhere (CPU, ROCm, TPU).
  "cudnn"      cuDNN's flash kernel (NVIDIA, bf16/fp16): jax.nn.dot_product_attention,
               or for segments jax's cuDNN module with its packed layout (Hopper or
               newer; keys and values repeated to the query heads, since jax's packed
               offsets for grouped keys are wrong before its 0.11 fix). The packed call
               has not yet run on a GPU.
  "auto"       cudnn on an NVIDIA GPU with a 16-bit compute dtype (with segments: on
               Hopper or newer), else blockwise.
A run checks the cuDNN calls it would make against blockwise at start-up (path_check.py).

Decode (one new token per slot): `decode_attention` reads the cache [B, K, S, H] of one
layer in blocks up to the longest live slot (a loop with a device-side trip count), so
a step costs what the live sequences hold, never copies a window of the cache, and
compiles once whatever the lengths. The cache layout puts the KV head before the
sequence, so both matmuls are plain batched matmuls over (B, K) with no transpose.

Shapes: B batch, T queries, S keys, N query heads, K kv heads, G = N // K, H head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "dense", "blockwise", "cudnn")
MAX_SEGMENTS = 64  # segments a packed row may hold (the width of cuDNN's segment table)
_NEG = -1e30  # a finite "minus infinity": exp(_NEG - m) == 0 and never NaN


def resolve(impl: str, dtype, segments: bool = False) -> str:
  """The implementation `auto` stands for on this backend and compute dtype (with
  segments: cuDNN's packed layout needs a Hopper GPU or newer)."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention must be one of {IMPLEMENTATIONS}, got {impl!r}")
  if impl != "auto":
    return impl
  device = jax.devices()[0]
  nvidia = device.platform == "gpu" and "cuda" in device.client.platform_version.lower()
  sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  if segments and nvidia:
    major = str(getattr(device, "compute_capability", "0")).split(".")[0]
    nvidia = major.isdigit() and int(major) >= 9
  return "cudnn" if nvidia and sixteen_bit else "blockwise"


def causal_attention(
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, impl: str = "dense", chunk: int = 512, segments_BxT=None
) -> jax.Array:
  """softmax(q k^T / sqrt(H) + causal mask) v: [B, T, N, H] in q's dtype; with
  segments_BxT, masked to each query's own segment too."""
  impl = resolve(impl, q_BxTxNxH.dtype, segments_BxT is not None)
  if impl == "cudnn":
    if segments_BxT is not None:
      return _cudnn_segments(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segments_BxT)
    return jax.nn.dot_product_attention(
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, is_causal=True, implementation="cudnn"
    )
  B, T, N, H = q_BxTxNxH.shape
  K = k_BxTxKxH.shape[2]
  q = q_BxTxNxH.reshape(B, T, K, N // K, H)
  if impl == "dense" or T <= chunk:
    out = _dense(q, k_BxTxKxH, v_BxTxKxH, segments_BxT)
  else:
    out = _blockwise(q, k_BxTxKxH, v_BxTxKxH, segments_BxT, chunk)
  return out.reshape(B, T, N, H)


def _dense(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, segments_BxT=None):
  T, H = q_BxTxKxGxH.shape[1], q_BxTxKxGxH.shape[-1]
  s = (
      jnp.einsum("btkgh,bskh->btkgs", q_BxTxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32)
      * H**-0.5
  )
  allowed = jnp.tril(jnp.ones((T, k_BxSxKxH.shape[1]), bool))[None]  # [1, T, S]
  if segments_BxT is not None:
    allowed = allowed & (segments_BxT[:, :, None] == segments_BxT[:, None, :])
  p = jax.nn.softmax(jnp.where(allowed[:, :, None, None, :], s, _NEG), axis=-1)
  return jnp.einsum("btkgs,bskh->btkgh", p.astype(v_BxSxKxH.dtype), v_BxSxKxH)


def segment_runs(segments_BxT, max_runs: int):
  """The runs of equal segment ids along each row, as cuDNN's packed layout takes them:
  (lengths [B, max_runs], start offsets [B, max_runs + 1]), unused entries -1. A row's
  trailing padding is a run of its own, so every position belongs to one."""
  B, T = segments_BxT.shape
  starts_BxT = jnp.concatenate(
      [jnp.ones((B, 1), bool), segments_BxT[:, 1:] != segments_BxT[:, :-1]], axis=1
  )
  offsets = jax.vmap(lambda s: jnp.nonzero(s, size=max_runs + 1, fill_value=-1)[0])(starts_BxT)
  count_B = jnp.sum(starts_BxT, axis=1)[:, None]
  index = jnp.arange(max_runs)[None, :]
  ends = jnp.where(index + 1 < count_B, offsets[:, 1:], T)  # the next run's start, or T
  lengths = jnp.where(index < count_B, ends - offsets[:, :-1], -1)
  return lengths.astype(jnp.int32), offsets.astype(jnp.int32)


def _cudnn_segments(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segments_BxT):
  """cuDNN's flash attention over packed rows (its ragged layout: each run of a segment id
  attends causally to itself only). Reached only on NVIDIA GPUs through jax's cuDNN
  attention module, which jax.nn.dot_product_attention does not expose segments of.
  Keys and values are repeated to the query heads: jax before its 0.11 fix scales the
  key offsets by the query's heads."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # pylint: disable=g-import-not-at-top

  groups = q_BxTxNxH.shape[2] // k_BxTxKxH.shape[2]
  k_BxTxNxH, v_BxTxNxH = (jnp.repeat(x, groups, axis=2) for x in (k_BxTxKxH, v_BxTxKxH))
  lengths, offsets = segment_runs(segments_BxT, MAX_SEGMENTS + 1)
  return cudnn.dot_product_attention(
      q_BxTxNxH,
      k_BxTxNxH,
      v_BxTxNxH,
      q_seqlen=lengths,
      kv_seqlen=lengths,
      q_offsets=offsets,
      kv_offsets=offsets,
      scale=q_BxTxNxH.shape[-1] ** -0.5,
      mask_type=cudnn.MaskType.PADDING_CAUSAL,  # causal within each run of the table
      qkv_layout="BTNH",
  )


# ------------------------------------------------------------------ blockwise (flash)


def _chunks(x_BxSxKxH, chunk: int):
  """[B, S, K, H] -> [C, B, chunk, K, H], zero-padded (causality masks the padding)."""
  B, S, K, H = x_BxSxKxH.shape
  pad = -S % chunk
  x = jnp.pad(x_BxSxKxH, ((0, 0), (0, pad), (0, 0), (0, 0)))
  return x.reshape(B, -1, chunk, K, H).transpose(1, 0, 2, 3, 4)


def _segment_chunks(segments_BxS, chunk: int):
  """[B, S] -> [C, B, chunk], padded with -1 (a segment no query has); None stays None."""
  if segments_BxS is None:
    return None
  B, S = segments_BxS.shape
  x = jnp.pad(segments_BxS, ((0, 0), (0, -S % chunk)), constant_values=-1)
  return x.reshape(B, -1, chunk).transpose(1, 0, 2)


def _chunk_scores(q, k_c, j, chunk, seg_q=None, seg_c=None):
  """Scaled scores of all queries against KV chunk j, and where causality (and, with
  segments, the query's own segment) allows them: [B, T, K, G, chunk] float32 (masked to
  _NEG) and bool, broadcastable."""
  T, H = q.shape[1], q.shape[-1]
  s = jnp.einsum("btkgh,bckh->btkgc", q, k_c, preferred_element_type=jnp.float32)
  allowed_TxC = (j * chunk + jnp.arange(chunk))[None, :] <= jnp.arange(T)[:, None]
  allowed = allowed_TxC[None, :, None, None, :]
  if seg_q is not None:
    allowed = allowed & (seg_q[:, :, None] == seg_c[:, None, :])[:, :, None, None, :]
  return jnp.where(allowed, s * H**-0.5, _NEG), allowed


def _blockwise_forward(q, k, v, segments, chunk):
  B, T, K, G, H = q.shape
  k_c, v_c, seg_c = _chunks(k, chunk), _chunks(v, chunk), _segment_chunks(segments, chunk)

  def body(carry, xs):
    o, m, l = carry
    k_j, v_j, seg_j, j = xs
    s, allowed = _chunk_scores(q, k_j, j, chunk, segments, seg_j)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
    scale = jnp.exp(m - m_new)
    l = l * scale + jnp.sum(p, axis=-1)
    pv = jnp.einsum("btkgc,bckh->btkgh", p.astype(v.dtype), v_j, preferred_element_type=jnp.float32)
    return (o * scale[..., None] + pv, m_new, l), None

  init = (
      jnp.zeros((B, T, K, G, H), jnp.float32),
      jnp.full((B, T, K, G), _NEG, jnp.float32),
      jnp.zeros((B, T, K, G), jnp.float32),
  )
  (o, m, l), _ = jax.lax.scan(body, init, (k_c, v_c, seg_c, jnp.arange(k_c.shape[0])))
  # Every query sees its own key (causal, its own segment), so l > 0 everywhere.
  return (o / l[..., None]).astype(q.dtype), m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blockwise(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, segments_BxS, chunk: int):
  return _blockwise_forward(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, segments_BxS, chunk)[0]


def _blockwise_fwd(q, k, v, segments, chunk):
  o, lse = _blockwise_forward(q, k, v, segments, chunk)
  return o, (q, k, v, segments, o, lse)


def _blockwise_bwd(chunk, residuals, do):
  """The flash attention backward: probabilities recomputed chunk by chunk from the
  saved log-sum-exp; dq accumulates, dk and dv come out one chunk at a time."""
  q, k, v, segments, o, lse = residuals
  S, H = k.shape[1], q.shape[-1]
  k_c, v_c, seg_c = _chunks(k, chunk), _chunks(v, chunk), _segment_chunks(segments, chunk)
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, T, K, G]

  def body(dq, xs):
    k_j, v_j, seg_j, j = xs
    s, allowed = _chunk_scores(q, k_j, j, chunk, segments, seg_j)
    p = jnp.where(allowed, jnp.exp(s - lse[..., None]), 0.0)
    dv_j = jnp.einsum(
        "btkgc,btkgh->bckh", p.astype(do.dtype), do, preferred_element_type=jnp.float32
    )
    dp = jnp.einsum("btkgh,bckh->btkgc", do, v_j, preferred_element_type=jnp.float32)
    ds = (p * (dp - delta[..., None]) * H**-0.5).astype(q.dtype)
    dq = dq + jnp.einsum("btkgc,bckh->btkgh", ds, k_j, preferred_element_type=jnp.float32)
    dk_j = jnp.einsum("btkgc,btkgh->bckh", ds, q, preferred_element_type=jnp.float32)
    return dq, (dk_j, dv_j)

  dq, (dk_c, dv_c) = jax.lax.scan(
      body, jnp.zeros(q.shape, jnp.float32), (k_c, v_c, seg_c, jnp.arange(k_c.shape[0]))
  )
  unchunk = lambda x_c: x_c.transpose(1, 0, 2, 3, 4).reshape((k.shape[0], -1) + k.shape[2:])[:, :S]
  dq, dk, dv = dq.astype(q.dtype), unchunk(dk_c).astype(k.dtype), unchunk(dv_c).astype(v.dtype)
  return dq, dk, dv, None  # segment ids take no gradient


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


# ------------------------------------------------------------------------- decode


def decode_attention(
    q_BxKxGxH,
    k_new_BxKxH,
    v_new_BxKxH,
    k_cache_LxBxKxSxH,
    v_cache_LxBxKxSxH,
    layer,
    past_B,
    block: int,
    view=lambda x: x,
) -> jax.Array:
  """One query per row over its first past_B[b] entries of the cache's layer `layer`,
  plus its own new key. The whole [L, B, K, S, H] cache comes in and blocks of `block`
  keys are sliced from it, only as many as the longest row needs: nothing else of the
  cache is read or copied. `view` turns the cache's storage into values (see
  qwen3.kv_view). Returns [B, K, G, H] in the cache's value dtype.
  """
  _, B, K, S, H = k_cache_LxBxKxSxH.shape
  block = min(block, S)
  dtype = view(k_cache_LxBxKxSxH[:0]).dtype
  q = q_BxKxGxH.astype(dtype)
  scale = H**-0.5
  # The row's own key opens the online softmax: m = its score, l = 1, o = its value.
  m = (
      jnp.einsum(
          "bkgh,bkh->bkg", q, k_new_BxKxH.astype(q.dtype), preferred_element_type=jnp.float32
      )
      * scale
  )
  o = jnp.broadcast_to(v_new_BxKxH.astype(jnp.float32)[:, :, None, :], q.shape)
  l = jnp.ones(m.shape, jnp.float32)

  def body(j, carry):
    o, m, l = carry
    # The last block may start early so it stays inside the cache; keys already
    # counted by block j-1 are masked out.
    start = jnp.minimum(j * block, S - block)
    at = (layer, 0, 0, start, 0)
    k_b = view(jax.lax.dynamic_slice(k_cache_LxBxKxSxH, at, (1, B, K, block, H))[0])
    v_b = view(jax.lax.dynamic_slice(v_cache_LxBxKxSxH, at, (1, B, K, block, H))[0])
    s = jnp.einsum("bkgh,bksh->bkgs", q, k_b, preferred_element_type=jnp.float32) * scale
    key = start + jnp.arange(block)
    valid = (key[None, :] >= j * block) & (key[None, :] < past_B[:, None])  # [B, block]
    s = jnp.where(valid[:, None, None, :], s, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(valid[:, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum("bkgs,bksh->bkgh", p.astype(v_b.dtype), v_b, preferred_element_type=jnp.float32)
    return o * corr[..., None] + pv, m_new, l * corr + jnp.sum(p, axis=-1)

  num_blocks = (jnp.max(past_B) + block - 1) // block
  o, m, l = jax.lax.fori_loop(0, num_blocks, body, (o, m, l))
  return (o / l[..., None]).astype(dtype)
