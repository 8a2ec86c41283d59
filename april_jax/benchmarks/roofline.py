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
"""

from __future__ import annotations

import numpy as np

from april_jax import plan as plan_lib
from april_jax import sharding
from april_jax.benchmarks import length_dists
from april_jax.models import hf_io


def _steady_lengths(rng, shape: str, prompt: int, max_resp: int, slots: int) -> np.ndarray:
  whole = length_dists.sample_lengths(shape, max_resp, 200_000, seed=int(rng.integers(1 << 30)))
  picked = rng.choice(whole, size=slots, p=whole / whole.sum())  # length-biased
  return prompt + np.floor(rng.uniform(size=slots) * picked).astype(np.int64) + 1


def run(config, devices: int = 8, shape: str = "dapo_math", prompt: int = 256, trials: int = 50):
  cfg = hf_io.model_config(config)
  r = config.rollout
  mesh_shape = sharding.resolve_mesh_shape(tuple(config.mesh.shape), devices)
  mesh = type("Mesh", (), {"shape": dict(zip(sharding.MESH_AXES, mesh_shape))})()
  rules = tuple(tuple(x) for x in config.mesh.decode_rules)
  kv_split = plan_lib._split(cfg.num_kv_heads, "kv_heads", mesh, rules)  # pylint: disable=protected-access
  per_token = plan_lib.kv_bytes_per_token(cfg, config.model.kv_dtype) / kv_split
  weights = plan_lib.params_bytes(cfg, mesh, rules, plan_lib.dtype_bytes(config.model.dtype))
  max_len = config.data.max_prompt_len + r.max_response_len
  usable, _ = plan_lib.pool_pages(config, mesh, rules)
  page = r.page_size
  dense_slots = usable * page // max_len  # what the same memory held at max_len
  rng = np.random.default_rng(0)
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
  a = np.array(rows, np.float64).mean(0)
  out = {
      "mode": "roofline",
      "shape": shape,
      "devices": devices,
      "live_slots": a[0],
      "live_bound_gb": a[1] / 1e9,
      "paged_gb": a[2] / 1e9,
      "paged_over_bound": a[2] / a[1],
      "dense_slots": a[3],
      "dense_gb": a[4] / 1e9,
      "dense_per_live_token_over_paged": (a[4] / a[3]) / (a[2] / a[0]),
      "sequences_per_gb_kv_paged": a[0] / (usable * page * per_token / 1e9),
      "sequences_per_gb_kv_dense": dense_slots / (usable * page * per_token / 1e9),
  }
  print(
      f"{shape} steady state, {devices} devices, per device and decode step:\n"
      f"  live bound  {out['live_bound_gb']:.3f} GB ({out['live_slots']:.0f} live slots)\n"
      f"  paged       {out['paged_gb']:.3f} GB = {out['paged_over_bound']:.3f}x the bound\n"
      f"  dense       {out['dense_gb']:.3f} GB for {dense_slots} slots: "
      f"{out['dense_per_live_token_over_paged']:.2f}x the paged bytes per sequence\n"
      f"  sequences per GB of KV: paged {out['sequences_per_gb_kv_paged']:.1f}, "
      f"dense {out['sequences_per_gb_kv_dense']:.1f}",
      flush=True,
  )
  return out
