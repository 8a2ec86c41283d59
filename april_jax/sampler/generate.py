"""`generate`: batch generation on the slot engine, for evaluation and for users.

More prompts than slots is the normal case: finished slots are refilled from the queue
at once, and prompts that start together share prefill calls. Every sequence decodes as
it would alone (greedy, same params), up to the float rounding of a shared prefill.
"""

from __future__ import annotations

import collections
import dataclasses
from itertools import islice
from typing import Sequence

import numpy as np

from april_jax import sharding
from april_jax.models import qwen3
from april_jax.sampler.contract import Engine
from april_jax.sampler.engine import EngineConfig, SlotEngine
from april_jax.sampler.records import PromptError, SampleRecord


def sample_keys(seed: int | Sequence[int], n: int) -> np.ndarray:
  """n independent per-sample keys (raw threefry key data, uint32 [n, 2]) from one seed.

  Drawn on the host: any uint32 pair is a valid threefry key, and no device program
  is compiled for each new n.
  """
  return np.random.default_rng(seed).integers(0, 2**32, (n, 2), dtype=np.uint32)


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def generate(
    cfg: qwen3.Qwen3Config,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 64,
    num_slots: int = 8,
    eos_ids: Sequence[int] = (),
    max_len: int | None = None,
    mesh=None,
    rules=sharding.DECODE_RULES,
    **options,
):
  """Generates a response for every prompt; returns them in prompt order.

  Each response is a list of token ids, ending with the stop token when one of
  `eos_ids` was produced. `options` are generate_on's (temperature, top_p, top_k, seed,
  return_records, on_invalid) and the engine's (EngineConfig: sync_every, kv_dtype,
  page_size, kv_pages, decode_attention, ...). A slot holds `max_len` tokens (default:
  the longest prompt and max_new_tokens, rounded up to 16). The slots' KV lives in a
  pool of `kv_pages` pages of `page_size` positions (default: room for every slot at
  max_len); with fewer, slots are preempted when it runs out and continued later, so
  the responses are the same.
  """
  if not prompts:
    return []
  longest = max(len(p) for p in prompts)
  max_len = max_len or _round_up(longest + max_new_tokens, 16)
  engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
  config = EngineConfig(
      num_slots=num_slots,
      max_len=max_len,
      stop_ids=tuple(int(e) for e in eos_ids),
      **{k: v for k, v in options.items() if k in engine_names},
  )
  engine = SlotEngine(cfg, params, config, mesh=mesh, rules=rules)
  rest = {k: v for k, v in options.items() if k not in engine_names}
  return generate_on(engine, prompts, max_new_tokens=max_new_tokens, **rest)


def generate_on(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    return_records: bool = False,
    on_invalid: str = "raise",
    episodes=None,
    rows: Sequence[dict] | None = None,
):
  """`generate` on an existing, empty engine (its policy, slots and stop tokens): the
  trainer evaluates on the run's own engine instead of allocating a second KV cache.
  With return_records, the SampleRecords (behaviour logprobs, versions, finish reasons)
  instead of the responses' tokens. A prompt that is empty or leaves no room for
  max_new_tokens in a slot raises PromptError naming it; with on_invalid="skip" it is
  rejected instead (status REJECTED, an empty response, the reason in `error`).
  On an engine that holds stopped slots (hold_stopped), each prompt is an episode of
  `episodes` (an envs.EpisodeRunner; rows[i] the row its environment resets from); with
  none, a stopped slot simply finishes."""
  if on_invalid not in ("raise", "skip"):
    raise ValueError(f"on_invalid must be 'raise' or 'skip', got {on_invalid!r}")
  if engine.num_live:
    raise RuntimeError("generate_on needs an empty engine")
  keys = sample_keys(seed, len(prompts))
  sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
  records = [
      SampleRecord(prompt=np.asarray(p, np.int32), rng=keys[i], index=i, **sampling)
      for i, p in enumerate(prompts)
  ]
  if episodes is not None:  # first: reset may give a sample its prompt (its messages)
    episodes.start(records, [dict(rows[r.index]) if rows else {} for r in records])
  queue = collections.deque(_checked(engine, records, on_invalid))
  _drive(engine, queue, episodes)
  if return_records:
    return records
  return [r.response.tolist() for r in records]


def _checked(engine: Engine, records: list[SampleRecord], on_invalid: str):
  """The records the engine can run; the others raise PromptError naming their prompt,
  or (on_invalid="skip") are rejected."""
  for record in records:
    try:
      engine.check(record)
    except PromptError as e:
      if on_invalid == "raise":
        raise PromptError(f"prompt {record.index}: {e}") from None
      record.reject(str(e))
      continue
    yield record


def _drive(engine: Engine, queue: collections.deque, episodes) -> None:
  """Runs the queue's samples to the end on the engine: as many start as slots and
  pages allow, in order (fresh prompts prefilled together, preempted samples continued
  first), then a decode call; held turns go to `episodes`, or finish."""
  while queue or engine.num_live:
    engine.admit(
        [queue.popleft() for _ in range(engine.room_for(list(islice(queue, engine.num_free))))]
    )
    finished = engine.step(refill=bool(queue))
    if episodes is not None:  # held turns answered: episodes go on or end
      finished = episodes.resolve(engine, finished)
    for record in finished:
      if engine.holds(record):  # held at a stop with no episodes to answer it
        engine.release(record)
    queue.extendleft(reversed(engine.take_preempted()))
