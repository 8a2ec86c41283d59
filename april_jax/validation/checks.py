"""Checks a whole config once at start-up, before anything compiles.

Every problem found is reported at once, each naming its field:
  ConfigError: rollout.over_sampling_batch_size (4) must be >= rollout.batch_size (8)
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

from april_jax import sharding
from april_jax.settings.convert import SettingsError
from april_jax.settings.run import RunSettings
from april_jax.settings.train import TrainSettings
from april_jax.validation import lora as validate_lora
from april_jax.validation import split as validate_split
from april_jax.envs import base as env_base
from april_jax.envs import python_tool
from april_jax.errors import InputError
from april_jax.models import attention, moe, qwen3
from april_jax.rewards import loading as reward_loading
from april_jax.tasks import longtail as longtail_task
from april_jax.rl import advantages, losses
from april_jax.rl.policy_terms import COVARIANCE_TERMS
from april_jax.sampler import engine_config

DTYPES = ("float32", "bfloat16")


class ConfigError(InputError, ValueError):
  """A config that cannot run; the message names every field at fault."""


def _checks_engine(c, err: Callable[[str], None]) -> None:
  """The sampler engine's rules (sampler/engine_config.py) and the scheduler's
  (RolloutSettings), each once, there, named by the run config's fields."""
  fields = engine_config.run_config_fields(c)
  for problem in engine_config.problems(fields, engine_config.RUN_CONFIG_NAMES):
    err(problem)
  for problem in c.rollout.problems("rollout."):
    err(problem)


def _checks_rollout(c, err: Callable[[str], None]) -> None:
  r = c.rollout
  for name in ("batch_size", "n_samples_per_prompt", "max_response_len", "reward_workers"):
    if int(getattr(r, name)) < 1:
      err(f"rollout.{name} must be >= 1, got {getattr(r, name)}")
  _checks_engine(c, err)
  if r.max_dropped_groups < 0:
    err(f"rollout.max_dropped_groups must be >= 0, got {r.max_dropped_groups}")
  if r.max_failed_steps < 0:
    err(f"rollout.max_failed_steps must be >= 0 (0: never stop), got {r.max_failed_steps}")
  if r.max_staleness is not None and r.max_staleness < 0:
    err(
        f"rollout.max_staleness must be >= 0 policy versions (unset: no limit), got "
        f"{r.max_staleness}"
    )
  if r.temperature < 0:
    err(f"rollout.temperature must be >= 0, got {r.temperature}")
  if not 0 < r.top_p <= 1:
    err(f"rollout.top_p must be in (0, 1], got {r.top_p}")
  if r.top_k < 0:
    err(f"rollout.top_k must be >= 0, got {r.top_k}")
  if r.reward_timeout_s <= 0:
    err(f"rollout.reward_timeout_s must be > 0, got {r.reward_timeout_s}")
  if r.reward_url:
    if not r.reward_url.startswith(("http://", "https://")):
      err(f"rollout.reward_url must be an http:// or https:// URL, got {r.reward_url!r}")
    if r.reward_url_timeout_s <= 0:
      err(f"rollout.reward_url_timeout_s must be > 0, got {r.reward_url_timeout_s}")
    if r.reward_url_retries < 0:
      err(f"rollout.reward_url_retries must be >= 0, got {r.reward_url_retries}")
  else:
    reward_problem = reward_loading.problem(r.reward)
    if reward_problem:
      err(reward_problem)


def _checks_model(c, err: Callable[[str], None]) -> None:
  m = c.model
  if m.dtype not in DTYPES:
    err(f"model.dtype must be one of {DTYPES}, got {m.dtype!r}")
  if m.kv_dtype not in DTYPES:
    err(f"model.kv_dtype must be one of {DTYPES}, got {m.kv_dtype!r}")
  if m.attention not in attention.IMPLEMENTATIONS:
    err(f"model.attention must be one of {attention.IMPLEMENTATIONS}, got {m.attention!r}")
  if m.attention_chunk < 1:
    err(f"model.attention_chunk must be >= 1, got {m.attention_chunk}")
  if m.experts_impl not in moe.IMPLS:
    err(f"model.experts_impl must be one of {moe.IMPLS}, got {m.experts_impl!r}")
  if not m.path and m.init.num_experts:
    try:
      qwen3.Qwen3Config.from_init(m.init)
    except ValueError as e:
      err(f"model.init: {e}")
  if m.path:
    if not (Path(m.path) / "config.json").is_file():
      err(f"model.path {m.path!r} is not a model folder (no config.json there)")
  else:
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
    ):
      if int(getattr(m.init, name)) < 1:
        err(
            f"model.init.{name} must be >= 1 when model.path is empty, got "
            f"{getattr(m.init, name)}"
        )
    if c.data.source != "longtail":
      err(
          f"data.source {c.data.source!r} needs a pretrained model and its tokenizer: set "
          "model.path (a random init only runs the built-in task, data.source='longtail')"
      )
    else:
      ring_size = min(max(int(c.data.task.ring_size), 2), longtail_task.MAX_RING_SIZE)
      needed = longtail_task.tokenizer(ring_size).vocab_size
      if 0 < m.init.vocab_size < needed:
        err(
            f"model.init.vocab_size ({m.init.vocab_size}) is smaller than the built-in "
            f"task's tokenizer ({needed} tokens)"
        )


def _checks_mesh(c, err: Callable[[str], None]) -> None:
  if len(tuple(c.mesh.shape)) != 3:
    err(f"mesh.shape must have 3 entries (data, fsdp, tensor), got {tuple(c.mesh.shape)}")
  gb = c.mesh.device_memory_gb
  if gb is not None and not (math.isfinite(gb) and gb > 0):
    err(f"mesh.device_memory_gb must be a number of GB > 0 (unset: ask the device), got {gb}")
  for problem in validate_split.problems(c):
    err(problem)


def _checks_top(c, err: Callable[[str], None]) -> None:
  for name in ("num_steps", "checkpoint_every", "eval_every"):
    if int(getattr(c, name)) < 0:
      err(f"{name} must be >= 0, got {getattr(c, name)}")
  if not 0 <= int(c.seed) < 2**32:  # numpy's and JAX's seeds are unsigned 32-bit words
    err(f"seed must be in [0, 2**32), got {c.seed}")
  if c.data.max_prompt_len < 1:
    err(f"data.max_prompt_len must be >= 1, got {c.data.max_prompt_len}")
  if c.eval.temperature < 0 or not 0 < c.eval.top_p <= 1:
    err(
        f"eval.temperature must be >= 0 and eval.top_p in (0, 1], got "
        f"{c.eval.temperature}, {c.eval.top_p}"
    )
  if c.data.source == "longtail":
    if c.data.max_prompt_len < 5:
      err(f"data.max_prompt_len ({c.data.max_prompt_len}) must be >= 5 for the built-in " "task")
    t = c.data.task
    if not 2 <= t.ring_size <= longtail_task.MAX_RING_SIZE:
      err(
          f"data.task.ring_size must be in [2, {longtail_task.MAX_RING_SIZE}], got "
          f"{t.ring_size}"
      )
    if t.median <= 0 or t.sigma < 0:
      err(f"data.task.median must be > 0 and data.task.sigma >= 0, got {t.median}, {t.sigma}")
    if not 0 <= t.demo_overshoot <= 1:
      err(f"data.task.demo_overshoot must be in [0, 1], got {t.demo_overshoot}")
    if c.rollout.max_response_len < 2:
      err(
          f"rollout.max_response_len ({c.rollout.max_response_len}) must be >= 2 for the "
          "built-in task (a walk of at least one symbol, plus the stop token)"
      )
  else:
    if not Path(c.data.source).is_file():
      err(f"data.source {c.data.source!r}: no such file")
    if c.train.sft_steps > 0:
      err(
          f"train.sft_steps ({c.train.sft_steps}) > 0 needs reference answers to imitate: "
          "the built-in task has them, a dataset's prompts do not (set it to 0)"
      )
    if c.eval_every and not c.eval.path:
      err(
          "eval_every > 0 with a dataset needs eval.path (a math file to evaluate on); "
          "the held-out prompts exist for the built-in task only"
      )
  if c.eval.path and not Path(c.eval.path).is_file():
    err(f"eval.path {c.eval.path!r}: no such file")


def _checks_distributed(c, err: Callable[[str], None]) -> None:
  d = c.distributed
  if d.coordinator_address and not d.auto:
    host, _, port = d.coordinator_address.rpartition(":")
    if not host or not port.isdigit():
      err(f"distributed.coordinator_address must be host:port, got {d.coordinator_address!r}")
    if d.num_processes < 1:
      err(f"distributed.num_processes must be >= 1, got {d.num_processes}")
    elif not 0 <= d.process_id < d.num_processes:
      err(f"distributed.process_id must be in [0, {d.num_processes}), got {d.process_id}")
  ids = d.local_device_ids.strip()
  if ids and not all(x.strip().isdigit() for x in ids.split(",")):
    err(
        f"distributed.local_device_ids must be comma-separated device numbers like "
        f"'0,1,2,3', got {d.local_device_ids!r}"
    )
  for name in ("heartbeat_timeout_s", "initialization_timeout_s"):
    if getattr(d, name) < 1:
      err(f"distributed.{name} must be >= 1, got {getattr(d, name)}")


def _checks_train(c, err: Callable[[str], None]) -> None:
  t, r = c.train, c.rollout
  known = sorted(advantages.ADVANTAGES) + list(advantages.CRITIC_ADVANTAGES)
  if t.advantage not in known:
    err(f"train.advantage {t.advantage!r} is not one of {known}")
  elif t.advantage in advantages.CRITIC_ADVANTAGES:
    _checks_critic(c, err)
  elif critic_knobs := [k for k in CRITIC_KNOBS if _changed(t, k)]:
    err(
        f"train.{', train.'.join(critic_knobs)} set but train.advantage is {t.advantage!r}: "
        "a critic is trained only for advantage 'gae' (PPO with a critic); leave them at "
        "their defaults or set advantage='gae'"
    )
  elif t.advantage in advantages.NEED_GROUPS and r.n_samples_per_prompt < 2:
    err(
        f"train.advantage {t.advantage!r} compares a sample with its group: "
        f"rollout.n_samples_per_prompt must be >= 2, got {r.n_samples_per_prompt}"
    )
  if t.policy_loss not in COVARIANCE_TERMS and (
      cov_knobs := [k for k in COVARIANCE_KNOBS if _changed(t, k)]
  ):
    err(
        f"train.{', train.'.join(cov_knobs)} set but train.policy_loss is {t.policy_loss!r}: "
        f"only {' and '.join(COVARIANCE_TERMS)} select tokens by covariance; leave them at "
        "their defaults or pick one of those"
    )
  if t.whitening not in advantages.WHITENINGS:
    err(f"train.whitening must be one of {list(advantages.WHITENINGS)}, got {t.whitening!r}")
  if t.reward_kl_coef < 0:
    err(f"train.reward_kl_coef must be >= 0 (0 = off), got {t.reward_kl_coef}")
  elif t.reward_kl_coef > 0 and t.advantage != "reinforce_plus_plus":
    err(
        f"train.reward_kl_coef puts a per-token KL into REINFORCE++'s returns; advantage "
        f"{t.advantage!r} does not take it (use advantage='reinforce_plus_plus', or kl_coef "
        "for a KL term in the loss)"
    )
  for problem in losses.loss_config_problems(
      losses.LossConfig.from_config(t), r.n_samples_per_prompt
  ):
    err(f"train: {problem}")
  if t.overlong_buffer_len is not None and not 0 <= t.overlong_buffer_len <= r.max_response_len:
    err(
        f"train.overlong_buffer_len ({t.overlong_buffer_len}) must be in [0, "
        f"rollout.max_response_len ({r.max_response_len})]: DAPO's overlong penalty ramps "
        f"over the last overlong_buffer_len tokens of the response budget"
    )
  if t.overlong_penalty_factor < 0:
    err(f"train.overlong_penalty_factor must be >= 0, got {t.overlong_penalty_factor}")
  _checks_batch_split(c, err)


def _checks_batch_split(c, err: Callable[[str], None]) -> None:
  """train's optimizer and how a step's batch is split into rows and updates."""
  t, r = c.train, c.rollout
  if t.lr <= 0:
    err(f"train.lr must be > 0, got {t.lr}")
  if t.lr_schedule not in ("constant", "cosine"):
    err(f"train.lr_schedule must be 'constant' or 'cosine', got {t.lr_schedule!r}")
  if t.moments_dtype not in DTYPES:
    err(f"train.moments_dtype must be one of {DTYPES}, got {t.moments_dtype!r}")
  if t.router_aux_loss_coef < 0:
    err(f"train.router_aux_loss_coef must be >= 0, got {t.router_aux_loss_coef}")
  for name in ("num_minibatches", "num_microbatches", "ppo_epochs", "logprob_chunk"):
    if int(getattr(t, name)) < 1:
      err(f"train.{name} must be >= 1, got {getattr(t, name)}")
  max_len = c.data.max_prompt_len + r.max_response_len
  if t.pack_len < 0:
    err(f"train.pack_len must be >= 0 (0 = max_len), got {t.pack_len}")
  elif t.packing and t.pack_len and t.pack_len < max_len:
    err(
        f"train.pack_len ({t.pack_len}) is shorter than one sample of max_len "
        f"(data.max_prompt_len + rollout.max_response_len = {max_len}): a packed row must "
        "hold the longest sample (0 = max_len)"
    )
  batch = r.batch_size * r.n_samples_per_prompt
  split = t.num_minibatches * t.num_microbatches
  if split >= 1 and batch % split:
    err(
        f"rollout.batch_size x n_samples_per_prompt ({batch}) must divide into "
        f"train.num_minibatches x train.num_microbatches ({split})"
    )


# The critic's settings: set away from their defaults they mean advantage 'gae'.
COVARIANCE_KNOBS = ("cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_coef")
CRITIC_KNOBS = ("critic_path", "critic_lr", "value_clip", "gae_gamma", "gae_lambda", "gae_whiten")
_DEFAULT_TRAIN = TrainSettings()


def _changed(train: TrainSettings, name: str) -> bool:
  return getattr(train, name) != getattr(_DEFAULT_TRAIN, name)


def _checks_critic(c, err: Callable[[str], None]) -> None:
  t = c.train
  if t.critic_lr <= 0:
    err(f"train.critic_lr must be > 0, got {t.critic_lr}")
  if t.value_clip < 0:
    err(f"train.value_clip must be >= 0 (0 = no clip), got {t.value_clip}")
  if not 0 < t.gae_gamma <= 1:
    err(f"train.gae_gamma must be in (0, 1], got {t.gae_gamma}")
  if not 0 <= t.gae_lambda <= 1:
    err(f"train.gae_lambda must be in [0, 1], got {t.gae_lambda}")
  if t.critic_path and not (Path(t.critic_path) / "config.json").is_file():
    err(f"train.critic_path {t.critic_path!r}: no Qwen3 folder there (no config.json)")
  if c.rollout.dynamic_sampling:
    err(
        "rollout.dynamic_sampling drops groups whose rewards are all equal, where group "
        "advantages are 0; a critic's are not (advantage 'gae'): set "
        "rollout.dynamic_sampling=False"
    )


def _checks_finite(c, err: Callable[[str], None], prefix: str = "") -> None:
  """Every number in the config is finite: a NaN passes every range check (all its
  comparisons are false) and an infinity passes most, then poisons sampling or the loss."""
  for field in dataclasses.fields(c):
    key, value = field.name, getattr(c, field.name)
    if dataclasses.is_dataclass(value):
      _checks_finite(value, err, f"{prefix}{key}.")
    elif isinstance(value, float) and not math.isfinite(value):
      err(f"{prefix}{key} must be a finite number, got {value}")


def _checks_env(c, err: Callable[[str], None]) -> None:
  e = c.env
  if not e.name:
    return
  for name in ("max_turns", "max_observation_tokens", "workers"):
    if getattr(e, name) < 1:
      err(f"env.{name} must be >= 1, got {getattr(e, name)}")
  if e.timeout_s <= 0:
    err(f"env.timeout_s must be > 0, got {e.timeout_s}")
  if e.observation_format not in ("text", "chat_template"):
    err(f"env.observation_format must be 'text' or 'chat_template', got {e.observation_format!r}")
  if e.isolation not in python_tool.ISOLATIONS:
    err(f"env.isolation must be one of {python_tool.ISOLATIONS}, got {e.isolation!r}")
    return
  if "{observation}" not in e.observation_template:
    err(f"env.observation_template must hold {{observation}}, got {e.observation_template!r}")
  try:
    env_base.load(e.name, {"isolation": e.isolation})
  except env_base.EnvError as problem:
    err(str(problem))


CHECKS: list[Callable] = [
    _checks_finite,
    _checks_mesh,
    _checks_top,
    _checks_model,
    _checks_rollout,
    _checks_env,
    _checks_distributed,
    _checks_train,
    validate_lora.checks,
]


def batch_shards(config, num_devices: int) -> int:
  """Devices a training microbatch's rows are split over (the mesh axes of `batch`)."""
  shape = dict(
      zip(sharding.MESH_AXES, sharding.resolve_mesh_shape(tuple(config.mesh.shape), num_devices))
  )
  axes = dict(tuple(r) for r in config.mesh.rules).get("batch") or ()
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  out = 1
  for axis in axes:
    out *= shape[axis]
  return out


def validate_for_devices(config, num_devices: int, model_cfg=None) -> None:
  """The checks that need the device count: the mesh (both of a split run's, against
  the model's heads where `model_cfg` is given), and microbatches that split evenly over
  the devices holding the batch (else each would hold every row)."""
  config = settings_of(config)
  problems = validate_split.device_problems(config, num_devices, model_cfg)
  if problems:
    raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
  num_devices = validate_split.learner_devices(config, num_devices)
  try:
    shards = batch_shards(config, num_devices)
  except ValueError as e:
    raise ConfigError(f"invalid config:\n  mesh.shape: {e}") from None
  problems = validate_lora.device_problems(config, num_devices)
  if problems:
    raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
  r, t = config.rollout, config.train
  rows = r.batch_size * r.n_samples_per_prompt // (t.num_minibatches * t.num_microbatches)
  if rows % shards:
    raise ConfigError(
        f"invalid config:\n  a training microbatch has {rows} rows (rollout.batch_size "
        f"{r.batch_size} x n_samples_per_prompt {r.n_samples_per_prompt} / "
        f"(train.num_minibatches {t.num_minibatches} x train.num_microbatches "
        f"{t.num_microbatches})), which must be a multiple of the {shards} devices the "
        f"batch is split over (mesh {tuple(config.mesh.shape)} on {num_devices} devices)"
    )


# What a plan of a config's shapes needs (no data, model or reward files).
PLAN_CHECKS: list[Callable] = [_checks_finite, _checks_mesh, _checks_rollout, _checks_train]


def settings_of(config) -> RunSettings:
  """A config (its ConfigDict, or RunSettings) as RunSettings; ConfigError for a field
  the settings do not have or a value of the wrong type."""
  try:
    return RunSettings.from_config(config)
  except SettingsError as e:
    raise ConfigError(f"invalid config:\n  {e}") from None


def validate(config, checks=None) -> RunSettings:
  """The config's settings; ConfigError listing every problem for one that cannot run.
  `checks`: a subset (PLAN_CHECKS), by default every check."""
  settings = settings_of(config)
  problems: list[str] = []
  for check in CHECKS if checks is None else checks:
    try:
      check(settings, problems.append)
    except (KeyError, AttributeError, TypeError) as e:
      problems.append(f"malformed config: {e}")
  if problems:
    raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
  return settings
