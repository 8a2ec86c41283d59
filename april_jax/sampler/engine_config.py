"""The slot engine's static settings (`EngineConfig`), checked on construction.

    config = EngineConfig(num_slots=64, max_len=4096, page_size=256, num_pages=2048)
    config = EngineConfig.from_run_config(run_config)   # rollout.*, data, model.kv_dtype

Slots, the KV page pool, the decode window between host round trips, the widths of the
insert, snapshot and prefill calls, and how a slot preempted for pages keeps its work.
"""

from __future__ import annotations

import dataclasses

from april_jax import buckets
from april_jax.sampler import pages

RESUME_MODES = ("kv", "recompute")
DECODE_ATTENTION = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  num_slots: int
  max_len: int  # tokens a slot holds: prompt + response
  sync_every: int = 16  # decode steps per host round trip (at most)
  min_bucket: int = 16
  stop_ids: tuple[int, ...] = ()
  kv_dtype: str = "float32"
  insert_width: int = 8  # slots filled per insert call (fixed: one compile)
  snapshot_width: int = 4  # slots whose KV is copied out per device call
  decode_block: int = 1024  # pooled positions read per chunk of decode attention
  # How a decode step reads the pool: "xla" (chunks of gathered pages, any backend),
  # "pallas" (one kernel that reads each page in place; GPUs, via Triton; interpreted,
  # slowly, on a CPU), or "auto" (the kernel on NVIDIA GPUs, else xla). They compute the
  # same attention.
  decode_attention: str = "auto"
  page_size: int = 16  # positions per KV page (a power of two)
  num_pages: int | None = None  # usable pool pages; None: max_len for every slot
  preempt_mode: str = "kv"  # how a slot preempted for pages keeps its work: kv | recompute
  refill_batch: int = 1  # with refill on, decoding returns once this many slots finish
  prefill_width: int = 4  # prompts of one length bucket prefilled per call (add_groups)
  prompt_len: int | None = None  # the longest prompt (batched prefills up to its bucket)
  # A slot that draws a stop token is held with its KV; the caller extends or releases it
  # before the next step (multi-turn episodes: envs/episodes.py).
  hold_stopped: bool = False

  def __post_init__(self):
    for name in (
        "num_slots",
        "max_len",
        "sync_every",
        "min_bucket",
        "insert_width",
        "snapshot_width",
        "decode_block",
        "page_size",
        "refill_batch",
        "prefill_width",
    ):
      if getattr(self, name) < 1:
        raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.page_size & (self.page_size - 1):
      raise ValueError(
          f"EngineConfig.page_size must be a power of two (so every length bucket is a "
          f"whole number of pages or fits in one), got {self.page_size}"
      )
    if self.prompt_len is not None and not 1 <= self.prompt_len <= self.max_len:
      raise ValueError(
          f"EngineConfig.prompt_len must be in [1, max_len={self.max_len}], got {self.prompt_len}"
      )
    if self.decode_attention not in DECODE_ATTENTION:
      raise ValueError(
          f"EngineConfig.decode_attention must be one of {DECODE_ATTENTION}, "
          f"got {self.decode_attention!r}"
      )
    if self.preempt_mode not in RESUME_MODES:
      raise ValueError(f"EngineConfig.preempt_mode must be one of {RESUME_MODES}")
    if self.num_pages is not None and self.num_pages < self.pages_per_sequence:
      raise ValueError(
          f"EngineConfig.num_pages={self.num_pages} cannot hold one sequence of "
          f"max_len={self.max_len}: it needs {self.pages_per_sequence} pages of "
          f"page_size={self.page_size}"
      )

  @classmethod
  def from_run_config(cls, c, stop_ids=()) -> "EngineConfig":
    """The engine of a run's config (rollout.*, data.max_prompt_len, model.kv_dtype)."""
    r = c.rollout
    return cls(
        num_slots=r.num_slots,
        max_len=c.data.max_prompt_len + r.max_response_len,
        sync_every=r.sync_every,
        stop_ids=tuple(int(i) for i in stop_ids),
        kv_dtype=c.model.kv_dtype,
        decode_block=r.decode_block,
        decode_attention=r.decode_attention,
        page_size=r.page_size,
        num_pages=r.kv_pages,
        preempt_mode=r.resume_mode,
        refill_batch=r.refill_batch,
        prefill_width=r.prefill_width,
        prompt_len=c.data.max_prompt_len,
        hold_stopped=bool(c.get("env") and c.env.name),
    )

  @property
  def pages_per_sequence(self) -> int:
    """Pages one sequence of max_len holds (KV of all but its last token)."""
    return pages.pages_for(self.max_len - 1, self.page_size)

  def prefill_rows(self, bucket: int) -> int:
    """Prompts one prefill call of this length bucket takes: prefill_width up to the
    longest prompt's bucket, so long as they hold no more tokens than one max_len
    sequence (the memory plan's prefill); else 1."""
    longest = buckets.bucket(self.prompt_len or self.max_len, self.min_bucket, self.max_len)
    width = self.prefill_width
    return width if bucket <= longest and width * bucket <= self.max_len else 1
