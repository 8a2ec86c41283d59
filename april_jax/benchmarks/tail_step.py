"""A decode step at a long-tailed mix of slot lengths against a uniform mix of the same
live tokens (part of mode `sampler`).

Both mixes fill the same slots with greedy samples that run to their budget (no stop
token). One decode step's cost is the difference of two runs that decode `n1` and `n2`
tokens (prefill and admission cancel), divided by n2 - n1. The long-tailed mix is
`slots - 1` short prompts and one long one; the uniform mix gives every slot the same
prompt length, the mean of the tailed mix, so both hold the same live tokens at every
step. Both run on the same engine (slots of the long prompt's length, the same pool),
in rounds that time both mixes back to back; the ratio is the median of the rounds'
ratios, so a machine whose speed drifts between rounds does not bias it. With attention
over each slot's own pages the ratio is about 1; an engine that reads every slot up to
the longest one pays for slots x the longest length.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from april_jax import sampler
from april_jax.models import qwen3


def _engine(cfg, params, num_slots: int, max_len: int, page_size: int, decode_attention: str):
  config = sampler.EngineConfig(
      num_slots=num_slots,
      max_len=max_len,
      sync_every=64,
      page_size=page_size,
      decode_attention=decode_attention,
  )
  return sampler.SlotEngine(cfg, params, config)


def _decode_seconds(engine, prompts, new_tokens: int) -> float:
  """Seconds to decode `new_tokens` greedy tokens in every slot (after admission)."""
  keys = sampler.sample_keys(0, len(prompts))
  for i, p in enumerate(prompts):
    engine.admit(
        [sampler.SampleRecord(prompt=p, max_new_tokens=new_tokens, rng=keys[i], temperature=0.0)]
    )
  jax.block_until_ready(engine.state)
  start = time.perf_counter()
  while engine.num_live:
    engine.step(refill=False)
  jax.block_until_ready(engine.state)
  return time.perf_counter() - start


def step_seconds(
    cfg,
    params,
    mixes: dict,
    n1: int,
    n2: int,
    repeats: int,
    page_size: int,
    max_len: int,
    decode_attention: str = "auto",
) -> dict:
  """Seconds per decode step of each mix of prompt lengths, (t(n2) - t(n1)) / (n2 - n1),
  one value per round, on one engine of slots of max_len (every mix the same pool).

  Each round times every mix back to back at n1, then every mix at n2, in an order that
  turns round by round, so a machine whose speed drifts over minutes shifts the mixes of
  a round alike and their ratio within the round stays fair."""
  rng = np.random.default_rng(0)
  prompts = {
      name: [rng.integers(1, cfg.vocab_size, n).astype(np.int32) for n in lens]
      for name, lens in mixes.items()
  }
  slots = len(next(iter(prompts.values())))
  engine = _engine(cfg, params, slots, max_len, page_size, decode_attention)
  # Compiles, and writes every slot's KV memory once: memory never written reads as the
  # operating system's shared zero page, nearly free on a CPU, which would hide what an
  # engine reads past the live tokens.
  full = [rng.integers(1, cfg.vocab_size, max_len - n2).astype(np.int32) for _ in range(slots)]
  _decode_seconds(engine, full, n2)
  names = list(prompts)
  for name in names:
    _decode_seconds(engine, prompts[name], n2)
  out = {name: [] for name in names}
  for round_ in range(repeats):
    order = names[round_ % len(names) :] + names[: round_ % len(names)]
    t = {(name, n): _decode_seconds(engine, prompts[name], n) for n in (n1, n2) for name in order}
    for name in names:
      out[name].append((t[name, n2] - t[name, n1]) / (n2 - n1))
  return out


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
    decode_attention: str = "auto",
) -> dict:
  """The long-tailed and the uniform mix's step times (each round's, and their medians),
  and their ratio: the median of the rounds' ratios (not the ratio of the medians), with
  the lowest and highest. decode_attention: how the engine's decode step reads the pool."""
  params = qwen3.init_params(cfg, jax.random.key(seed), std=0.1, dtype=jnp.float32)
  tailed = [short] * (slots - 1) + [long]
  uniform = [sum(tailed) // slots] * slots
  steps = step_seconds(
      cfg,
      params,
      {"tail": tailed, "uniform": uniform},
      n1,
      n2,
      repeats,
      page_size,
      long + n2,
      decode_attention,
  )
  ratios = np.array(steps["tail"]) / np.array(steps["uniform"])
  return {
      "tail_prompt_lens": f"{slots - 1} x {short} + 1 x {long}",
      "uniform_prompt_lens": f"{slots} x {uniform[0]}",
      "tail_step_ms": 1e3 * float(np.median(steps["tail"])),
      "uniform_step_ms": 1e3 * float(np.median(steps["uniform"])),
      "tail_over_uniform": float(np.median(ratios)),
      "tail_over_uniform_min": float(ratios.min()),
      "tail_over_uniform_max": float(ratios.max()),
      "rounds": repeats,
      "decode_attention": decode_attention,
      "tail_step_ms_rounds": [1e3 * x for x in steps["tail"]],
      "uniform_step_ms_rounds": [1e3 * x for x in steps["uniform"]],
  }
