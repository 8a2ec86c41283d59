"""What a host round trip adds to decoding (part of mode `sampler`).

The same live slots decode the same greedy steps twice: one decode step per
`SlotEngine.step` call, and `sync_every` steps per call. Per decode step, the
difference is what each round trip costs on top of the device's work: the call's
dispatch, reading back the slots' done flags and lengths, and the host's bookkeeping.
Nothing finishes during the timed steps (every budget outlasts them), so no slot's rows
are read back and no refill runs. The two settings alternate in short rounds and the
round trip is the median of the rounds' differences: on a machine whose speed swings by
more than the round trip costs, a difference of two separate runs would not resolve it.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from april_jax import sampler
from april_jax.benchmarks import common


def _step_seconds(engine, prompts, keys, skip: int, steps: int, budget: int) -> float:
  """Seconds per decode step over `steps` steps of every slot, after `skip` untimed ones
  (the same for both settings, so that both time the same positions)."""
  common.add_greedy_groups(engine, prompts, keys, budget)
  begin = engine.counters.decode_steps
  while engine.counters.decode_steps - begin < skip:
    engine.step(refill=False)
  jax.block_until_ready(engine.state)
  first, start = engine.counters.decode_steps, time.perf_counter()
  while engine.counters.decode_steps - first < steps:
    engine.step(refill=False)
  jax.block_until_ready(engine.state)
  seconds = (time.perf_counter() - start) / (engine.counters.decode_steps - first)
  engine.snapshot(with_kv=False)
  return seconds


def run(cfg, params, prompts, sync_every: int, kv_dtype: str, rounds: int = 16, steps: int = 32):
  """Microseconds per decode step at one step per call and at sync_every per call, and
  the round trip's cost per call. Each round times `steps` steps both ways back to back;
  the results are the medians over the rounds (the round trip: of the rounds'
  differences), so a machine whose speed drifts between rounds does not bias them."""
  steps = -(-steps // sync_every) * sync_every  # whole calls at sync_every
  budget = steps + 2 * sync_every + 1  # no slot finishes while timed
  keys = sampler.sample_keys(0, len(prompts))
  engines = {
      n: common.greedy_engine(cfg, params, prompts, budget, n, kv_dtype) for n in (1, sync_every)
  }
  for n, engine in engines.items():  # compiles what the rounds run, and nothing else
    _step_seconds(engine, prompts, keys, n, n, budget)
  times = {n: [] for n in engines}
  for _ in range(max(rounds, 1)):
    for n, engine in engines.items():
      times[n].append(_step_seconds(engine, prompts, keys, sync_every, steps, budget))
  one, many = np.array(times[1]), np.array(times[sync_every])
  return {
      "step_us_one_per_call": 1e6 * float(np.median(one)),
      "step_us": 1e6 * float(np.median(many)),
      "round_trip_us": 1e6 * float(np.median(one - many)),
      "sync_every": sync_every,
  }
