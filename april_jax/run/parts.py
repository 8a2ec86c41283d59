"""A run's learner parts, built from its config: the params and tokenizer, the learner and
PPO's critic (the rollout's are rollout/parts.py's).

The trainer (run/trainer.py) builds them once, in this order, then runs its loop:

  check_memory     the planner's verdict for these devices, before any weight exists
  load_params      model.path (its tokenizer first) or a seeded random init
  starting_params  warm-started (train.sft_steps) on a fresh run; a LoRA run's base
                   kept beside the checkpoints where no file holds it (lora_base.py)
  make_learner     the policy's learner (rl/update.py), LoRA adapters where set
  make_critic      PPO's critic (rl/critic.py), for train.advantage "gae"
"""

from __future__ import annotations

from absl import logging
import jax

from april_jax.models import hf_io, qwen3
from april_jax.planning import memory as plan_lib
from april_jax.rl import critic as critic_lib
from april_jax.rl import layout
from april_jax.rl import sft
from april_jax.rl import step as step_lib
from april_jax.rl.update import Learner
from april_jax.run import lora_base
from april_jax.runtime import distributed
from april_jax.sharding import Placement
from april_jax.tasks.task import load_tokenizer


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
      routing_replay=c.model.routing_replay,
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
