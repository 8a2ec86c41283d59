"""The slot state: a fixed-shape pytree holding every sequence the sampler decodes.

S slots, each able to hold M tokens (prompt + response). A slot holding a sample keeps
  tokens[s, :length]             prompt then response so far
  page_table[s, :]               the pool pages holding its KV, in order (-1 past the
                                 last; local page ids, see pages.py): the host's table
                                 as the last insert or decode call was given it
  kv.k/kv.v[:, page, :, i]       the pool, [L, P, K, page_size, H]: position t of slot s
                                 is entry t % page_size of page page_table[s, t //
                                 page_size]. The pool holds the KV of all but the last
                                 token; the last token is "pending": the next decode
                                 step feeds it at position length-1, writes its KV and
                                 samples token `length`
  logprobs/versions[s, t]        for each response token t: its behavior logprob and its
                                 version tag (-1 for prompt tokens): the oldest policy
                                 version that token's forward pass saw, i.e.
                                 min(the drawing version, kv_version[s]); a given
                                 token keeps the tag the host wrote (engine.extend:
                                 the version that gave it)
  kv_version[s]                  the oldest policy version whose KV the slot holds: the
                                 version of its prefill, kept when KV is put back (mode
                                 kv), renewed by a recompute. A token drawn by new params
                                 over old KV is not on-policy, and is not tagged as such.
  limit[s]                       the length at which the sample stops (prompt + budget)
  forced_end[s]                  tokens[s, length:forced_end] are given, not drawn (an
                                 environment's observation, or a resumed sample's tokens
                                 whose KV it lacks): each decode step takes the next one
                                 as its output, with logprob 0, and feeds it on, so the
                                 slot's KV grows over them in place; a given token never
                                 stops the slot
  rng[s]                         the sample's own key; the token at position t is drawn
                                 with fold_in(rng, t), so a sample's draws do not depend
                                 on its slot, its neighbours or on interruptions
  done[s]                        no decoding: finished, or the slot is free
  group[s]                       the prompt group of the sample it holds or held last
                                 (-1: none): a speculative decode call drafts from its
                                 group's rows (drafts.py)
  routes[s, t]                   a Qwen3-MoE model's experts at position t in every
                                 sparse layer, [Ls, k] uint8, as the forward pass that
                                 wrote t's KV chose them (the prefill's, a decode step's,
                                 a feed's): the host reads back those it lacks (routing
                                 replay, docs/moe.md). [S, M, 0, 1] for a dense model.
Slots and pool pages are sharded over the batch axes of the sampler's rules
(sharding.DECODE_RULES: `data`), KV heads over its tensor-parallel axes, so each device
holds the KV of its own heads for its own slots, in its own pages.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from april_jax.models import qwen3


@flax.struct.dataclass
class SlotState:
  tokens: jax.Array  # int32 [S, M]
  logprobs: jax.Array  # float32 [S, M]
  versions: jax.Array  # int32 [S, M]
  kv: qwen3.KVCache  # the page pool: k, v [L, P, K, page, H], as qwen3.kv_storage_dtype
  page_table: jax.Array  # int32 [S, J]: local page ids, -1 unused
  length: jax.Array  # int32 [S]
  prompt_len: jax.Array  # int32 [S]
  kv_version: jax.Array  # int32 [S]
  limit: jax.Array  # int32 [S]
  forced_end: jax.Array  # int32 [S]
  temperature: jax.Array  # float32 [S]; 0 = greedy
  top_k: jax.Array  # int32 [S]; 0 = off
  top_p: jax.Array  # float32 [S]; 1 = off
  rng: jax.Array  # uint32 [S, 2], raw threefry key data (typed where it is used: plain
  # arrays cost nothing to rebuild on the host after each device call)
  done: jax.Array  # bool [S]
  group: jax.Array  # int32 [S]; -1 = no group
  routes: jax.Array  # uint8 [S, M, Ls, k]


@flax.struct.dataclass
class SlotRows:
  """W slots' rows as `insert` writes them (the SlotState fields of W slots but KV and
  done): rows.unpack of the PackedRows that rows.rows_from_records builds on the host."""

  tokens: jax.Array  # int32 [W, M]
  logprobs: jax.Array  # float32 [W, M]
  versions: jax.Array  # int32 [W, M]
  length: jax.Array  # int32 [W]
  prompt_len: jax.Array  # int32 [W]
  kv_version: jax.Array  # int32 [W]
  limit: jax.Array  # int32 [W]
  forced_end: jax.Array  # int32 [W]
  temperature: jax.Array  # float32 [W]
  top_k: jax.Array  # int32 [W]
  top_p: jax.Array  # float32 [W]
  rng: jax.Array  # uint32 [W, 2], raw key data
  group: jax.Array  # int32 [W]


def init_state(
    cfg: qwen3.Qwen3Config,
    num_slots: int,
    max_len: int,
    kv_dtype=jnp.float32,
    page_size: int = 16,
    pool_pages: int | None = None,
) -> SlotState:
  """All slots free (done), no pages held, the pool zeroed. pool_pages counts every
  page of the pool, scratch pages included (default: one slot's worth per slot, + 1)."""
  S, M = num_slots, max_len
  J = -(-M // page_size)
  pool_pages = S * J + 1 if pool_pages is None else pool_pages
  kv_shape = (cfg.num_layers, pool_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
  zeros_i = lambda *shape: jnp.zeros(shape, jnp.int32)
  return SlotState(
      tokens=zeros_i(S, M),
      logprobs=jnp.zeros((S, M), jnp.float32),
      versions=jnp.full((S, M), -1, jnp.int32),
      kv=qwen3.KVCache(*(jnp.zeros(kv_shape, qwen3.kv_storage_dtype(kv_dtype)) for _ in range(2))),
      page_table=jnp.full((S, J), -1, jnp.int32),
      length=zeros_i(S),
      prompt_len=zeros_i(S),
      kv_version=zeros_i(S),
      limit=zeros_i(S),
      forced_end=zeros_i(S),
      temperature=jnp.zeros((S,), jnp.float32),
      top_k=zeros_i(S),
      top_p=jnp.ones((S,), jnp.float32),
      rng=jnp.zeros((S, 2), jnp.uint32),
      done=jnp.ones((S,), bool),
      group=jnp.full((S,), -1, jnp.int32),
      routes=jnp.zeros((S, M) + cfg.route_shape, jnp.uint8),
  )


def state_logical_axes() -> SlotState:
  """Logical axis names of every SlotState field (see sharding.py)."""
  row = ("batch", "seq")
  vec = ("batch",)
  return SlotState(
      tokens=row,
      logprobs=row,
      versions=row,
      kv=qwen3.KVCache(qwen3.KV_LOGICAL_AXES, qwen3.KV_LOGICAL_AXES),
      page_table=row,
      length=vec,
      prompt_len=vec,
      kv_version=vec,
      limit=vec,
      forced_end=vec,
      temperature=vec,
      top_k=vec,
      top_p=vec,
      rng=("batch", None),
      done=vec,
      group=vec,
      routes=("batch", "seq", None, None),
  )


def record_routes(routes_SxMxLsxK, experts_BxTxLsxK, positions_BxT, live_BxT, slots_B=None):
  """routes with each live (row, t)'s experts written at its slot's position (rows are
  the slots themselves, or slots_B[b]; other entries unchanged). A dense model's routes
  are empty: nothing to write."""
  if routes_SxMxLsxK.shape[2] == 0:
    return routes_SxMxLsxK
  S, M = routes_SxMxLsxK.shape[:2]
  B = positions_BxT.shape[0]
  slots = jnp.arange(B) if slots_B is None else slots_B
  rows = jnp.where(live_BxT, slots[:, None], S)  # out of range: dropped
  at = jnp.minimum(positions_BxT, M - 1)
  return routes_SxMxLsxK.at[rows, at].set(experts_BxTxLsxK.astype(jnp.uint8), mode="drop")
