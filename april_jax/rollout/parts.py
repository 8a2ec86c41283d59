"""The rollout's parts, built from a run's config: one engine (rollouts and evaluation
alike, decoding on the fast paths the start-up check took), the reward runner, the
episode runner (multi-turn) and the APRIL scheduler that drives them; with split meshes,
the publisher that copies the learner's weights to the engine's mesh."""

from __future__ import annotations

import dataclasses
from typing import Callable

from absl import logging

from april_jax.models import paged_attention_kernel
from april_jax.rollout import AprilScheduler, RewardRunner, run_episodes
from april_jax.rollout.episodes import EpisodeRunner
from april_jax.rollout.publish import WeightPublisher
from april_jax.runtime import distributed
from april_jax.sampler import EngineConfig, SlotEngine


@dataclasses.dataclass(frozen=True)
class RolloutParts:
  """What a run rolls out with: one engine (rollouts and evaluation alike, empty between
  steps), the reward runner, the episode runner (None for single-turn runs), the
  scheduler that drives them, and the text of token ids."""

  engine: SlotEngine
  rewards: RewardRunner
  episodes: EpisodeRunner | None
  scheduler: AprilScheduler
  decode: Callable[[list[int]], str]
  publisher: WeightPublisher | None  # split meshes: the learner's weights to the engine's


def make_parts(config, model_cfg, paths, decode_params, tokenizer, task, place) -> RolloutParts:
  """The engine (decoding `decode_params` at version 0, on the fast paths the start-up
  check took), the reward runner, the episode runner and the scheduler."""
  c, r = config, config.rollout
  episodes, turn_stop_ids = run_episodes.runner_for(config, tokenizer)
  stop_ids = tokenizer.stop_ids + turn_stop_ids
  engine_config = paths.engine_config(EngineConfig.from_run_config(c, stop_ids))
  publisher = None
  if place.split:  # the weights cross to the rollout mesh, as every update's will
    publisher = WeightPublisher(model_cfg, place.rollout_mesh, place.decode_rules, c.model.dtype)
  engine = SlotEngine(
      model_cfg,
      None if place.split else decode_params,
      engine_config,
      mesh=place.decode_mesh,
      rules=place.decode_rules,
  )
  if publisher is not None and decode_params is not None:
    publisher.swap(engine, decode_params, 0)
  described = paged_attention_kernel.describe(r.decode_attention, r.page_size, model_cfg.head_dim)
  if engine_config.decode_attention != r.decode_attention:
    described = "the XLA path (the Pallas kernel failed its start-up check)"
  logging.info("decode attention: %s", described)
  decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
  rewards = RewardRunner(
      task.reward,
      decode,
      num_workers=r.reward_workers,
      timeout_s=r.reward_timeout_s,
      fallback=r.reward_fallback,
      agree=distributed.agree if distributed.process_count() > 1 else None,
      # In worker processes, killed at the time limit: any reward may parse model text
      # with a symbolic library. The built-in task's is a bounded comparison of short
      # strings, scored on threads (no worker start-up).
      processes=r.reward != "longtail",
  )
  scheduler = AprilScheduler(engine, r, task.prompts, rewards, seed=c.seed, episodes=episodes)
  return RolloutParts(engine, rewards, episodes, scheduler, decode, publisher)
