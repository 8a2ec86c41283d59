"""A run's parts, built from its config: the params and tokenizer, the learner and PPO's
critic, and the rollout (one engine, the reward workers, the scheduler).

The trainer (trainer.py) builds them once, in this order, then runs its loop:

  check_memory     the planner's verdict for these devices, before any weight exists
  load_params      model.path (its tokenizer first) or a seeded random init
  starting_params  warm-started (train.sft_steps) on a fresh run; a LoRA run's base
                   kept beside the checkpoints where no file holds it (lora_base.py)
  make_learner     the policy's learner (rl/update.py), LoRA adapters where set
  make_critic      PPO's critic (rl/critic.py), for train.advantage "gae"
  make_rollout     the engine that decodes the learner's params, the reward runner,
                   the episode runner (multi-turn), and the APRIL scheduler
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from absl import logging
import jax

from april_jax import distributed
from april_jax import lora_base
from april_jax import plan as plan_lib
from april_jax import sharding
from april_jax.models import hf_io, paged_attention_kernel, path_check, qwen3
from april_jax.rewards import longtail_task
from april_jax.rl import critic as critic_lib
from april_jax.rl import layout
from april_jax.rl import sft
from april_jax.rl import step as step_lib
from april_jax.rl.update import Learner
from april_jax.rollout import AprilScheduler, RewardRunner, RolloutSettings, run_episodes
from april_jax.rollout.episodes import EpisodeRunner
from april_jax.rollout.publish import WeightPublisher
from april_jax.sampler import EngineConfig, SlotEngine
from april_jax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a run's arrays live: the learner's mesh and axis rules, the rollout's mesh and
  the sampler's rules. Colocated (mesh.rollout_devices = 0) the two meshes are one; split,
  the rollout has the last rollout_devices devices (its shape mesh.rollout_shape) and
  the learner the rest (its shape mesh.shape): process 0, which writes the run's files,
  is a learner wherever the sides are on different processes."""

  mesh: Any
  rules: tuple
  decode_rules: tuple
  rollout_mesh: Any = None  # None: the learner's mesh

  @property
  def split(self) -> bool:
    return self.rollout_mesh is not None

  @property
  def decode_mesh(self):
    return self.mesh if self.rollout_mesh is None else self.rollout_mesh

  @classmethod
  def from_config(cls, config) -> "Placement":
    k = int(config.mesh.rollout_devices)
    devices = jax.devices()
    rollout_mesh = None
    if k:
      rollout_mesh = sharding.make_mesh(tuple(config.mesh.rollout_shape), devices[-k:])
      devices = devices[:-k]
    return cls(
        sharding.make_mesh(tuple(config.mesh.shape), devices),
        tuple(tuple(r) for r in config.mesh.rules),
        tuple(tuple(r) for r in config.mesh.decode_rules),
        rollout_mesh,
    )


@dataclasses.dataclass(frozen=True)
class Rollout:
  """What a run rolls out with: one engine (rollouts and evaluation alike, empty between
  steps), the reward runner, the episode runner (None for single-turn runs), the
  scheduler that drives them, and the text of token ids."""

  engine: SlotEngine
  rewards: RewardRunner
  episodes: EpisodeRunner | None
  scheduler: AprilScheduler
  decode: Callable[[list[int]], str]
  publisher: WeightPublisher | None  # split meshes: the learner's weights to the engine's


def checked_model(config):
  """(the model's config, the fast attention paths this device takes): each path is
  held to the portable one first (path_check.py), and process 0 says which it took."""
  model_cfg = hf_io.model_config(config)
  paths = path_check.check(path_check.Settings.of(config, model_cfg), agree=distributed.any_process)
  if distributed.is_primary():
    path_check.announce(paths)
  return paths.model_config(model_cfg), paths


def check_memory(config, model_cfg: qwen3.Qwen3Config) -> None:
  """Refuses, with the planner's numbers, a config that cannot fit on these devices."""
  capacity = (config.mesh.device_memory_gb or 0) * 1e9
  if not capacity:
    stats = jax.local_devices()[0].memory_stats() or {}
    capacity = float(stats.get("bytes_limit", 0))  # accelerators report it; CPUs do not
  native = jax.default_backend() != "cpu"
  plan = plan_lib.make_plan(config, model_cfg, jax.device_count(), capacity, native_16bit=native)
  logging.info("memory plan:\n%s", plan.table())
  if not plan.fits:
    plan_lib.check_fits(
        plan, plan_lib.what_fits(config, model_cfg, jax.device_count(), capacity, native)
    )


def load_tokenizer(config) -> Tokenizer:
  """The run's tokenizer alone (a split run's rollout process loads no weights)."""
  c = config
  if c.model.path:
    return Tokenizer.from_pretrained(c.model.tokenizer_path or c.model.path)
  return longtail_task.tokenizer(c.data.task.ring_size)


def load_params(config, model_cfg, lora, place: Placement):
  """(params, tokenizer): the model's params (float32 masters, whatever the compute
  dtype: see rl/update.py; with LoRA the frozen base, in the compute dtype) from
  model.path or a seeded random init, and the tokenizer that goes with them."""
  c = config
  # LoRA's base is frozen in the compute dtype, unless a warm start trains it first.
  dtype = "float32" if lora is None or c.train.sft_steps > 0 else c.model.dtype
  tokenizer = load_tokenizer(c)  # first: its files fail in a second, the weights in minutes
  if c.model.path:
    _, params = hf_io.load_pretrained(c.model.path, dtype, place.mesh, place.rules)
    return params, tokenizer
  key = jax.random.key(c.seed)
  # Drawn in float32 and cast, so a LoRA run's base is the full run's start, rounded.
  params = qwen3.init_params_sharded(
      model_cfg, key, place.mesh, place.rules, "float32", c.model.init.std
  )
  return (params if dtype == "float32" else step_lib.cast(params, dtype)), tokenizer


def starting_params(config, model_cfg, params, lora, resuming: bool, workdir: str, task, place):
  """The params the learner starts from: warm-started when asked (not on resume). A
  LoRA run's base that no file holds is saved beside the checkpoints (lora_base.py),
  and read back from there on resume."""
  c = config
  if lora is not None and resuming and (saved := lora_base.saved(workdir)):
    return hf_io.load_pretrained(saved, c.model.dtype, place.mesh, place.rules)[1]
  if c.train.sft_steps > 0 and not resuming:
    params = warm_start(config, model_cfg, params, task, place)
  if lora is not None and not resuming:
    lora_base.keep(workdir, c, model_cfg, params)
  return params


def warm_start(config, model_cfg, params, task, place: Placement):
  """train.sft_steps supervised steps on the task's warm-start data (rl/sft.py)."""
  c = config
  if distributed.is_primary():
    print(
        f"warm-start: {c.train.sft_steps} supervised steps before RL (compiling first)", flush=True
    )
  params, (first, last) = sft.warm_start(
      model_cfg,
      params,
      task.warm_start(),
      c.train,
      mesh=place.mesh,
      rules=place.rules,
      compute_dtype=c.model.dtype,
  )
  logging.info(
      "supervised warm-start: %d steps, cross-entropy %.3f -> %.3f", c.train.sft_steps, first, last
  )
  return params


def make_learner(config, model_cfg, params, lora, adapters, place: Placement) -> Learner:
  """The learner (with LoRA: `adapters` from train.lora_path, or fresh when None, over
  params frozen)."""
  c, t = config, layout.train_section(config)  # packed rows' budget resolved to max_len
  return Learner(
      model_cfg,
      params,
      t,
      c.rollout.temperature,
      total_updates=c.num_steps * t.num_minibatches * t.ppo_epochs,
      mesh=place.mesh,
      rules=place.rules,
      remat=c.model.remat,
      compute_dtype=c.model.dtype,
      decode_rules=place.decode_rules,
      lora=lora,
      adapters=adapters,
      seed=c.seed,
      lora_decode=t.lora.decode,
  )


def make_critic(config, model_cfg, policy_params, lora, place: Placement) -> critic_lib.Critic:
  """PPO's critic, from train.critic_path or the policy's own weights (with LoRA:
  adapters over the policy's frozen base, shared, or over the critic folder's)."""
  c, t = config, layout.train_section(config)
  params = policy_params
  if t.critic_path:
    dtype = "float32" if lora is None else c.model.dtype
    params = critic_lib.load_backbone(t.critic_path, model_cfg, place.mesh, place.rules, dtype)
  return critic_lib.Critic(
      model_cfg,
      params,
      t,
      total_updates=c.num_steps * t.num_minibatches * t.ppo_epochs,
      mesh=place.mesh,
      rules=place.rules,
      remat=c.model.remat,
      compute_dtype=c.model.dtype,
      lora=lora,
      seed=c.seed + 1,
  )


def make_rollout(config, model_cfg, paths, decode_params, tokenizer, task, place) -> Rollout:
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
  scheduler = AprilScheduler(
      engine, RolloutSettings.from_config(r), task.prompts, rewards, seed=c.seed, episodes=episodes
  )
  return Rollout(engine, rewards, episodes, scheduler, decode, publisher)
