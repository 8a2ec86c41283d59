"""A decode step at a long-tailed mix of slot lengths against a uniform mix of the same
live tokens (part of mode `sampler`).

Both mixes fill the same slots with greedy samples that run to their budget (no stop
token). One decode step's cost is the difference of two runs that decode `n1` and `n2`
tokens (prefill and admission cancel), divided by n2 - n1. The long-tailed mix is
`slots - 1` short prompts and one long one; the uniform mix gives every slot the same
prompt length, the mean of the tailed mix, so both hold the same live tokens at every
step. Both run on the same engine (slots of the long prompt's length, the same pool). With attention over each slot's own pages the ratio is about 1; an engine that
reads every slot up to the longest one pays for slots x the longest length.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from april_jax import sampler
from april_jax.models import qwen3


def _engine(cfg, params, num_slots: int, max_len: int, page_size: int):
  config = sampler.EngineConfig(
      num_slots=num_slots, max_len=max_len, sync_every=64, page_size=page_size
  )
  return sampler.SlotEngine(cfg, params, config)


def _decode_seconds(engine, prompts, new_tokens: int) -> float:
  """Seconds to decode `new_tokens` greedy tokens in every slot (after admission)."""
  keys = sampler.sample_keys(0, len(prompts))
  for i, p in enumerate(prompts):
    engine.add_group(
        [sampler.SampleRecord(prompt=p, max_new_tokens=new_tokens, rng=keys[i], temperature=0.0)]
    )
  jax.block_until_ready(engine.state)
  start = time.perf_counter()
  while engine.num_live:
    engine.step(refill=False)
  jax.block_until_ready(engine.state)
  return time.perf_counter() - start


def step_seconds(
    cfg, params, prompt_lens, n1: int, n2: int, repeats: int, page_size: int, max_len: int
):
  """Best-of seconds per decode step at these prompt lengths: (t(n2) - t(n1)) / (n2 - n1),
  on an engine of slots of max_len (both mixes get the same engine, so the same pool)."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, cfg.vocab_size, n).astype(np.int32) for n in prompt_lens]
  engine = _engine(cfg, params, len(prompts), max_len, page_size)
  # Compiles, and writes every slot's KV memory once: memory never written reads as the
  # operating system's shared zero page, nearly free on a CPU, which would hide what an
  # engine reads past the live tokens.
  full = [rng.integers(1, cfg.vocab_size, max_len - n2).astype(np.int32) for _ in prompts]
  _decode_seconds(engine, full, n2)
  _decode_seconds(engine, prompts, n2)
  best = {n1: float("inf"), n2: float("inf")}
  for _ in range(repeats):
    for n in (n1, n2):
      best[n] = min(best[n], _decode_seconds(engine, prompts, n))
  return (best[n2] - best[n1]) / (n2 - n1)


def run(
    cfg: qwen3.Qwen3Config,
    slots: int = 16,
    short: int = 64,
    long: int = 3968,
    n1: int = 16,
    n2: int = 80,
    repeats: int = 3,
    page_size: int = 16,
    seed: int = 0,
) -> dict:
  """The long-tailed and the uniform mix's step times, and their ratio."""
  params = qwen3.init_params(cfg, jax.random.key(seed), std=0.1, dtype=jnp.float32)
  tailed = [short] * (slots - 1) + [long]
  uniform = [sum(tailed) // slots] * slots
  max_len = long + n2
  tail_s = step_seconds(cfg, params, tailed, n1, n2, repeats, page_size, max_len)
  uniform_s = step_seconds(cfg, params, uniform, n1, n2, repeats, page_size, max_len)
  return {
      "tail_prompt_lens": f"{slots - 1} x {short} + 1 x {long}",
      "uniform_prompt_lens": f"{slots} x {uniform[0]}",
      "tail_step_ms": 1e3 * tail_s,
      "uniform_step_ms": 1e3 * uniform_s,
      "tail_over_uniform": tail_s / uniform_s,
  }
