"""The Pallas decode-attention kernel (run by Pallas' interpreter on the CPU) equals the XLA
path, its reference, for random page layouts and lengths: page boundaries, an empty slot,
a one-token slot, a full pool, float32 and bfloat16 pages, a slot's blocks cut into runs
over several programs; its work plan walks every live block once in runs no longer than
the live tokens ask, whatever the longest slot; it reads nothing past a slot's length
and nothing its table does not list; its sums follow the slots' lengths, not which pages
they hold; it lowers for Triton on
CUDA and ROCm at the 8B config's shapes; and "auto" picks it on NVIDIA GPUs only."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.models import paged_attention as pa
from april_jax.models import paged_attention_kernel as pk
from april_jax.models import qwen3


def _case(past, page=16, pages=None, seed=0, bf16=False, G=3):
  """Random pool, queries and new keys; tables give each slot shuffled pages."""
  rng = np.random.default_rng(seed)
  L, K, H = 2, 2, 32
  past = np.asarray(past, np.int32)
  need = -(-past // page)
  P = int(need.sum()) + 1 if pages is None else pages  # + 1: the engine's scratch page
  J = max(int(need.max()), 1)
  ids = list(rng.permutation(P - 1))
  table = np.full((len(past), J), -1, np.int32)
  for s, n in enumerate(need):
    table[s, :n] = [ids.pop() for _ in range(n)]
  dtype = jnp.bfloat16 if bf16 else jnp.float32
  values = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
  store = lambda x: qwen3.kv_store(x, jnp.uint16 if bf16 else jnp.float32)
  S = len(past)
  return dict(
      q_SxKxGxH=values(S, K, G, H).astype(jnp.float32),
      k_new_SxKxH=values(S, K, H),
      v_new_SxKxH=values(S, K, H),
      pool_k_LxPxKxTxH=store(values(L, P, K, page, H)),
      pool_v_LxPxKxTxH=store(values(L, P, K, page, H)),
      layer=jnp.int32(1),
      past_S=jnp.asarray(past),
      table_SxJ=jnp.asarray(table),
  )


def _xla(case, chunk_pages=2):
  return pa.paged_decode_attention(**case, chunk_pages=chunk_pages, view=qwen3.kv_view)


def _kernel(case, runs=4):
  """The kernel, the live blocks cut into four runs (a slot's blocks over several)."""
  return pk.paged_decode_attention(**case, view=qwen3.kv_view, runs=runs)


@pytest.mark.parametrize(
    "past",
    [
        [0, 1, 15, 16, 17, 48],  # empty slot, one token, either side of page boundaries
        [5, 33, 2, 64],
        [0, 0, 0],  # nothing cached: each slot sees its new key alone
        [17, 0, 40, 0],  # the last slot empty: idle programs read its max
    ],
)
def test_kernel_equals_the_xla_path_float32(past):
  case = _case(past, seed=len(past))
  np.testing.assert_allclose(_kernel(case), _xla(case), rtol=2e-5, atol=2e-6)


def test_pages_longer_than_a_block_are_read_a_block_at_a_time_to_the_length():
  """Pages of 128 positions read 64 at a time: lengths either side of block and page
  boundaries, with garbage past each length that must not be read."""
  case = _case([1, 63, 64, 65, 128, 129, 300], page=128, seed=9)
  want = _xla(case)
  np.testing.assert_allclose(_kernel(case), want, rtol=2e-5, atol=2e-6)
  pool_k, pool_v = np.array(case["pool_k_LxPxKxTxH"]), np.array(case["pool_v_LxPxKxTxH"])
  table, past = np.asarray(case["table_SxJ"]), np.asarray(case["past_S"])
  for s, n in enumerate(past):
    if n % 128:
      pool_k[1, table[s, n // 128], :, n % 128 :] = np.nan  # a block past the length: unread
      pool_v[1, table[s, n // 128], :, n % 128 :] = np.nan
      pool_k[1, table[s, n // 128], :, n % 128 :][:, : -(n % 64) % 64] = 1e4  # same block: masked
      pool_v[1, table[s, n // 128], :, n % 128 :][:, : -(n % 64) % 64] = -1e4
  garbage = dict(case, pool_k_LxPxKxTxH=jnp.asarray(pool_k), pool_v_LxPxKxTxH=jnp.asarray(pool_v))
  np.testing.assert_array_equal(_kernel(garbage), _kernel(case))


@pytest.mark.parametrize("runs", [None, 1, 3, 7, 200])
def test_runs_of_any_length_compute_the_same_attention(runs):
  """The live blocks cut into 1 to 200 runs (None: the interpreter's default; a slot in
  one run, or spread over many, runs that end inside a page, idle programs) merge to the
  XLA path's attention."""
  case = _case([0, 1, 17, 48, 100, 33], seed=5)
  got = pk.paged_decode_attention(**case, view=qwen3.kv_view, runs=runs)
  np.testing.assert_allclose(got, _xla(case), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("runs", [1, 5, 128])
def test_work_plan_covers_every_live_block_once_in_runs_the_longest_slot_does_not_set(runs):
  """Each slot's blocks, in order, exactly once; at most S + runs programs; and no run
  longer than ceil(total / runs), so one long slot among short ones leaves the longest
  run as long as a uniform mix of the same live blocks gets."""
  tailed = np.array([64] * 15 + [3968] + [0, 1], np.int32)  # the long-tail bench, and edges
  rng = np.random.default_rng(runs)
  cases = [(tailed, 16), (np.full(18, tailed.sum() // 18, np.int32), 16), (tailed, 64)]
  cases += [(rng.integers(0, 3000, 40).astype(np.int32) * rng.integers(0, 2, 40), 64)]
  for past, block in cases:
    plan = jax.tree.map(np.asarray, pk.plan_work(jnp.asarray(past), block, runs))
    assert plan.slot_W.shape == (len(past) + runs,)
    blocks = -(-past // block)
    longest = -(-blocks.sum() // runs)
    assert (plan.end_W - plan.first_W).max() == min(longest, blocks.max())
    for s, n in enumerate(blocks):
      mine = plan.slot_W == s
      walked = np.concatenate(
          [np.arange(f, e) for f, e in zip(plan.first_W[mine], plan.end_W[mine])] + [[]]
      )
      np.testing.assert_array_equal(walked, np.arange(n))
    idle = plan.slot_W == len(past)
    assert (plan.first_W[idle] == plan.end_W[idle]).all()
    assert (np.diff(plan.slot_W) >= 0).all()  # a slot's runs are consecutive


@pytest.mark.parametrize(
    "past, runs, bf16",
    [
        ([0, 1, 15, 16, 17, 48], 4, False),  # empty, one token, page boundaries, split slots
        ([17, 0, 40, 0], 200, False),  # idle programs; the last slot has no runs
        ([0, 0, 0], None, False),  # nothing cached: each slot's new key alone
        ([0, 1, 17, 48, 100, 33], 1, False),  # one run holds every block
        ([16, 31, 47, 64, 1], 7, True),  # bfloat16 pages of a full pool
    ],
)
def test_runs_merged_per_slot_equal_the_xla_path(past, runs, bf16):
  """Each slot's runs, merged with its new key, give the XLA path's attention to
  rounding, whatever the runs (idle programs, one run, none cached)."""
  case = _case(past, seed=len(past), bf16=bf16, G=4 if bf16 else 3)
  f32 = lambda x: np.asarray(x.astype(jnp.float32))
  got = f32(_kernel(case, runs))
  tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(got, f32(_xla(case)), **tol)
  assert np.isfinite(got).all()


def test_kernel_equals_the_xla_path_on_bfloat16_pages_of_a_full_pool():
  case = _case([16, 31, 47, 64, 1], seed=7, bf16=True, G=4)
  assert case["pool_k_LxPxKxTxH"].dtype == jnp.uint16  # bfloat16 as stored
  used = int((np.asarray(case["table_SxJ"]) >= 0).sum())
  assert used == case["pool_k_LxPxKxTxH"].shape[1] - 1  # every usable page is in use
  got, want = (np.asarray(x.astype(jnp.float32)) for x in (_kernel(case), _xla(case)))
  assert got.dtype == want.dtype and np.isfinite(got).all()
  # Both round p and the output to bfloat16, in different orders of summation.
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
  assert np.mean(np.abs(got - want)) < 2e-3


def test_kernel_reads_nothing_past_a_length_or_off_the_table():
  case = _case([3, 20, 0, 33], seed=3, pages=12)
  want = _kernel(case)
  pool_k, pool_v = np.array(case["pool_k_LxPxKxTxH"]), np.array(case["pool_v_LxPxKxTxH"])
  table, past = np.asarray(case["table_SxJ"]), np.asarray(case["past_S"])
  listed = set(table[table >= 0].tolist())
  for p in range(pool_k.shape[1]):
    if p not in listed:  # pages no table lists, every layer
      pool_k[:, p], pool_v[:, p] = 1e4, -1e4
  for s, n in enumerate(past):  # positions past each slot's length in its last page
    if n % 16:
      pool_k[1, table[s, n // 16], :, n % 16 :] = 1e4
      pool_v[1, table[s, n // 16], :, n % 16 :] = -1e4
  pool_k[0], pool_v[0] = 1e4, -1e4  # another layer
  garbage = dict(case, pool_k_LxPxKxTxH=jnp.asarray(pool_k), pool_v_LxPxKxTxH=jnp.asarray(pool_v))
  np.testing.assert_array_equal(_kernel(garbage), want)


@pytest.mark.parametrize("runs", [3, 40])
def test_a_nan_in_one_slots_kv_stays_in_that_slot(runs):
  """A slot whose live keys hold a NaN comes out NaN; every other slot, including those
  whose runs merge beside its runs, is what it was without the NaN."""
  case = _case([20, 37, 5, 33], seed=13)
  want = np.asarray(_kernel(case, runs=runs))
  pool_k = np.array(case["pool_k_LxPxKxTxH"])
  pool_k[1, np.asarray(case["table_SxJ"])[1, 1], :, 3] = np.nan  # slot 1, position 19
  got = np.asarray(_kernel(dict(case, pool_k_LxPxKxTxH=jnp.asarray(pool_k)), runs=runs))
  assert np.isnan(got[1]).all()
  np.testing.assert_array_equal(np.delete(got, 1, axis=0), np.delete(want, 1, axis=0))


def test_kernel_sums_in_page_order_whatever_pages_a_slot_holds():
  """The same sequences in other physical pages give the same bits (resume exactness)."""
  case = _case([40, 7, 16], seed=11)
  pool_k, pool_v = np.asarray(case["pool_k_LxPxKxTxH"]), np.asarray(case["pool_v_LxPxKxTxH"])
  table = np.asarray(case["table_SxJ"])
  P = pool_k.shape[1]
  move = np.random.default_rng(0).permutation(P)  # page p now lives at move[p]
  moved_k, moved_v = np.empty_like(pool_k), np.empty_like(pool_v)
  moved_k[:, move], moved_v[:, move] = pool_k, pool_v
  moved = dict(
      case,
      pool_k_LxPxKxTxH=jnp.asarray(moved_k),
      pool_v_LxPxKxTxH=jnp.asarray(moved_v),
      table_SxJ=jnp.asarray(np.where(table >= 0, move[np.maximum(table, 0)], -1)),
  )
  np.testing.assert_array_equal(_kernel(moved), _kernel(case))


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_kernel_lowers_for_triton_at_the_8b_shapes(platform):
  """One device's shapes of configs/qwen3_8b.py's decode (tensor parallel over 8: one KV
  head of 128, 4 queries per KV head), bfloat16 pages of 256 stored as uint16, lowered
  for NVIDIA (CUDA) and AMD (ROCm) GPUs. Lowering needs no GPU; compiling the Triton programs does, and
  is left to launch/bench_gpu.sh (NVIDIA; never yet on AMD)."""
  S, K, G, H, L, P, T, J = 256, 1, 4, 128, 36, 4353, 256, 68
  sds = jax.ShapeDtypeStruct
  fn = jax.jit(functools.partial(pk.paged_decode_attention, view=qwen3.kv_view, interpret=False))
  lowered = fn.trace(
      sds((S, K, G, H), jnp.float32),
      sds((S, K, H), jnp.bfloat16),
      sds((S, K, H), jnp.bfloat16),
      sds((L, P, K, T, H), jnp.uint16),
      sds((L, P, K, T, H), jnp.uint16),
      sds((), jnp.int32),
      sds((S,), jnp.int32),
      sds((S, J), jnp.int32),
  ).lower(lowering_platforms=(platform,))
  text = lowered.as_text()
  assert "triton" in text and "paged_decode_attention" in text
  gathers = [line for line in text.splitlines() if "stablehlo.gather" in line]
  assert not [g for g in gathers if f"x{P}x" in g]  # the pool is read by the kernel alone


@pytest.mark.parametrize("G", [1, 4, 24])
def test_any_query_heads_per_kv_head_lower_padded_to_a_power_of_two(G):
  """Triton tiles powers of two: 24 query heads a KV head are padded to 32 rows, 1 or 4
  to 16, and the kernel lowers for CUDA."""
  S, K, H, L, P, T, J = 4, 2, 64, 2, 9, 16, 3
  assert pk.query_rows(G) == {1: 16, 4: 16, 24: 32}[G]
  sds = jax.ShapeDtypeStruct
  fn = jax.jit(functools.partial(pk.paged_decode_attention, interpret=False))
  args = [sds((S, K, G, H), jnp.float32), sds((S, K, H), jnp.float32)]
  args += [sds((S, K, H), jnp.float32), sds((L, P, K, T, H), jnp.float32)]
  args += [sds((L, P, K, T, H), jnp.float32), sds((), jnp.int32), sds((S,), jnp.int32)]
  text = fn.trace(*args, sds((S, J), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  assert "triton" in text and "paged_decode_attention" in text


def test_shapes_a_gpu_kernel_cannot_tile_are_refused_by_name():
  case = _case([5, 9], seed=1)
  case["pool_k_LxPxKxTxH"] = case["pool_k_LxPxKxTxH"][..., :24]
  case["pool_v_LxPxKxTxH"] = case["pool_v_LxPxKxTxH"][..., :24]
  case["q_SxKxGxH"] = case["q_SxKxGxH"][..., :24]
  with pytest.raises(ValueError, match="page_size 16 and head_dim 24"):
    pk.paged_decode_attention(**case, view=qwen3.kv_view, interpret=False)


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
def test_generate_through_the_kernel_equals_the_xla_path_with_refills_and_preemption(mesh_shape):
  """Six prompts through four slots (refills) and a pool of ten pages of 8 per slot shard
  (preemption, then restore): sampled at temperature 0.7, the kernel's run draws the same
  tokens, with the same logprobs up to rounding, as the XLA path's; on one device, and
  per device on a mesh that splits the slots in two (ten pages each)."""
  from april_jax import sampler  # pylint: disable=g-import-not-at-top
  from conftest import mesh_or_skip, tiny_qwen3  # pylint: disable=g-import-not-at-top

  mesh = mesh_or_skip(mesh_shape)
  cfg = tiny_qwen3(vocab_size=128, head_dim=16)
  params = qwen3.init_params(cfg, jax.random.key(0), std=0.35)
  if mesh is not None:
    params = jax.device_put(params, qwen3.param_shardings(cfg, mesh))
  rng = np.random.default_rng(7)
  prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (5, 9, 3, 12, 7, 4)]
  kw = dict(max_new_tokens=40, num_slots=4, max_len=64, temperature=0.7, seed=3, page_size=8)
  kw.update(kv_pages=10 * (1 if mesh is None else 2), return_records=True, sync_every=8)
  kw.update(mesh=mesh)
  xla = sampler.generate(cfg, params, prompts, **kw)
  kernel = sampler.generate(cfg, params, prompts, decode_attention="pallas", **kw)
  assert [r.response.tolist() for r in kernel] == [r.response.tolist() for r in xla]
  assert all(len(r.response) == 40 for r in kernel)
  np.testing.assert_allclose(
      np.concatenate([r.logprobs for r in kernel]),
      np.concatenate([r.logprobs for r in xla]),
      rtol=1e-5,
      atol=1e-5,
  )


def test_decode_attention_is_checked_by_name():
  from april_jax.sampler.engine_config import EngineConfig  # pylint: disable=g-import-not-at-top

  with pytest.raises(ValueError, match="decode_attention must be one of"):
    EngineConfig(num_slots=2, max_len=32, decode_attention="triton")


@pytest.mark.parametrize(
    "platform, version, page, head_dim, want",
    [
        ("gpu", "cuda 12080", 256, 128, "pallas"),  # where the kernel is measured
        ("gpu", "rocm 60342", 256, 128, "xla"),  # untimed there
        ("cpu", "cpu", 256, 128, "xla"),  # it would only be interpreted
        ("gpu", "cuda 12080", 256, 96, "xla"),  # a head the kernel cannot tile
        ("gpu", "cuda 12080", 8, 128, "xla"),  # a page under a GPU product's 16
    ],
)
def test_auto_picks_the_kernel_on_nvidia_gpus_only(
    monkeypatch, platform, version, page, head_dim, want
):
  backend = type("Backend", (), {"platform": platform, "platform_version": version})()
  monkeypatch.setattr(jax.extend.backend, "get_backend", lambda: backend)
  assert pk.choose("auto", page, head_dim) == want
  assert pk.choose("xla", page, head_dim) == "xla"
  assert pk.choose("pallas", page, head_dim) == "pallas"
  # The run's log says which and why; an AMD GPU's line says how to try the kernel.
  line = pk.describe("auto", page, head_dim)
  assert line.startswith({"pallas": "the Pallas kernel (auto", "xla": "the XLA path (auto"}[want])
  assert ("rollout.decode_attention=pallas tries it" in line) == version.startswith("rocm")
  assert pk.describe("pallas", page, head_dim) == (
      "the Pallas kernel (rollout.decode_attention=pallas)"
  )


def test_auto_is_the_default_and_runs_the_xla_path_on_a_cpu():
  from april_jax.settings import base  # pylint: disable=g-import-not-at-top
  from april_jax.sampler.engine_config import EngineConfig  # pylint: disable=g-import-not-at-top

  assert EngineConfig(num_slots=2, max_len=32).decode_attention == "auto"
  assert base.get_config().rollout.decode_attention == "auto"
  if jax.default_backend() == "cpu":
    assert pk.choose("auto", 16, 128) == "xla"
