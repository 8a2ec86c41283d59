"""The `rollout` section: APRIL's batch and over-sampling, the sampler's slots and KV pool,
sampling, speculation and rewards; and the scheduler's rules (`problems`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  batch_size: int = 8  # N: prompt groups per training step
  n_samples_per_prompt: int = 4  # n
  over_sampling_batch_size: int = 16  # N' >= N: groups admitted per step
  partial_rollout: bool = True  # False: the synchronous baseline
  resume_mode: str = "kv"  # kv | recompute
  max_staleness: int | None = None  # policy versions; None = unlimited
  # Split meshes: False, each batch drawn by one version (reproducible); True, new weights
  # taken at the next decode call, live slots going on (docs/async.md).
  in_flight_updates: bool = False
  num_slots: int = 32  # sequences the sampler decodes at once
  sync_every: int = 16  # decode steps per host round trip
  # The KV page pool: slots hold pages of page_size positions (a power of two) as their
  # sequences grow; decode attention reads the live pages, decode_block positions per
  # chunk. kv_pages unset: max_len for every slot (no preemption); fewer serve more slots
  # in the same memory and preempt the youngest slot when the pool runs out.
  page_size: int = 16
  kv_pages: int | None = None  # pages in the pool (above)
  decode_block: int = 1024  # positions per chunk of decode attention (above)
  # xla: chunks of gathered pages (any backend); pallas: one kernel that reads each page in
  # place (GPUs, through Triton; a CPU interprets it, slowly); auto: pallas on NVIDIA GPUs,
  # xla elsewhere. The same attention either way.
  decode_attention: str = "auto"
  # Speculative decoding (docs/speculative.md): up to this many tokens a live slot is
  # guessed to draw next (n-gram matches in its own tokens and its group's) are checked
  # in one pass, each position drawn with its own key: the same tokens as plain decoding,
  # in fewer passes when guesses are right. 0 (off) to 32.
  speculative_tokens: int = 0
  speculative_ngram: int = 3  # the longest suffix of a slot's tokens a guess matches (1-8)
  # Each decode call speculates or not, whichever has drawn more tokens per second at
  # about as many live slots, measured as the run goes (needs speculative_tokens >= 1).
  speculative_auto: bool = False
  # Past samples of each prompt the sampler keeps (host memory, 4,096 prompts at most) to
  # draft from: a group's samples finished in an earlier step, an earlier epoch's. 0: none.
  speculative_history: int = 0
  refill_batch: int = 1  # slots that finish before the host refills (when samples wait)
  prefill_width: int = 4  # prompts of one length bucket that start together share a prefill
  max_response_len: int = 256  # tokens a response may draw (a multi-turn one: with observations)
  temperature: float = 1.0  # sampling; the behaviour logprobs are under it
  top_p: float = 1.0  # nucleus; 1.0 = off
  top_k: int = 0  # 0 = off
  dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are equal
  # Drops per step; past it the filter keeps what comes, so a step always ends (a data
  # set the policy always fails or always solves would otherwise never fill a batch).
  max_dropped_groups: int = 64
  reward: str = "math"  # a registered name, or path/to/file.py:fn or package.module:fn
  reward_url: str = (
      ""  # an HTTP reward server: POSTs each sample, reads its score (wins over reward)
  )
  reward_url_timeout_s: float = 10.0  # per request
  reward_url_retries: int = 2  # a failed request is tried again this many times, waits doubling
  reward_timeout_s: float = (
      10.0  # per sample; past it the worker is killed, the sample scored fallback
  )
  reward_fallback: float = 0.0  # the reward of a sample whose reward or environment failed
  reward_workers: int = 2  # worker processes scoring at once
  # A run stops (exit 2, one line naming the cause) when every sample of this many steps
  # in a row failed the same way (its reward or environment raised or ran past its
  # limit), and at once when the first step does; 0: never.
  max_failed_steps: int = 3

  def problems(self, prefix: str = "") -> list[str]:
    """What is wrong with the scheduler's settings, each naming its field (prefix + name)."""
    n, N = self.over_sampling_batch_size, self.batch_size
    if n < N:
      return [f"{prefix}over_sampling_batch_size ({n}) must be >= {prefix}batch_size ({N})"]
    if not self.partial_rollout and n != N:
      # A baseline that over-samples either trains surplus groups a step late (off-policy)
      # or throws finished work away; it admits exactly what it trains instead.
      return [
          f"{prefix}partial_rollout=False is the synchronous baseline, which admits exactly "
          f"the groups it trains: set {prefix}over_sampling_batch_size={N} (= "
          f"{prefix}batch_size), not {n} (over_sampling_batch_size == batch_size)"
      ]
    return []
