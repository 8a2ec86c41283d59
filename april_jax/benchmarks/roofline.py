"""Mode `roofline`: the bytes one decode step reads at a config's real shapes, paged pool
against the dense slots before it, in APRIL's steady state (arithmetic, no weights).

Steady state with continuous refills: a live slot holds a sample whose whole length is
drawn length-biased from the distribution (a long sample stays live longer), and its
current length is uniform within it. Per device and step:
  live bound  decode params + the KV of the live positions (what the work needs)
  paged       decode params + every live slot's pages in whole pages, plus the last chunk
              of decode_block positions half read on average (paged_attention.py)
  dense       decode params + slots x the longest live length (the engine before the
              pool read every slot up to the longest one), at the slot count that the
              same memory held at max_len
The byte counts use the planner's own arithmetic (plan.py): decode params as sharded,
KV bytes per token over the KV-head shards.

Cross-check with the compiled program: one chunk of decode attention (the part that
reads the pool, paged_attention.page_partials) is compiled at one device's shapes on
this machine's backend, and its scratch memory is set against the chunk's KV bytes. A
ratio near 1 means the backend copies the gathered pages into a temporary before the
score and value products read them: the chunk's KV is then read, written and read
again, and the row `paged, gather copied` counts the step's KV bytes three times. A
ratio near 0 means the gather fused into its readers.

On an accelerator, one layer's decode attention at the steady state's lengths is also
timed through the XLA path and through the Pallas kernel that reads pages in place
(paged_attention_kernel.py), with the largest difference between their outputs.

Then the chunk is timed, with real arrays at the same per-device shapes: its pages
gathered from shuffled places in a pool eight chunks long (the engine's case), against
the same scoring of the same pages laid side by side in an array of their own, read in
place.
Each call takes the next chunk's pages, so no call finds its pages in a cache. Their
time ratio is what the gather costs on this backend, in seconds rather than bytes; the
chunk's KV bytes over its time, against the copy bandwidth measured in the same run,
say how near the memory bound the gathered chunk runs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from april_jax.planning import memory as plan_lib
from april_jax import sharding
from april_jax.benchmarks import common, length_dists
from april_jax.models import hf_io, paged_attention, paged_attention_kernel, qwen3
from april_jax.sampler import slot_ops
from april_jax.sampler.state import init_state


def _steady_lengths(rng, shape: str, prompt: int, max_resp: int, slots: int) -> np.ndarray:
  whole = length_dists.sample_lengths(shape, max_resp, 200_000, seed=int(rng.integers(1 << 30)))
  picked = rng.choice(whole, size=slots, p=whole / whole.sum())  # length-biased
  return prompt + np.floor(rng.uniform(size=slots) * picked).astype(np.int64) + 1


def compiled_chunk(config, cfg: qwen3.Qwen3Config, mesh, rules, timed: bool = True) -> dict:
  """One chunk of decode attention compiled at one device's shapes (its KV heads, its
  shard of slots and pages): the chunk's KV bytes and the program's scratch bytes; with
  `timed`, the chunk's time, its pages gathered against side by side (timed_chunk)."""
  r = config.rollout
  kv_heads = cfg.num_kv_heads // plan_lib._split(cfg.num_kv_heads, "kv_heads", mesh, rules)  # pylint: disable=protected-access
  slots = r.num_slots // plan_lib._split(r.num_slots, "batch", mesh, rules)  # pylint: disable=protected-access
  _, shard_pages = plan_lib.pool_pages(config, mesh, rules)
  chunk = slot_ops.chunk_pages_for(r.decode_block, r.page_size, shard_pages - 1)
  group = cfg.num_heads // cfg.num_kv_heads
  local = dataclasses.replace(cfg, num_kv_heads=kv_heads, num_heads=kv_heads * group)
  pool = jax.eval_shape(
      lambda: init_state(
          local, slots, r.page_size, jnp.dtype(config.model.kv_dtype), r.page_size, shard_pages
      )
  ).kv.k
  sds = jax.ShapeDtypeStruct
  i32 = lambda *shape: sds(shape, jnp.int32)
  attend = lambda q, k, v, layer, page, count: paged_attention.page_partials(
      q, k, v, layer, page, count, qwen3.kv_view
  )
  compiled = (
      jax.jit(attend)
      .lower(
          sds((chunk, kv_heads, group, cfg.head_dim), jnp.float32),
          pool,
          pool,
          i32(),
          i32(chunk),
          i32(chunk),
      )
      .compile()
  )
  value_bytes = jnp.dtype(qwen3.kv_view(jnp.zeros((), pool.dtype)).dtype).itemsize
  kv = 2 * chunk * kv_heads * r.page_size * cfg.head_dim * value_bytes
  out = {
      "chunk_pages": chunk,
      "chunk_kv_bytes": kv,
      "chunk_scratch_bytes": compiled.memory_analysis().temp_size_in_bytes,
      "backend": jax.default_backend(),
  }
  if timed:
    shape = (1, 8 * chunk) + pool.shape[2:]  # one layer, eight chunks of pages
    out.update(timed_chunk(shape, pool.dtype, (kv_heads, group, cfg.head_dim), chunk, kv))
  return out


def score_pages_by_reduction(q_CxKxGxH, k_CxKxTxH, v_CxKxTxH, count_C):
  """paged_attention.score_pages with its two products as multiply-and-sum in float32
  rather than dots: the same function (up to float32 rounding), in a form whose gather a
  backend may fuse into the reductions instead of copying it out for a dot. A candidate
  measured here; the engine uses score_pages."""
  T, H = k_CxKxTxH.shape[2], q_CxKxGxH.shape[-1]
  f32 = jnp.float32
  q = q_CxKxGxH.astype(k_CxKxTxH.dtype).astype(f32)
  s = jnp.sum(q[:, :, :, None, :] * k_CxKxTxH[:, :, None].astype(f32), axis=-1) * H**-0.5
  valid = (jnp.arange(T)[None, :] < count_C[:, None])[:, None, None, :]  # [C, 1, 1, T]
  s = jnp.where(valid, s, -1e30)
  m_c = jnp.max(s, axis=-1)  # [C, K, G]
  p = jnp.where(valid, jnp.exp(s - m_c[..., None]), 0.0)
  l_c = jnp.sum(p, axis=-1)
  p = p.astype(v_CxKxTxH.dtype).astype(f32)  # as score_pages rounds it for its product
  o_c = jnp.sum(p[..., None] * v_CxKxTxH[:, :, None].astype(f32), axis=3)
  return m_c, l_c, o_c


def timed_chunk(pool_shape, pool_dtype, q_shape, chunk: int, kv_bytes: int, calls: int = 40):
  """Microseconds per chunk of decode attention over a real pool of pool_shape
  [1, P, K, T, H] (random values), three ways; each call moves on to the next chunk's
  pages, so none finds them in a cache:
    gathered      page_partials, its pages gathered from shuffled places (the engine's)
    reduced       the same gather scored by score_pages_by_reduction (a candidate)
    side by side  score_pages on the same pages laid side by side in arrays of their own
                  (read in place: the time without the gather)
  Also each program's scratch bytes (near the chunk's KV: the gathered pages are copied),
  the gathered chunk's KV GB/s and its share of the copy bandwidth measured here."""
  rng = np.random.default_rng(0)
  P, T = pool_shape[1], pool_shape[3]
  assert P % chunk == 0, f"a pool of {P} pages is not whole chunks of {chunk}"
  k, v = (
      jax.random.normal(jax.random.key(i), pool_shape, jnp.float32).astype(pool_dtype)
      for i in (1, 2)
  )
  q = jnp.asarray(rng.standard_normal((chunk,) + q_shape), jnp.float32)
  count = jnp.full((chunk,), T, jnp.int32)  # every page full: the bytes counted are read
  order = jnp.asarray(rng.permutation(P).reshape(-1, chunk), jnp.int32)  # [P / chunk, chunk]

  def gathered_by(score):
    def chunk_of(q, k, v, i):
      pages = order[i % order.shape[0]]
      k_c, v_c = (qwen3.kv_view(x[0, pages]) for x in (k, v))
      return score(q, k_c, v_c, count)

    return jax.jit(chunk_of)

  # The same chunks' pages, each chunk its own arrays: arguments are read where they lie.
  as_chunks = lambda x: [qwen3.kv_view(x[0, pages]) for pages in np.asarray(order)]
  k_chunks, v_chunks = as_chunks(k), as_chunks(v)
  side_by_side = jax.jit(lambda q, k_c, v_c, i: paged_attention.score_pages(q, k_c, v_c, count))
  programs = {
      "gathered": (gathered_by(paged_attention.score_pages), lambda i: (q, k, v, i)),
      "reduced": (gathered_by(score_pages_by_reduction), lambda i: (q, k, v, i)),
      "side_by_side": (
          side_by_side,
          lambda i: (q, k_chunks[i % len(k_chunks)], v_chunks[i % len(v_chunks)], i),
      ),
  }
  out = {}
  for name, (fn, args) in programs.items():
    many = lambda fn=fn, args=args: jax.block_until_ready([fn(*args(i)) for i in range(calls)])
    many()  # compiles
    best, _ = common.best_of(3, many)
    out[f"chunk_{name}_us"] = 1e6 * best / calls
    compiled = fn.lower(*args(0)).compile()
    out[f"chunk_{name}_scratch_bytes"] = compiled.memory_analysis().temp_size_in_bytes
  copy = common.copy_gbps()
  gbps = kv_bytes / out["chunk_gathered_us"] / 1e3
  return {
      **out,
      "chunk_gather_time_ratio": out["chunk_gathered_us"] / out["chunk_side_by_side_us"],
      "chunk_reduced_time_ratio": out["chunk_reduced_us"] / out["chunk_side_by_side_us"],
      "chunk_gathered_gbps": gbps,
      "chunk_copy_gbps": copy,
      "chunk_gathered_copy_frac": gbps / copy,
  }


def _layer_page_table(lengths: np.ndarray, T: int, rng):
  """Each slot's pages, shuffled over a pool with one spare page: (pages each slot needs,
  the pool's page count P, the page table [slots, most pages], -1 past a slot's pages)."""
  need = -(-lengths // T)
  P = int(need.sum()) + 1
  ids = rng.permutation(P - 1)
  table = np.full((len(lengths), max(int(need.max()), 1)), -1, np.int32)
  ends = np.cumsum(need)
  for s, n in enumerate(need):
    table[s, :n] = ids[ends[s] - n : ends[s]]
  return need, P, table


def _layer_args(
    lengths: np.ndarray, table: np.ndarray, K: int, G: int, H: int, T: int, P: int, dtype
):
  """The arguments of one layer's decode attention (random values in `dtype`): queries,
  the new token's keys and values, a pool of P pages, layer 0, the lengths, the table."""
  S = len(lengths)
  key = lambda i: jax.random.key(i)
  values = lambda i, shape: jax.random.normal(key(i), shape, jnp.float32).astype(dtype)
  return (
      values(1, (S, K, G, H)).astype(jnp.float32),
      values(2, (S, K, H)),
      values(3, (S, K, H)),
      values(4, (1, P, K, T, H)),
      values(5, (1, P, K, T, H)),
      jnp.int32(0),
      jnp.asarray(lengths),
      jnp.asarray(table),
  )


def _layer_programs(chunk: int, wide: int, S: int, interpret) -> list:
  """(name, jitted program) of each way timed_layer runs one layer's decode attention:
  the XLA path at chunks of `chunk` and of `wide` pages, then LAYER_KERNELS' kernels."""
  xla = lambda pages: jax.jit(
      lambda *a: paged_attention.paged_decode_attention(*a, chunk_pages=pages, view=qwen3.kv_view)
  )
  kernel = lambda **kw: jax.jit(
      lambda *a: paged_attention_kernel.paged_decode_attention(
          *a, view=qwen3.kv_view, interpret=interpret, **kw
      )
  )
  kernels = {"kernel": kernel(), "kernel_mean_runs": kernel(runs=S)}
  return [("xla", xla(chunk)), ("xla_wide", xla(wide)), *kernels.items()]


def _time_layer_programs(programs, args, calls: int) -> tuple[dict, dict]:
  """Microseconds per call of each program (best of 3 after a compiling run), and its
  last output as float32; a program other than the XLA path's that fails is reported as
  layer_<name>_error instead."""
  out, outputs = {}, {}
  for name, fn in programs:
    many = lambda fn=fn: jax.block_until_ready([fn(*args) for _ in range(calls)])
    try:
      many()  # compiles
    except Exception as e:  # pylint: disable=broad-exception-caught
      if name == "xla":
        raise
      out[f"layer_{name}_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
      continue
    best, results = common.best_of(3, many)
    out[f"layer_{name}_us"] = 1e6 * best / calls
    outputs[name] = np.asarray(results[-1].astype(jnp.float32))
  return out, outputs


def _layer_comparisons(out: dict, outputs: dict, live: int) -> None:
  """Adds to `out` each timed program's KV GB/s and, for all but the XLA path, its time
  over the XLA path's and the largest difference between their outputs."""
  for name in outputs:
    out[f"layer_{name}_gbps"] = live / out[f"layer_{name}_us"] / 1e3
    if name != "xla":
      out[f"layer_{name}_over_xla"] = out[f"layer_{name}_us"] / out["layer_xla_us"]
      diff = np.max(np.abs(outputs["xla"] - outputs[name]))
      out[f"layer_{name}_max_abs_diff"] = float(diff)


def timed_layer(
    lengths,
    K: int,
    G: int,
    H: int,
    T: int,
    dtype,
    calls: int = 20,
    interpret=None,
    decode_block: int = 1024,
):
  """One layer's decode attention for slots of these cached lengths, each in its own
  shuffled pages of a real pool (random values), through the XLA path (chunks of
  decode_block positions, the config's rollout.decode_block, and of 4x as many: does its
  time follow its loop trips or its bytes; it lists the live pages in each call, where
  the engine lists them once a step for every layer) and through the kernel
  (paged_attention_kernel) as the
  engine runs it ("kernel") and as a candidate: the live blocks cut into S runs, so a
  slot no longer than the mean walks in one program ("kernel_mean_runs"). Microseconds per
  call, each one's KV GB/s (the live bytes over its time), and the largest difference
  between each kernel's output and the XLA path's, which checks the kernel as this
  backend compiled it. A kernel this backend cannot build or run is reported
  (layer_<name>_error) beside the others' numbers, rather than ending the mode before
  its other results print."""
  rng = np.random.default_rng(1)
  lengths = np.asarray(lengths, np.int32)
  need, P, table = _layer_page_table(lengths, T, rng)
  S = len(lengths)
  args = _layer_args(lengths, table, K, G, H, T, P, dtype)
  chunk = slot_ops.chunk_pages_for(decode_block, T, P - 1)
  wide = slot_ops.chunk_pages_for(4 * decode_block, T, P - 1)
  out, outputs = _time_layer_programs(_layer_programs(chunk, wide, S, interpret), args, calls)
  live = 2 * int(lengths.sum()) * K * H * jnp.dtype(dtype).itemsize
  out.update(layer_slots=S, layer_live_kv_bytes=live)
  for name, pages in (("xla", chunk), ("xla_wide", wide)):
    out[f"layer_{name}_chunk_pages"] = pages
    out[f"layer_{name}_chunks"] = -(-int(need.sum()) // pages)  # loop trips a call takes
  _layer_comparisons(out, outputs, live)
  return out


LAYER_KERNELS = {  # timed_layer's kernels, as its lines name them
    "kernel": "kernel (the engine's)",
    "kernel_mean_runs": "the same, live blocks in S runs",
}


def layer_lines(out: dict) -> list[str]:
  """timed_layer's results as lines: the XLA path, then each kernel's time against it,
  or why this backend could not run it."""
  if "layer_xla_us" not in out:
    return []
  lines = [
      f"  one layer, {out['layer_slots']} slots at this steady state "
      f"({out['layer_live_kv_bytes'] / 1e6:.0f} MB of live KV): XLA path "
      f"{out['layer_xla_us']:.0f} us ({out['layer_xla_gbps']:.0f} GB/s; "
      f"{out['layer_xla_chunks']} chunks of {out['layer_xla_chunk_pages']} pages)"
  ]
  if "layer_xla_wide_us" in out:
    lines.append(
        f"    XLA path, chunks of {out['layer_xla_wide_chunk_pages']} pages "
        f"({out['layer_xla_wide_chunks']} chunks): {out['layer_xla_wide_us']:.0f} us, "
        f"{out['layer_xla_wide_over_xla']:.3f}x the config's chunk's time"
    )
  for name, label in LAYER_KERNELS.items():
    if f"layer_{name}_error" in out:
      lines.append(f"    {label}: failed here: {out[f'layer_{name}_error']}")
    elif f"layer_{name}_us" in out:
      lines.append(
          f"    {label}: {out[f'layer_{name}_us']:.0f} us ({out[f'layer_{name}_gbps']:.0f} "
          f"GB/s), {out[f'layer_{name}_over_xla']:.3f}x the XLA path's time; outputs differ "
          f"by at most {out[f'layer_{name}_max_abs_diff']:.2g}"
      )
  return lines


def kernel_plan(lengths, page: int, kv_heads: int, group: int, head_dim: int) -> dict:
  """How the decode kernel cuts one step at these lengths (its GPU default, arithmetic):
  its programs, the busy ones, the blocks the longest and the mean busy program walk (a
  step waits for the longest), against the longest slot's blocks (what one program a
  slot would walk), and the bytes of the runs' partial results."""
  block = min(paged_attention_kernel.BLOCK, page)
  runs = paged_attention_kernel.default_runs(len(lengths), kv_heads, interpret=False)
  plan = paged_attention_kernel.plan_work(jnp.asarray(lengths, jnp.int32), block, runs)
  walk = np.asarray(plan.end_W - plan.first_W)
  return {
      "kernel_programs": int(walk.size * kv_heads),
      "kernel_busy_programs": int((walk > 0).sum() * kv_heads),
      "kernel_longest_walk_blocks": int(walk.max()),
      "kernel_mean_walk_blocks": float(walk[walk > 0].mean()) if walk.any() else 0.0,
      "kernel_longest_slot_blocks": int(-(-np.max(lengths) // block)),
      "kernel_block": block,
      # m, l and o of every program, float32, a row per padded query
      "kernel_partials_bytes": int(
          walk.size * kv_heads * paged_attention_kernel.query_rows(group) * (2 + head_dim) * 4
      ),
  }


def _planning_mesh(config, devices: int):
  """A stand-in for the decode mesh of `devices` devices (its axis sizes, all the
  planner reads) and the config's decode sharding rules."""
  mesh_shape = sharding.resolve_mesh_shape(tuple(config.mesh.shape), devices)
  mesh = type("Mesh", (), {"shape": dict(zip(sharding.MESH_AXES, mesh_shape))})()
  rules = tuple(tuple(x) for x in config.mesh.decode_rules)
  return mesh, rules


def _steady_state_bytes(
    rng, r, shape: str, prompt: int, trials: int, usable: int, per_token, weights, dense_slots
):
  """Over `trials` draws of the steady state: the mean (live slots, live bound bytes,
  paged bytes, dense slots, dense bytes) per device and step, and the last trial's live
  lengths."""
  page = r.page_size
  rows = []
  for _ in range(trials):
    # As many live slots as the pool holds at steady state (at most num_slots).
    lengths = _steady_lengths(rng, shape, prompt, r.max_response_len, r.num_slots)
    pages = -(-lengths // page)
    fits = np.cumsum(pages) <= usable
    lengths, pages = lengths[fits], pages[fits]
    live = lengths.sum() * per_token
    paged = (pages.sum() * page + max(r.decode_block, page) / 2) * per_token
    dense_live = _steady_lengths(rng, shape, prompt, r.max_response_len, dense_slots)
    dense = dense_slots * dense_live.max() * per_token
    rows.append((len(lengths), weights + live, weights + paged, dense_slots, weights + dense))
  return np.array(rows, np.float64).mean(0), lengths


def _kernel_step(cfg, lengths, page: int, kv_heads: int, per_token, weights) -> dict:
  """kernel_plan at these lengths, and what a step through the kernel reads: kernel_gb
  and kernel_over_bound (over these lengths' live bound)."""
  group = cfg.num_heads // cfg.num_kv_heads
  plan = kernel_plan(lengths, page, kv_heads, group, cfg.head_dim)
  # What a step through the kernel reads at the last trial's lengths: the weights, each
  # slot's KV to its last whole block, and every layer's partial results written and read.
  block = plan["kernel_block"]
  kernel_kv = (-(-lengths // block) * block).sum() * per_token
  kernel = weights + kernel_kv + 2 * cfg.num_layers * plan["kernel_partials_bytes"]
  return dict(
      plan, kernel_gb=kernel / 1e9, kernel_over_bound=kernel / (weights + lengths.sum() * per_token)
  )


def _roofline_summary(
    shape: str, devices: int, weights, a, dense_slots, kv_gb: float, chunk: dict
) -> dict:
  """The mode's result: the steady state's mean bytes `a` (from _steady_state_bytes)
  against each other, per sequence over kv_gb (the pool's KV GB), and `chunk`'s numbers."""
  copied = weights + 3 * (a[2] - weights)  # the pages read, the copy written and read
  return {
      "mode": "roofline",
      "shape": shape,
      "devices": devices,
      "decode_params_gb": weights / 1e9,
      "live_slots": a[0],
      "live_bound_gb": a[1] / 1e9,
      "paged_gb": a[2] / 1e9,
      "paged_over_bound": a[2] / a[1],
      "dense_slots": a[3],
      "dense_gb": a[4] / 1e9,
      "dense_per_live_token_over_paged": (a[4] / a[3]) / (a[2] / a[0]),
      "sequences_per_gb_kv_paged": a[0] / kv_gb,
      "sequences_per_gb_kv_dense": dense_slots / kv_gb,
      **chunk,
      "chunk_scratch_over_kv": chunk["chunk_scratch_bytes"] / chunk["chunk_kv_bytes"],
      "paged_copied_gb": copied / 1e9,
      "paged_copied_over_bound": copied / a[1],
  }


def _print_steady_state(out: dict, shape: str, devices: int, dense_slots) -> None:
  """The steady state's bytes per device and decode step, the compiled chunk's scratch
  and the kernel's plan, as lines."""
  print(
      f"{shape} steady state, {devices} devices, per device and decode step:\n"
      f"  live bound  {out['live_bound_gb']:.3f} GB ({out['live_slots']:.0f} live slots)\n"
      f"  paged       {out['paged_gb']:.3f} GB = {out['paged_over_bound']:.3f}x the bound\n"
      f"  dense       {out['dense_gb']:.3f} GB for {dense_slots} slots: "
      f"{out['dense_per_live_token_over_paged']:.2f}x the paged bytes per sequence\n"
      f"  sequences per GB of KV: paged {out['sequences_per_gb_kv_paged']:.1f}, "
      f"dense {out['sequences_per_gb_kv_dense']:.1f}\n"
      f"  compiled ({out['backend']}): a chunk of {out['chunk_pages']} pages holds "
      f"{out['chunk_kv_bytes'] / 1e6:.1f} MB of KV; its program's scratch is "
      f"{out['chunk_scratch_bytes'] / 1e6:.1f} MB ({out['chunk_scratch_over_kv']:.2f}x)\n"
      f"  paged, gather copied  {out['paged_copied_gb']:.3f} GB = "
      f"{out['paged_copied_over_bound']:.3f}x the bound (if the backend copies each "
      "chunk's pages, as a scratch near 1x says)\n"
      f"  the kernel at the last trial's lengths: {out['kernel_busy_programs']} of "
      f"{out['kernel_programs']} programs busy, the longest walking "
      f"{out['kernel_longest_walk_blocks']} blocks of {out['kernel_block']} (mean "
      f"{out['kernel_mean_walk_blocks']:.1f}; the longest slot holds "
      f"{out['kernel_longest_slot_blocks']}); partial results "
      f"{out['kernel_partials_bytes'] / 1e6:.1f} MB a layer; a step through it reads "
      f"{out['kernel_gb']:.3f} GB = {out['kernel_over_bound']:.3f}x those lengths' bound",
      flush=True,
  )


def _print_timed_chunk(out: dict) -> None:
  """The timed chunk's line (timed_chunk's numbers), when it was timed."""
  if "chunk_gathered_us" in out:
    mb = lambda name: out[f"chunk_{name}_scratch_bytes"] / 1e6
    print(
        f"  timed ({out['backend']}), us a chunk (scratch MB): pages gathered "
        f"{out['chunk_gathered_us']:.1f} ({mb('gathered'):.1f}); gathered, by multiply-and-sum "
        f"{out['chunk_reduced_us']:.1f} ({mb('reduced'):.1f}); the same pages side by side "
        f"{out['chunk_side_by_side_us']:.1f} ({mb('side_by_side'):.1f}). Gathered over side by "
        f"side {out['chunk_gather_time_ratio']:.2f}x, by multiply-and-sum "
        f"{out['chunk_reduced_time_ratio']:.2f}x; gathered, {out['chunk_gathered_gbps']:.0f} "
        f"GB/s of KV = {out['chunk_gathered_copy_frac']:.0%} of the copy bandwidth measured "
        f"here ({out['chunk_copy_gbps']:.0f} GB/s)",
        flush=True,
    )


def run(
    config,
    devices: int = 8,
    shape: str = "dapo_math",
    prompt: int = 256,
    trials: int = 50,
    timed: bool = True,
):
  """The mode: bytes per device and decode step at the config's shapes on `devices`
  devices, over `trials` draws of the `shape` distribution's steady state; with `timed`,
  the chunk (and on an accelerator one layer) timed too. Prints and returns the numbers."""
  cfg = hf_io.model_config(config)
  r = config.rollout
  mesh, rules = _planning_mesh(config, devices)
  kv_split = plan_lib._split(cfg.num_kv_heads, "kv_heads", mesh, rules)  # pylint: disable=protected-access
  per_token = plan_lib.kv_bytes_per_token(cfg, config.model.kv_dtype) / kv_split
  weights = plan_lib.params_bytes(cfg, mesh, rules, plan_lib.dtype_bytes(config.model.dtype))
  max_len = config.data.max_prompt_len + r.max_response_len
  usable, _ = plan_lib.pool_pages(config, mesh, rules)
  page = r.page_size
  dense_slots = usable * page // max_len  # what the same memory held at max_len
  rng = np.random.default_rng(0)
  a, lengths = _steady_state_bytes(
      rng, r, shape, prompt, trials, usable, per_token, weights, dense_slots
  )
  chunk = compiled_chunk(config, cfg, mesh, rules, timed)
  kv_heads = cfg.num_kv_heads // kv_split
  chunk.update(_kernel_step(cfg, lengths, page, kv_heads, per_token, weights))
  if timed and jax.default_backend() != "cpu":  # a CPU only interprets the kernel
    # One device's heads (as compiled_chunk) at the last trial's lengths: XLA vs kernel.
    group = cfg.num_heads // cfg.num_kv_heads
    value = jnp.dtype(config.model.kv_dtype)
    chunk.update(
        timed_layer(
            lengths, kv_heads, group, cfg.head_dim, page, value, decode_block=r.decode_block
        )
    )
  kv_gb = usable * page * per_token / 1e9
  out = _roofline_summary(shape, devices, weights, a, dense_slots, kv_gb, chunk)
  _print_steady_state(out, shape, devices, dense_slots)
  for line in layer_lines(out):
    print(line, flush=True)
  _print_timed_chunk(out)
  return out
