"""Ragged decode attention as one Pallas kernel that reads each page where it lies.

paged_attention.paged_decode_attention, the XLA path, gathers a chunk of pages and then
scores it; XLA writes the gathered pages out before the products read them
(BENCHMARKS.md), so a step may move its KV three times. This kernel
computes the same function with no gather.

The work is cut by the live tokens, not by slot. plan_work cuts the step's live blocks
(BLOCK positions of a slot's pages) into runs of equal length, R blocks, each slot's own
blocks separately; program (w, k) of a grid over runs and KV heads walks run w's blocks
of its slot through the page table, loads each block of head k straight from the pool,
no further than the slot's length, scores it against the slot's G queries and keeps an
online softmax (max, sum, weighted values). The runs then merge per slot in XLA
(split-K flash decoding: one-hot products over the runs), and the slot's new key opens
the softmax, as on the XLA path.
Nothing is copied, nothing past a slot's length is read, and no program walks more than
R blocks: a long slot is spread over as many programs as its length asks, so a
long-tailed mix of lengths costs what a uniform mix of the same live tokens costs (runs
of a fixed width per slot would hold a step to its longest slot's walk).

Pallas lowers it for Triton: run on NVIDIA GPUs; for AMD GPUs its lowering is checked,
but it has not been compiled or run on one. On the CPU it runs in Pallas' interpret
mode: slow, for tests, which hold it to the XLA path as its reference. The order of the
sums is fixed by the slots' lengths (R and the runs follow from them), whatever pages
they hold, so a resumed run equals the uninterrupted one bit for bit here too.

Shapes: S slots, K kv heads, G query heads per kv head, H head dim, L layers, P pool
pages, T positions per page, J pages per slot (table width), W runs (programs per head).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

_NEG = -1e30  # as paged_attention: exp(_NEG - m) == 0, never NaN
MIN_ROWS = 16  # a GPU matrix product takes at least 16 rows: the G queries are padded
PROGRAMS = 1024  # runs x KV heads a step's live blocks are cut into, at least: SMs x ~8
INTERPRETED_RUNS = 16  # as few on a CPU, where each program is a trip of a loop
BLOCK = 64  # positions scored per loop step: a block of K and V, not a page, in fast memory


def query_rows(group: int) -> int:
  """The rows a program's queries are padded to: a power of two (Triton tiles those) of
  at least MIN_ROWS."""
  return max(MIN_ROWS, 1 << (group - 1).bit_length())


def default_runs(S: int, K: int, interpret: bool) -> int:
  """The runs a step's live blocks are cut into by default: enough for PROGRAMS programs
  (runs x K heads) and at least S, or INTERPRETED_RUNS when interpreted."""
  return max(S, INTERPRETED_RUNS if interpret else -(-PROGRAMS // K))


class WorkPlan(NamedTuple):
  """Program w's share of a decode step: blocks first_W[w] .. end_W[w] - 1 of slot
  slot_W[w] (S, and first == end, for a program with nothing to do). A slot's programs
  are consecutive and walk its blocks in order: slot s's are end_S[s - 1] .. end_S[s] - 1
  (from 0 for slot 0; none for a slot with nothing cached)."""

  slot_W: jax.Array
  first_W: jax.Array
  end_W: jax.Array
  end_S: jax.Array


def plan_work(past_S: jax.Array, block: int, runs: int) -> WorkPlan:
  """Cuts the step's live blocks (slot s holds ceil(past_S[s] / block)) into runs of
  R = ceil(total / runs) blocks, each slot's own blocks cut separately, one program a
  run: S + runs programs are always enough (a slot's last run may be short), and no
  program walks more than R blocks however long one slot is. R depends on the slots'
  lengths only, so the order of every slot's sums does too."""
  S = past_S.shape[0]
  blocks_S = (past_S.astype(jnp.int32) + block - 1) // block
  R = jnp.maximum(1, -(-jnp.sum(blocks_S) // runs))
  ends_S = jnp.cumsum(-(-blocks_S // R), dtype=jnp.int32)
  w = jnp.arange(S + runs, dtype=jnp.int32)
  slot_W = jnp.sum(ends_S[None, :] <= w[:, None], axis=1, dtype=jnp.int32)  # S: past the last
  begins_S = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_S])
  first_W = (w - begins_S[slot_W]) * R
  live = slot_W < S
  end_W = jnp.minimum(first_W + R, blocks_S[jnp.minimum(slot_W, S - 1)])
  return WorkPlan(slot_W, jnp.where(live, first_W, 0), jnp.where(live, end_W, 0), ends_S)


def _kernel(
    layer_ref,
    past_ref,
    slot_ref,
    first_ref,
    end_ref,
    table_ref,
    q_ref,
    pool_k_ref,
    pool_v_ref,
    m_ref,
    l_ref,
    o_ref,
    *,
    view,
    block,
):
  """Program (w, k): the plan's run w, blocks first .. end - 1 of its slot, KV head k,
  `block` positions at a time and no further than the slot's length; an online softmax
  over them."""
  w, k = pl.program_id(0), pl.program_id(1)
  S = past_ref.shape[0]
  s = jnp.minimum(slot_ref[w], S - 1)  # an idle program (slot S) walks nothing
  layer, past = layer_ref[0], past_ref[s]
  T, H = pool_k_ref.shape[3], pool_k_ref.shape[4]
  q = q_ref[s, k, :, :]  # [G', H] in the values' dtype
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
  first, end = first_ref[w], end_ref[w]
  m, l, o = jax.lax.fori_loop(first, jnp.maximum(end, first), step, init)
  m_ref[...], l_ref[...], o_ref[...] = m, l, o


def _run_partials(q_SxKxGxH, pool_k, pool_v, layer, past_S, table_SxJ, view, interpret, runs):
  """The kernel's programs over the step's plan: each run's online softmax, m, l
  [W, K, rows] and o [W, K, rows, H] (float32, padded query rows, o not divided by l),
  with the plan and the queries as the kernel read them ([S, K, rows, H], the pool's
  value dtype)."""
  S, K, G, H = q_SxKxGxH.shape
  dtype = view(pool_k[:0]).dtype
  rows = query_rows(G)
  q = jnp.pad(q_SxKxGxH.astype(dtype), ((0, 0), (0, 0), (0, rows - G), (0, 0)))
  T = pool_k.shape[3]
  if not interpret and not suits(T, H):
    raise ValueError(
        f"the decode-attention kernel cannot tile page_size {T} and head_dim {H} on a GPU: "
        "both must be powers of two of at least 16 (rollout.decode_attention='xla' takes any)"
    )
  block = min(BLOCK, T)
  plan = plan_work(past_S, block, default_runs(S, K, interpret) if runs is None else runs)
  W = plan.slot_W.shape[0]
  anywhere = pl.BlockSpec(memory_space=pl.ANY)
  per_run = lambda *tail: pl.BlockSpec(
      (None, None, rows) + tail, lambda w, k: (w, k, 0) + (0,) * len(tail)
  )
  m, l, o = pl.pallas_call(
      functools.partial(_kernel, view=view, block=block),
      out_shape=(
          jax.ShapeDtypeStruct((W, K, rows), jnp.float32),
          jax.ShapeDtypeStruct((W, K, rows), jnp.float32),
          jax.ShapeDtypeStruct((W, K, rows, H), jnp.float32),
      ),
      grid=(W, K),
      in_specs=[anywhere] * 9,
      out_specs=(per_run(), per_run(), per_run(H)),
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
      name="paged_decode_attention",
  )(
      jnp.reshape(layer, (1,)).astype(jnp.int32),
      past_S.astype(jnp.int32),
      plan.slot_W,
      plan.first_W,
      plan.end_W,
      table_SxJ.astype(jnp.int32),
      q,
      pool_k,
      pool_v,
  )
  return m, l, o, plan, q


def _interpret(interpret: bool | None) -> bool:
  """None: Pallas' interpreter on the CPU only."""
  return jax.default_backend() == "cpu" if interpret is None else interpret


def cached_partials(
    q_SxKxGxH,
    pool_k_LxPxKxTxH,
    pool_v_LxPxKxTxH,
    layer,
    past_S,
    table_SxJ,
    view=lambda x: x,
    interpret: bool | None = None,
    runs: int | None = None,
):
  """Each slot's online softmax over its first past_S[s] pooled positions: m, l [S, K, G]
  and o [S, K, G, H] (float32, o not yet divided by l). A slot with past 0 gets m = _NEG,
  l = 0, o = 0. `interpret`: None runs Pallas' interpreter on the CPU only.
  runs: how many equal runs the step's live blocks are cut into (plan_work; None:
  default_runs). The runs merge in XLA."""
  S, K, G, H = q_SxKxGxH.shape
  interpret = _interpret(interpret)
  m, l, o, plan, _ = _run_partials(
      q_SxKxGxH, pool_k_LxPxKxTxH, pool_v_LxPxKxTxH, layer, past_S, table_SxJ, view, interpret, runs
  )
  # Merge each slot's runs (an idle run has m = _NEG, l = 0, o = 0): the max is exact in
  # any order; the sums go through a one-hot matrix, so no scatter adds in an order that
  # varies run to run. A run that is not finite (its slot's KV holds a NaN or an inf)
  # enters the products as 0, since 0 x NaN would spread to every slot, and its own slot
  # comes out NaN.
  m, l, o = m[:, :, :G], l[:, :, :G], o[:, :, :G]
  m_all = jax.ops.segment_max(m, plan.slot_W, num_segments=S + 1, indices_are_sorted=True)
  m_all = jnp.maximum(m_all[:S], _NEG)  # [S, K, G]; a slot with no runs: _NEG
  w = jnp.exp(m - m_all[jnp.minimum(plan.slot_W, S - 1)])  # [W, K, G]
  wl, wo = w * l, w[..., None] * o
  finite_W = jnp.isfinite(wl) & jnp.all(jnp.isfinite(wo), axis=-1)
  bad = jax.ops.segment_max(
      (~finite_W).astype(jnp.int32), plan.slot_W, num_segments=S + 1, indices_are_sorted=True
  )
  bad_S = bad[:S] > 0  # [S, K, G]
  onehot_WxS = (plan.slot_W[:, None] == jnp.arange(S)[None, :]).astype(jnp.float32)
  merge = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
  l_all = merge("ws,wkg->skg", onehot_WxS, jnp.where(finite_W, wl, 0.0))
  o_all = merge("ws,wkgh->skgh", onehot_WxS, jnp.where(finite_W[..., None], wo, 0.0))
  return m_all, jnp.where(bad_S, jnp.nan, l_all), jnp.where(bad_S[..., None], jnp.nan, o_all)


def suits(page_size: int, head_dim: int) -> bool:
  """Whether a GPU can run the kernel at these shapes: Triton tiles powers of two, and
  its matrix products take at least 16 a side (a page's block, the head; the query rows
  are padded to a power of two of at least MIN_ROWS)."""
  return all(n >= 16 and not n & (n - 1) for n in (page_size, head_dim))


def choose(decode_attention: str, page_size: int, head_dim: int) -> str:
  """The decode attention to run: "auto" is the kernel on an NVIDIA GPU (CUDA) when the
  shapes suit it (where it is measured faster than the XLA path: BENCHMARKS.md), and the
  XLA path elsewhere (a CPU would only interpret the kernel; ROCm is untimed). "xla" and "pallas" are taken as given.
  """
  return _choice(decode_attention, page_size, head_dim)[0]


def describe(decode_attention: str, page_size: int, head_dim: int) -> str:
  """choose's answer and why, for the run's log: on an AMD GPU it says that the kernel
  is untested there, and how to try it."""
  choice, why = _choice(decode_attention, page_size, head_dim)
  name = {"pallas": "the Pallas kernel", "xla": "the XLA path"}[choice]
  return f"{name} ({why})"


def _choice(decode_attention: str, page_size: int, head_dim: int) -> tuple[str, str]:
  if decode_attention != "auto":
    return decode_attention, f"rollout.decode_attention={decode_attention}"
  backend = jax.extend.backend.get_backend()
  version = backend.platform_version.lower()
  if backend.platform != "gpu":
    return "xla", f"auto on {backend.platform}, where the kernel would only be interpreted"
  if not suits(page_size, head_dim):
    return "xla", (
        f"auto: the kernel cannot tile page_size {page_size} and head_dim {head_dim}, "
        "powers of two of at least 16"
    )
  if "cuda" in version:
    return "pallas", "auto on an NVIDIA GPU"
  return "xla", (
      "auto on a GPU other than NVIDIA's (ROCm), where the kernel is untested: it lowers "
      "for ROCm but has not been compiled or run on an AMD GPU; "
      "rollout.decode_attention=pallas tries it"
  )


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
    runs: int | None = None,
) -> jax.Array:
  """paged_attention.paged_decode_attention through the kernel: each slot's query over
  its first past_S[s] pooled positions and its own new key. [S, K, G, H] in the pool's
  value dtype. runs: as cached_partials (whose one-hot products merge each slot's runs),
  then the new key."""
  H = q_SxKxGxH.shape[-1]
  dtype = view(pool_k_LxPxKxTxH[:0]).dtype
  cached = (q_SxKxGxH, pool_k_LxPxKxTxH, pool_v_LxPxKxTxH, layer, past_S, table_SxJ, view)
  m_c, l_c, o_c = cached_partials(*cached, interpret, runs)
  q = q_SxKxGxH.astype(dtype)
  m0 = jnp.einsum("skgh,skh->skg", q, k_new_SxKxH.astype(dtype), preferred_element_type=jnp.float32)
  m0 = m0 * H**-0.5
  m = jnp.maximum(m0, m_c)
  own, cached = jnp.exp(m0 - m), jnp.exp(m_c - m)  # cached == 0 for a slot with past 0
  v_new = v_new_SxKxH.astype(jnp.float32)[:, :, None, :]
  o = own[..., None] * v_new + cached[..., None] * o_c
  return (o / (own + cached * l_c)[..., None]).astype(dtype)
