"""Ragged decode attention over the page pool equals dense attention over each slot's own
positions, for random page layouts and lengths: page boundaries, an empty slot, a one-
token slot, a full pool, chunks that straddle slots; and a decode step reads only the
live pages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.models import paged_attention as pa
from april_jax.sampler import pages as pages_lib
from april_jax.sampler.engine_config import EngineConfig


def _dense_reference(q_SxKxGxH, k_new, v_new, seq_k, seq_v, past):
  """Per slot: softmax over its first past[s] keys and its own new key, in numpy."""
  S, K, G, H = q_SxKxGxH.shape
  out = np.zeros((S, K, G, H), np.float64)
  for s in range(S):
    keys = np.concatenate([seq_k[s][: past[s]], k_new[s][None]], 0)  # [n, K, H]
    vals = np.concatenate([seq_v[s][: past[s]], v_new[s][None]], 0)
    scores = np.einsum("kgh,nkh->kgn", q_SxKxGxH[s], keys) / np.sqrt(H)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[s] = np.einsum("kgn,nkh->kgh", p, vals)
  return out


def _layout(past, page, num_pages, rng):
  """Random page tables: each slot takes the pages for its positions in shuffled order
  (the last pool page is scratch); returns table [S, J]."""
  J = max(pages_lib.pages_for(max(past), page), 1) + 1
  ids = list(rng.permutation(num_pages - 1))
  table = np.full((len(past), J), -1, np.int32)
  for s, n in enumerate(past):
    for j in range(pages_lib.pages_for(n, page)):
      table[s, j] = ids.pop()
  return table


def _case(past, page, num_pages, chunk_pages, seed, live=None, L=2, layer=1):
  rng = np.random.default_rng(seed)
  S, K, G, H = len(past), 2, 3, 8
  past = np.asarray(past, np.int32)
  live = np.ones(S, bool) if live is None else np.asarray(live)
  table = _layout(past, page, num_pages, rng)
  pool_k = rng.normal(size=(L, num_pages, K, page, H)).astype(np.float32)
  pool_v = rng.normal(size=(L, num_pages, K, page, H)).astype(np.float32)
  q = rng.normal(size=(S, K, G, H)).astype(np.float32)
  k_new = rng.normal(size=(S, K, H)).astype(np.float32)
  v_new = rng.normal(size=(S, K, H)).astype(np.float32)
  # Each slot's sequence as the pool holds it, through its own table.
  seq = lambda pool, s: np.concatenate(
      [pool[layer, p].transpose(1, 0, 2) for p in table[s] if p >= 0] or [np.zeros((0, K, H))]
  )
  past_eff = np.where(live, past, 0)
  want = _dense_reference(
      q,
      k_new,
      v_new,
      [seq(pool_k, s) for s in range(S)],
      [seq(pool_v, s) for s in range(S)],
      past_eff,
  )

  @jax.jit
  def run(q, k_new, v_new, pool_k, pool_v, table, past):
    out = pa.paged_decode_attention(
        q, k_new, v_new, pool_k, pool_v, layer, past, table, chunk_pages
    )
    return out, jnp.sum(pa.pages_read(past, page))

  got, num_live = run(q, k_new, v_new, pool_k, pool_v, table, past_eff)
  return np.asarray(got), want, int(num_live), table


@pytest.mark.parametrize("chunk_pages", [1, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_equals_dense_for_random_layouts_and_lengths(chunk_pages, seed):
  # Lengths on and off page boundaries (page 4), an empty slot, a one-token slot.
  past = [0, 1, 3, 4, 5, 8, 13, 16, 29]
  got, want, num_live, _ = _case(past, page=4, num_pages=40, chunk_pages=chunk_pages, seed=seed)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  assert num_live == sum(pages_lib.pages_for(n, 4) for n in past)


def test_paged_attention_with_a_full_pool_and_done_slots():
  page, past = 4, [12, 7, 9, 4]  # 3 + 2 + 3 + 1 = 9 pages: every usable page of the pool
  live = [True, False, True, True]
  got, want, num_live, table = _case(past, page, num_pages=10, chunk_pages=2, seed=3, live=live)
  assert sorted(table[table >= 0].tolist()) == list(range(9))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  assert num_live == 3 + 3 + 1  # the done slot's pages are not read


def test_chunk_pairs_number_each_slots_pages_in_slot_then_position_order():
  page = 4
  past = jnp.array([5, 0, 2, 9])  # 2, 0, 1 and 3 pages
  n = pa.pages_read(past, page)
  np.testing.assert_array_equal(n, [2, 0, 1, 3])
  ends = jnp.cumsum(n)
  slot, j = pa.chunk_pairs(jnp.int32(0), 8, ends)
  np.testing.assert_array_equal(slot, [0, 0, 2, 3, 3, 3, 4, 4])  # 4 = S: past the end
  np.testing.assert_array_equal(j[:6], [0, 1, 0, 0, 1, 2])
  slot, j = pa.chunk_pairs(jnp.int32(3), 3, ends)  # a chunk that starts inside slot 3
  np.testing.assert_array_equal(slot, [3, 3, 3])
  np.testing.assert_array_equal(j, [0, 1, 2])


def test_pages_past_a_slots_length_are_never_read():
  # Slot 0 holds 3 pages but has written 5 positions; the pool's other pages hold NaN.
  # A read of any page but the two it needs would turn its output into NaN.
  page, L, K, G, H = 4, 1, 1, 2, 4
  pool_k = np.full((L, 9, K, page, H), np.nan, np.float32)
  pool_v = pool_k.copy()
  rng = np.random.default_rng(0)
  for p in (5, 2):
    pool_k[0, p], pool_v[0, p] = rng.normal(size=(2, K, page, H))
  table = jnp.array([[5, 2, 7, -1], [0, -1, -1, -1]], jnp.int32)
  q = jnp.asarray(rng.normal(size=(2, K, G, H)), jnp.float32)
  kv_new = jnp.asarray(rng.normal(size=(2, K, H)), jnp.float32)
  out = pa.paged_decode_attention(
      q, kv_new, kv_new, jnp.asarray(pool_k), jnp.asarray(pool_v), 0, jnp.array([5, 0]), table, 2
  )
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(out[1], np.broadcast_to(kv_new[1][:, None], (K, G, H)), rtol=1e-6)


def test_write_pages_puts_each_live_slots_token_at_its_page_and_offset():
  L, P, K, T, H = 2, 6, 1, 4, 2
  pool = (jnp.zeros((L, P, K, T, H)), jnp.zeros((L, P, K, T, H)))
  table = jnp.array([[3, 1], [4, -1], [-1, -1]], jnp.int32)
  new = jnp.arange(L * 3 * K * H, dtype=jnp.float32).reshape(L, 3, K, H) + 1
  k, _ = pa.write_pages(
      pool, new, new, table, jnp.array([5, 2, 0]), jnp.array([True, True, False]), P - 1
  )
  np.testing.assert_array_equal(k[:, 1, :, 1], new[:, 0])  # position 5: page 1, entry 1
  np.testing.assert_array_equal(k[:, 4, :, 2], new[:, 1])  # position 2: page 4, entry 2
  np.testing.assert_array_equal(k[:, P - 1, :, 0], new[:, 2])  # a free slot: scratch
  assert int(jnp.count_nonzero(k[:, : P - 1])) == 2 * L * K * H


def test_a_chunk_is_never_wider_than_the_pool():
  # 4 slots of one 256-position page each and decode_block 32,768 (the 8B config's):
  # 128-page chunks would gather 124 pages of padding per layer and step. The decode
  # program's scratch memory stays within a few pools.
  from april_jax.models import qwen3  # pylint: disable=g-import-not-at-top
  from april_jax.sampler import slot_ops  # pylint: disable=g-import-not-at-top

  cfg = qwen3.Qwen3Config(
      vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
      num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
  )  # fmt: skip
  params = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.key(0)))
  settings = EngineConfig(num_slots=4, max_len=256, sync_every=1, decode_block=32768, page_size=256)
  fns = slot_ops.device_fns(cfg, settings.device_settings())
  state = jax.eval_shape(fns.init)
  i32 = jax.ShapeDtypeStruct((), jnp.int32)
  compiled = fns.decode.lower(
      params, state, i32, jax.ShapeDtypeStruct((1,), jnp.int32), i32, state.page_table
  ).compile()
  pool_bytes = 2 * state.kv.k.size * state.kv.k.dtype.itemsize  # 5 pages, k and v
  assert compiled.memory_analysis().temp_size_in_bytes < 3 * pool_bytes


def test_a_nan_in_one_slots_kv_stays_in_that_slot():
  """One chunk holds every slot's pages; a NaN in one slot's live keys makes that slot
  NaN and leaves every other slot's bits as they were."""
  rng = np.random.default_rng(5)
  page, num_pages, K, G, H = 4, 20, 2, 3, 8
  past = np.array([6, 9, 3, 7], np.int32)  # 2 + 3 + 1 + 2 pages: one chunk of 8
  table = _layout(past, page, num_pages, rng)
  pool_k = rng.normal(size=(2, num_pages, K, page, H)).astype(np.float32)
  pool_v = rng.normal(size=(2, num_pages, K, page, H)).astype(np.float32)
  q = rng.normal(size=(len(past), K, G, H)).astype(np.float32)
  k_new, v_new = rng.normal(size=(2, len(past), K, H)).astype(np.float32)
  fixed = [jnp.asarray(x) for x in (q, k_new, v_new)]
  rest = [jnp.asarray(x) for x in (pool_v, 1, past, table)]
  attend = jax.jit(lambda pool_k: pa.paged_decode_attention(*fixed, pool_k, *rest, 8))
  want = np.asarray(attend(pool_k))
  pool_k[1, table[1, 1], :, 0] = np.nan  # slot 1, position 4 of its 9
  got = np.asarray(attend(pool_k))
  assert np.isnan(got[1]).all()
  np.testing.assert_array_equal(np.delete(got, 1, axis=0), np.delete(want, 1, axis=0))
