"""The slot engine's static settings (`EngineConfig`), checked on construction.

    config = EngineConfig(num_slots=64, max_len=4096, page_size=256, kv_pages=2048)
    config = EngineConfig.from_run_config(run_config)   # rollout.*, data, model.kv_dtype

Slots, the KV page pool, the decode window between host round trips, the widths of the
insert, snapshot and prefill calls, and how a sample out of its slot keeps its work. A
field named as a run config's field (settings/base.py) means the same and is built from
it (`from_run_config`) and takes its default from there; the checks here are the engine's
rules, and validation/checks.py reports them for a run's config. The pool's size is
`usable_pages`.
"""

from __future__ import annotations

import dataclasses

from april_jax import buckets
from april_jax.sampler import pages
from april_jax.settings.model import ModelSettings
from april_jax.settings.rollout import RolloutSettings

RESUME_MODES = ("kv", "recompute")
FEED_GIVEN = ("prefill", "decode")
DECODE_ATTENTION = ("auto", "xla", "pallas")
MAX_SPECULATIVE_TOKENS = 32  # a pass's positions grow with it, and its logits [S, K+1, V]
MAX_SPECULATIVE_NGRAM = 8
MAX_SPECULATIVE_HISTORY = 16  # rows of max_len a slot sends with each change


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  num_slots: int
  max_len: int  # tokens a slot holds: prompt + response
  sync_every: int = RolloutSettings.sync_every  # decode steps per host round trip (at most)
  min_bucket: int = 16
  stop_ids: tuple[int, ...] = ()
  kv_dtype: str = ModelSettings.kv_dtype
  insert_width: int = 8  # slots filled per insert call (fixed: one compile)
  snapshot_width: int = 4  # slots whose KV is copied out per device call
  # The KV pool and how decode attention reads it (rollout.* of the same names): pooled
  # positions per chunk, the implementation, positions per page (a power of two), usable
  # pages (None: max_len for every slot).
  decode_block: int = RolloutSettings.decode_block
  decode_attention: str = RolloutSettings.decode_attention
  page_size: int = RolloutSettings.page_size
  kv_pages: int | None = RolloutSettings.kv_pages
  # How a sample out of its slot keeps its work (a preempted one, and admit's default):
  # its KV ("kv") or its tokens, recomputed by a prefill ("recompute").
  resume_mode: str = RolloutSettings.resume_mode
  # With refill on, decoding returns once this many slots finish.
  refill_batch: int = RolloutSettings.refill_batch
  # Prompts of one length bucket prefilled per call (admit).
  prefill_width: int = RolloutSettings.prefill_width
  prompt_len: int | None = None  # the longest prompt (batched prefills up to its bucket)
  # A slot that draws a stop token is held with its KV; the caller extends or releases it
  # before the next step (multi-turn episodes: rollout/episodes.py).
  hold_stopped: bool = False
  # How given tokens (an observation, a resumed sample's tokens past its KV) reach a
  # slot's KV: one chunked prefill over its pages ("prefill"), or one decode step each
  # ("decode": the slot's lane draws nothing meanwhile). They give the same tokens.
  feed_given: str = "prefill"
  # Given tokens one feed call writes per slot at most (longer ones go in several calls):
  # its length bucket caps the feed programs a run compiles and the memory each takes.
  feed_len: int = 512
  # Speculative decoding (sampler/speculation/, rollout.speculative_*): tokens guessed
  # per live slot and checked in one pass (0: off), the longest suffix a guess matches,
  # a choice per call between speculating and not, past samples kept to draft from.
  speculative_tokens: int = RolloutSettings.speculative_tokens
  speculative_ngram: int = RolloutSettings.speculative_ngram
  speculative_auto: bool = RolloutSettings.speculative_auto
  speculative_history: int = RolloutSettings.speculative_history

  def __post_init__(self):
    found = problems(dataclasses.asdict(self))
    if found:
      raise ValueError("; ".join(found))

  @classmethod
  def from_run_config(cls, c, stop_ids=()) -> "EngineConfig":
    """The engine of a run's config (rollout.*, data.max_prompt_len, model.kv_dtype)."""
    return cls(**run_config_fields(c, stop_ids))

  @property
  def usable_pages(self) -> int:
    """Pages in the pool (its scratch pages apart): kv_pages, or max_len for every slot."""
    if self.kv_pages is not None:
      return self.kv_pages
    return self.num_slots * pages.pages_for(self.max_len, self.page_size)

  def device_settings(self) -> "DeviceSettings":
    """What the device programs depend on (slot_ops.device_fns compiles per value)."""
    return DeviceSettings(
        num_slots=self.num_slots,
        max_len=self.max_len,
        sync_every=self.sync_every,
        kv_dtype=self.kv_dtype,
        decode_block=self.decode_block,
        page_size=self.page_size,
        usable_pages=self.usable_pages,
        decode_attention=self.decode_attention,
        speculative_tokens=self.speculative_tokens,
        speculative_ngram=self.speculative_ngram,
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


@dataclasses.dataclass(frozen=True)
class DeviceSettings:
  """The engine settings its device programs are compiled for (EngineConfig's)."""

  num_slots: int
  max_len: int
  sync_every: int
  kv_dtype: str
  decode_block: int
  page_size: int
  usable_pages: int
  decode_attention: str
  speculative_tokens: int = RolloutSettings.speculative_tokens
  speculative_ngram: int = RolloutSettings.speculative_ngram


# EngineConfig fields that a run's config sets under the same name in `rollout`.
_ROLLOUT_FIELDS = ("num_slots", "sync_every", "decode_block", "decode_attention", "page_size")
_ROLLOUT_FIELDS += ("kv_pages", "resume_mode", "refill_batch", "prefill_width")
_ROLLOUT_FIELDS += ("speculative_tokens", "speculative_ngram", "speculative_auto")
_ROLLOUT_FIELDS += ("speculative_history",)


def run_config_fields(c, stop_ids=()) -> dict:
  """EngineConfig's fields from a run's config: the same names, but for max_len (prompt
  + response), prompt_len (data.max_prompt_len), kv_dtype (model.kv_dtype), stop_ids
  (the tokenizer's) and hold_stopped (with an environment)."""
  r = c.rollout
  return dict(
      {name: getattr(r, name) for name in _ROLLOUT_FIELDS},
      max_len=c.data.max_prompt_len + r.max_response_len,
      prompt_len=c.data.max_prompt_len,
      kv_dtype=c.model.kv_dtype,
      stop_ids=tuple(int(i) for i in stop_ids),
      hold_stopped=bool(c.env.name),
  )


# Where a run's config sets each engine field (settings/rollout.py), for its messages.
RUN_CONFIG_NAMES = {name: f"rollout.{name}" for name in _ROLLOUT_FIELDS}
RUN_CONFIG_NAMES.update(
    max_len="data.max_prompt_len + rollout.max_response_len",
    prompt_len="data.max_prompt_len",
    kv_dtype="model.kv_dtype",
)

_AT_LEAST_ONE = ("num_slots", "max_len", "sync_every", "min_bucket", "insert_width")
_AT_LEAST_ONE += ("snapshot_width", "decode_block", "page_size", "refill_batch", "prefill_width")
_AT_LEAST_ONE += ("feed_len",)


def problems(fields: dict, names: dict[str, str] | None = None) -> list[str]:
  """What is wrong with these EngineConfig fields (missing ones take their defaults),
  each naming its field: `names[field]`, or EngineConfig.field."""
  f = {x.name: x.default for x in dataclasses.fields(EngineConfig)} | fields
  name = lambda field: (names or {}).get(field, f"EngineConfig.{field}")
  out = [f"{name(k)} must be >= 1, got {f[k]}" for k in _AT_LEAST_ONE if f[k] < 1]
  page = f["page_size"]
  if page >= 1 and page & (page - 1):
    out.append(
        f"{name('page_size')} must be a power of two (length buckets are powers of two: "
        f"each must be a whole number of pages or fit in one), got {page}"
    )
  elif page >= 1 and f["max_len"] >= 1 and f["kv_pages"] is not None:
    need = pages.pages_for(f["max_len"] - 1, page)
    if f["kv_pages"] < need:
      out.append(
          f"{name('kv_pages')}={f['kv_pages']} cannot hold one sequence of "
          f"max_len={f['max_len']} ({name('max_len')}): it needs {need} pages of "
          f"{name('page_size')}={page}"
      )
  if f["prompt_len"] is not None and not 1 <= f["prompt_len"] <= f["max_len"]:
    out.append(
        f"{name('prompt_len')} must be in [1, max_len={f['max_len']}], got {f['prompt_len']}"
    )
  if f["decode_attention"] not in DECODE_ATTENTION:
    out.append(
        f"{name('decode_attention')} must be one of {DECODE_ATTENTION}, "
        f"got {f['decode_attention']!r}"
    )
  if f["feed_given"] not in FEED_GIVEN:
    out.append(f"{name('feed_given')} must be one of {FEED_GIVEN}, got {f['feed_given']!r}")
  if not 0 <= f["speculative_tokens"] <= MAX_SPECULATIVE_TOKENS:
    out.append(
        f"{name('speculative_tokens')} must be in [0, {MAX_SPECULATIVE_TOKENS}] "
        f"(tokens guessed per slot and pass; 0: off), got {f['speculative_tokens']}"
    )
  if not 0 <= f["speculative_history"] <= MAX_SPECULATIVE_HISTORY:
    out.append(
        f"{name('speculative_history')} must be in [0, {MAX_SPECULATIVE_HISTORY}] (past "
        f"samples of a prompt kept to draft from), got {f['speculative_history']}"
    )
  if f["speculative_auto"] and f["speculative_tokens"] < 1:
    out.append(
        f"{name('speculative_auto')} chooses per call between speculating and not: it "
        f"needs {name('speculative_tokens')} >= 1 (the drafts when it speculates)"
    )
  if not 1 <= f["speculative_ngram"] <= MAX_SPECULATIVE_NGRAM:
    out.append(
        f"{name('speculative_ngram')} must be in [1, {MAX_SPECULATIVE_NGRAM}], "
        f"got {f['speculative_ngram']}"
    )
  if f["resume_mode"] not in RESUME_MODES:
    out.append(f"{name('resume_mode')} must be one of {RESUME_MODES}, got {f['resume_mode']!r}")
  return out
