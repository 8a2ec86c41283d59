"""`generate`: batch generation on the slot engine, for evaluation and for users.

More prompts than slots is the normal case: finished slots are refilled from the queue
at once, and prompts that start together share prefill calls. Every sequence decodes as
it would alone (greedy, same params), up to the float rounding of a shared prefill.
"""

from __future__ import annotations

import collections
from itertools import islice
from typing import Sequence

import numpy as np

from april_jax import sharding
from april_jax.models import qwen3
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
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_ids: Sequence[int] = (),
    seed: int = 0,
    sync_every: int = 16,
    max_len: int | None = None,
    mesh=None,
    rules=sharding.DECODE_RULES,
    return_records: bool = False,
    on_invalid: str = "raise",
    kv_dtype: str = "float32",
    page_size: int = 16,
    num_pages: int | None = None,
    decode_attention: str = "auto",
):
  """Generates a response for every prompt; returns them in prompt order.

  Each response is a list of token ids, ending with the stop token when one of
  `eos_ids` was produced. With return_records=True, returns the SampleRecords instead
  (behavior logprobs, versions, finish reasons). A prompt that is empty or leaves no
  room for max_new_tokens in a slot of `max_len` tokens raises PromptError naming it;
  with on_invalid="skip" it is rejected instead: an empty response, finish_reason
  "rejected" and the reason in meta["error"].

  The slots' KV lives in a pool of `num_pages` pages of `page_size` positions (default:
  room for every slot at max_len); with fewer, slots are preempted when it runs out and
  continued later, so the responses are the same. decode_attention: how a decode step
  reads the pool, "auto", "xla" or "pallas" (EngineConfig).
  """
  if not prompts:
    return []
  longest = max(len(p) for p in prompts)
  max_len = max_len or _round_up(longest + max_new_tokens, 16)
  config = EngineConfig(
      num_slots=num_slots,
      max_len=max_len,
      sync_every=sync_every,
      stop_ids=tuple(int(e) for e in eos_ids),
      kv_dtype=kv_dtype,
      page_size=page_size,
      num_pages=num_pages,
      decode_attention=decode_attention,
  )
  engine = SlotEngine(cfg, params, config, mesh=mesh, rules=rules)
  return generate_on(
      engine,
      prompts,
      max_new_tokens=max_new_tokens,
      temperature=temperature,
      top_p=top_p,
      top_k=top_k,
      seed=seed,
      return_records=return_records,
      on_invalid=on_invalid,
  )


def generate_on(
    engine: SlotEngine,
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
  """`generate` on an existing, empty engine (its params, slots and stop tokens): the
  trainer evaluates on the run's own engine instead of allocating a second KV cache.
  On an engine that holds stopped slots (hold_stopped), each prompt is an episode of
  `episodes` (an envs.EpisodeRunner; rows[i] the row its environment resets from); with
  none, a stopped slot simply finishes."""
  if on_invalid not in ("raise", "skip"):
    raise ValueError(f"on_invalid must be 'raise' or 'skip', got {on_invalid!r}")
  if engine.num_live:
    raise RuntimeError("generate_on needs an empty engine")
  keys = sample_keys(seed, len(prompts))
  queue = collections.deque()
  results: list[SampleRecord | None] = [None] * len(prompts)
  for i, prompt in enumerate(prompts):
    record = SampleRecord(
        prompt=np.asarray(prompt, np.int32),
        max_new_tokens=max_new_tokens,
        rng=keys[i],
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        meta={"index": i},
    )
    try:
      engine.check(record)
    except PromptError as e:
      if on_invalid == "raise":
        raise PromptError(f"prompt {i}: {e}") from None
      record.finish_reason, record.meta["error"] = "rejected", str(e)
      results[i] = record
      continue
    queue.append(record)
  if episodes is not None:
    episodes.start(list(queue), [dict(rows[r.meta["index"]]) if rows else {} for r in queue])

  while queue or engine.num_live:
    # As many as slots and pages allow, in order; the fresh ones' prompts are prefilled
    # together (add_groups), the preempted ones continued.
    starting = [
        queue.popleft() for _ in range(engine.room_for(list(islice(queue, engine.num_free))))
    ]
    for record in (r for r in starting if r.started):  # preempted for pages
      engine.add(record, engine.config.preempt_mode)
    engine.add_groups([[r] for r in starting if not r.started])
    finished = engine.step(refill=bool(queue))
    if episodes is not None:  # held turns answered: episodes go on or end
      finished = episodes.resolve(engine, finished)
    for record in finished:
      if engine.holds(record):  # held at a stop with no episodes to answer it
        engine.release(record)
      results[record.meta["index"]] = record
    queue.extendleft(reversed(engine.take_preempted()))
  if return_records:
    return results
  return [r.response.tolist() for r in results]
