"""Compiling every program an engine can call, before a run needs it.

Per length bucket: prefill and its insert (one prompt, and prefill_rows prompts where
that is more), the insert of restored KV, the KV extract and (hold_stopped, feed_given
"prefill") the feed of given tokens; then decode, mark_done, the row extract and the row
write (with speculation, the verify pass at each of its widths instead of decode; both
with speculative_auto). Each
runs on the engine's own state, as a no-op (no slot is named, so nothing is
written and no memory is spent on a second state), so the engine must be empty.
"""

from __future__ import annotations

import jax
import numpy as np

from april_jax.models import qwen3
from april_jax.sampler import feeding
from april_jax.sampler.speculation import decode as speculative


def warm_up(parts, stop_ids, lengths: list[int]) -> int:
  """Compiles the programs of every length bucket in `lengths`, then those of decoding;
  parts: engine_parts.EngineParts. Returns the number of buckets."""
  if parts.slots.num_live:
    raise RuntimeError("warm_up needs an empty engine")
  for b in lengths:
    _warm_bucket(parts, b)
  device, config, policy = parts.device, parts.config, parts.policy
  params, version = policy.params, policy.version
  table = parts.kv.table()
  if not config.speculative_tokens or config.speculative_auto:
    device.decode(params, version, stop_ids, 1, table, read=False)
  if config.speculative_tokens:  # each verify width, its slots padding (none runs)
    for width in speculative.widths(config.num_slots):
      device.decode(params, version, stop_ids, 1, table, read=False, speculate=[-1] * width)
  device.mark_done(np.zeros(config.num_slots, bool))
  no_slots = np.full(config.insert_width, -1, np.int32)
  jax.block_until_ready(device.fns.extract_rows(device.state, no_slots))
  device.write_rows([], [], [], [])  # no rows: compiles, writes nothing
  return len(lengths)


def _warm_bucket(parts, b: int) -> None:
  """Compiles the prefill, insert and KV programs of one length bucket."""
  cfg, config, device = parts.cfg, parts.config, parts.device
  W, Wr, table = config.insert_width, config.snapshot_width, parts.kv.table()
  params = parts.policy.params
  for rows in sorted({1, config.prefill_rows(b)}):
    kv = device.fns.prefill_kv(params, np.zeros((rows, b), np.int32))
    device.insert(kv, W, [], [], [], [], [], table)
  no_rows = np.full(Wr, -1, np.int32)
  jax.block_until_ready(device.fns.extract_kv(device.state, no_rows, b, table))
  if cfg.num_experts:  # the routes read back with a slot's tokens
    jax.block_until_ready(device.fns.extract_routes(device.state, np.full(W, -1, np.int32), b))
  zeros = np.zeros((cfg.num_layers, Wr, b, cfg.num_kv_heads, cfg.head_dim), config.kv_dtype)
  device.insert(device.on_device(qwen3.KVCache(zeros, zeros)), Wr, [], [], [], [], [], table)
  feeds = config.hold_stopped and config.feed_given == "prefill"
  if feeds and b <= parts.bucket(min(config.feed_len, config.max_len)):
    for rows in sorted({feeding.rows(n, W) for n in range(1, W + 1)}):
      none, zero = np.full(rows, -1, np.int32), np.zeros(rows, np.int32)
      device.feed(params, none, zero, b, table)
