"""Config files load, validate, and a wrong config names its field."""

import dataclasses
import json

import pytest

from april_jax.validation import resume as resume_check
from april_jax.validation.checks import ConfigError, validate
from april_jax.errors import InputError
from april_jax.models import hf_io, qwen3
from april_jax.rl.losses import LossConfig
from conftest import load_config


@pytest.mark.parametrize("name", ["tiny", "tiny_tail", "tiny_lookup"])
def test_tiny_configs_are_valid(name):
  validate(load_config(name))


def test_distributed_fields_are_checked():
  from april_jax.runtime.distributed import parse_device_ids  # pylint: disable=g-import-not-at-top

  assert parse_device_ids("0,1, 2") == [0, 1, 2] and parse_device_ids("") is None
  config = load_config("tiny")
  config.distributed.coordinator_address = "host0"
  config.distributed.num_processes = 2
  config.distributed.process_id = 2
  config.distributed.local_device_ids = "0,x"
  with pytest.raises(ConfigError) as info:
    validate(config)
  for message in (
      "coordinator_address must be host:port, got 'host0'",
      "process_id must be in [0, 2), got 2",
      "local_device_ids must be",
  ):
    assert message in str(info.value)


def test_task_fields_are_checked():
  config = load_config("tiny")
  config.data.task.ring_size = 1
  config.data.task.sigma = -0.5
  with pytest.raises(ConfigError) as info:
    validate(config)
  assert "data.task.ring_size must be in [2, 1024], got 1" in str(info.value)
  assert "data.task.sigma >= 0" in str(info.value)
  config = load_config("tiny")
  config.data.task.ring_size = 200  # needs 405 token ids, the model has 136
  config.data.task.demo_overshoot = 1.5
  with pytest.raises(ConfigError) as info:
    validate(config)
  assert "vocab_size (136) is smaller than the built-in task's tokenizer (405 tokens)" in str(
      info.value
  )
  assert "data.task.demo_overshoot must be in [0, 1], got 1.5" in str(info.value)


def test_a_dataset_task_refuses_a_warm_start_and_evaluation_without_eval_path(tmp_path):
  rows = tmp_path / "train.jsonl"
  rows.write_text('{"question": "1+1?", "answer": "2"}\n')
  config = load_config("tiny")
  config.data.source = str(rows)
  config.train.sft_steps = 5
  config.eval_every = 10
  config.eval.path = str(tmp_path / "missing.jsonl")
  with pytest.raises(ConfigError) as info:
    validate(config)
  message = str(info.value)
  assert "train.sft_steps (5) > 0 needs reference answers" in message
  assert f"eval.path '{tmp_path / 'missing.jsonl'}': no such file" in message
  config.eval.path = ""
  with pytest.raises(ConfigError, match="eval_every > 0 with a dataset needs eval.path"):
    validate(config)


@pytest.mark.parametrize(
    "field,value,message",
    [
        (
            "rollout.over_sampling_batch_size",
            4,
            r"over_sampling_batch_size \(4\) must be >= " r"rollout.batch_size \(8\)",
        ),
        ("rollout.resume_mode", "disk", "rollout.resume_mode must be one of"),
        ("rollout.reward", "nope", "rollout.reward 'nope' is neither a registered reward"),
        ("rollout.top_p", 0.0, r"rollout.top_p must be in \(0, 1\]"),
        ("rollout.prefill_width", 0, "rollout.prefill_width must be >= 1, got 0"),
        ("rollout.speculative_tokens", -1, r"rollout.speculative_tokens must be in \[0, 32\]"),
        ("rollout.speculative_tokens", 40, r"rollout.speculative_tokens must be in \[0, 32\]"),
        ("rollout.speculative_history", -2, r"rollout.speculative_history must be in \[0, 16\]"),
        (
            "rollout.speculative_auto",
            True,
            "rollout.speculative_auto .* needs rollout.speculative_tokens >= 1",
        ),
        ("model.path", "/nonexistent/model", "model.path '/nonexistent/model' is not a model"),
        ("model.dtype", "float16", "model.dtype must be one of"),
        ("mesh.shape", (1, 2), "mesh.shape must have 3 entries"),
        ("env.name", "nope", "env.name='nope' is neither a registered environment"),
        ("env.max_turns", 0, "env.max_turns must be >= 1"),
        ("env.observation_template", "{obs}", "env.observation_template must hold"),
        ("train.whitening", "std", "train.whitening must be one of"),
        ("train.kl_type", "k5", "kl_type='k5': must be one of"),
        ("train.cov_ratio", 0.01, "train.cov_ratio set but train.policy_loss is .ppo_clip."),
    ],
)
def test_wrong_field_is_named(field, value, message):
  config = load_config(
      "tiny_lookup" if field.startswith("env.") and field != "env.name" else "tiny"
  )
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ConfigError, match=message):
    validate(config)


@pytest.mark.parametrize("advantage", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"])
def test_a_group_estimator_with_one_sample_per_prompt_is_refused_naming_n(advantage):
  config = load_config("tiny")
  config.train.advantage, config.rollout.n_samples_per_prompt = advantage, 1
  with pytest.raises(ConfigError, match=f"train.advantage '{advantage}' compares a sample"):
    validate(config)


def test_all_problems_are_reported_together():
  config = load_config("tiny")
  config.rollout.batch_size = 0
  config.rollout.temperature = -1.0
  with pytest.raises(ConfigError) as info:
    validate(config)
  assert "rollout.batch_size" in str(info.value) and "rollout.temperature" in str(info.value)


def test_the_baseline_admits_exactly_the_groups_it_trains():
  config = load_config("tiny")  # N = 8, N' = 16
  config.rollout.partial_rollout = False
  with pytest.raises(
      ConfigError,
      match=r"partial_rollout=False is the synchronous baseline"
      r".*over_sampling_batch_size=8 \(= rollout.batch_size\)"
      r", not 16",
  ):
    validate(config)
  config.rollout.over_sampling_batch_size = 8
  validate(config)


def test_overlong_buffer_longer_than_the_response_budget_is_refused_at_start_up():
  config = load_config("tiny")  # responses up to 64 tokens
  config.train.overlong_buffer_len = 65
  with pytest.raises(
      ConfigError,
      match=r"train.overlong_buffer_len \(65\) must be in \[0, "
      r"rollout.max_response_len \(64\)\]",
  ):
    validate(config)
  config.train.overlong_buffer_len = 64
  validate(config)


@pytest.mark.parametrize(
    "field,value",
    [
        ("rollout.temperature", float("nan")),
        ("rollout.top_p", float("nan")),
        ("train.lr", float("inf")),
        ("train.tis_cap", float("nan")),
        ("eval.temperature", float("-inf")),
        ("train.eps_clip_high", float("nan")),
    ],
)
def test_a_non_finite_number_anywhere_in_the_config_is_refused_by_name(field, value):
  config = load_config("tiny")
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ConfigError, match=rf"{field} must be a finite number, got {value}"):
    validate(config)


def test_optional_knobs_are_off_while_unset_and_a_negative_staleness_limit_is_refused():
  config = load_config("tiny")
  t = config.train
  assert (t.dual_clip_c, t.norm_len, t.overlong_buffer_len, config.rollout.max_staleness) == (
      None,
      None,
      None,
      None,
  )
  loss = LossConfig.from_config(t)
  assert loss.dual_clip_c is None and loss.norm_len is None
  config.rollout.max_staleness = -1
  with pytest.raises(ConfigError, match=r"rollout.max_staleness must be >= 0 .* got -1"):
    validate(config)
  config.rollout.max_staleness = 0  # a limit of 0: every token from the current version
  validate(config)


def test_gspo_by_name_gets_gspo_clips_and_sequence_mean_and_bad_mixes_are_refused_together():
  from april_jax.rl import losses  # pylint: disable=g-import-not-at-top

  loss_config = LossConfig.from_config
  config = load_config("tiny")
  config.train.eps_clip_high = None  # the tiny config sets DAPO's 0.28
  config.train.policy_loss = "gspo"
  validate(config)
  cfg = loss_config(config.train)
  assert (cfg.policy_loss, cfg.eps_clip, cfg.clip_high, cfg.aggregation) == (
      "gspo",
      losses.GSPO_EPS_CLIP,
      losses.GSPO_EPS_CLIP_HIGH,
      "seq_mean_token_mean",
  )
  config.train.eps_clip_high = 1e-3  # overridable
  assert loss_config(config.train).clip_high == 1e-3
  # PPO by name keeps PPO's defaults.
  config.train.policy_loss, config.train.eps_clip_high = "ppo_clip", None
  cfg = loss_config(config.train)
  assert (cfg.eps_clip, cfg.clip_high, cfg.aggregation) == (0.2, 0.2, "token_mean")
  # A token-level clip or a token-weighted mean is not GSPO: every problem, in one error.
  config.train.policy_loss, config.train.eps_clip = "gspo", 0.2
  config.train.aggregation = "token_mean"
  config.train.overlong_buffer_len = 100
  with pytest.raises(ConfigError) as info:
    validate(config)
  for message in (
      "eps_clip=0.2: GSPO clips a sequence-level ratio",
      "aggregation='token_mean': GSPO averages over sequences",
      "train.overlong_buffer_len (100)",
  ):
    assert message in str(info.value)


def test_paper_configs_need_a_model_and_data_and_say_so():
  for name in ("qwen3_8b", "qwen3_4b"):
    config = load_config(name)
    assert (
        config.rollout.batch_size,
        config.rollout.n_samples_per_prompt,
        config.rollout.over_sampling_batch_size,
        config.train.lr,
        config.train.eps_clip,
        config.train.eps_clip_high,
    ) == (32, 8, 64, 1e-6, 0.2, 0.28)
    with pytest.raises(ConfigError, match="data.source '' needs a pretrained model"):
      validate(config)


def test_qwen3_8b_is_april_s_own_dapo_setting_and_the_rest_are_named_variants():
  c = load_config("qwen3_8b")
  r, t = c.rollout, c.train
  assert (r.temperature, r.max_response_len, r.dynamic_sampling, r.max_staleness) == (
      0.8,
      16384,
      True,
      None,
  )
  # One optimizer step over the whole 32 x 8 batch (APRIL's global batch of 256).
  assert t.num_minibatches == 1 and t.ppo_epochs == 1
  assert (t.aggregation, t.tis_cap, t.overlong_buffer_len, t.kl_coef) == (
      "seq_mean_token_mean",
      0.0,
      None,
      0.0,
  )
  assert (t.lr, t.lr_schedule, t.warmup_steps, t.b1, t.b2, t.weight_decay) == (
      1e-6,
      "constant",
      0,
      0.9,
      0.98,
      0.1,
  )
  more = load_config("qwen3_8b", "tis+overlong+stale4")
  assert (more.train.tis_cap, more.train.overlong_buffer_len, more.rollout.max_staleness) == (
      2.0,
      1024,
      4,
  )
  base = load_config("qwen3_8b", "baseline")
  assert not base.rollout.partial_rollout and base.rollout.over_sampling_batch_size == 32
  node = load_config("qwen3_4b", "node+baseline")
  assert (node.rollout.num_slots, node.rollout.kv_pages) == (512, 8704)
  assert not node.rollout.partial_rollout
  assert node.rollout.temperature == 0.8 and node.model.init.hidden_size == 2560
  with pytest.raises(ValueError, match="variant 'tls': one of"):
    load_config("qwen3_8b", "tis+tls")
  with pytest.raises(ValueError, match="'gpu' or 'node', not both"):
    load_config("qwen3_4b", "gpu+node")


def test_gpu_bench_config_variants_have_real_shapes():
  from april_jax.models.qwen3 import Qwen3Config  # pylint: disable=g-import-not-at-top

  small = Qwen3Config.from_init(load_config("gpu_bench", "qwen3_0_6b").model.init)
  large = Qwen3Config.from_init(load_config("gpu_bench", "qwen3_4b").model.init)
  assert 0.59e9 < small.num_params() < 0.61e9 and 4.0e9 < large.num_params() < 4.1e9
  with pytest.raises(ValueError, match="variant 'qwen3_9b'"):
    load_config("gpu_bench", "qwen3_9b")


def test_the_kv_page_pool_fields_are_checked_by_name():
  config = load_config("tiny")
  config.rollout.page_size = 24
  with pytest.raises(ConfigError) as info:
    validate(config)
  assert "rollout.page_size must be a power of two" in str(info.value)
  config = load_config("tiny")
  config.rollout.page_size = 16
  config.rollout.kv_pages = 3
  max_len = config.data.max_prompt_len + config.rollout.max_response_len
  need = -(-(max_len - 1) // 16)
  with pytest.raises(ConfigError) as info:
    validate(config)
  assert f"rollout.kv_pages=3 cannot hold one sequence of max_len={max_len}" in str(info.value)
  assert f"it needs {need} pages" in str(info.value)
  config.rollout.kv_pages = need
  validate(config)


def test_a_checkpoint_saved_before_a_field_existed_resumes_at_its_default_only():
  config = load_config("tiny")
  saved = resume_check.as_json(config)
  del saved["env"], saved["data"]["task"]["hide_target"]  # fields added since
  assert resume_check.differences(saved, config) == []
  config.env.name = "lookup"
  assert resume_check.differences(saved, config) == ["env.name: '<unset>' -> 'lookup'"]


def test_a_resume_names_each_field_of_another_model_and_accepts_a_copy_of_the_same():
  """model.path may change on resume (the model moved); a model of another shape may not:
  its arrays would not fit the checkpoint's, and the read would look like damage."""
  cfg = qwen3.Qwen3Config.from_init(load_config("tiny").model.init)
  saved = json.loads(json.dumps(hf_io.architecture(cfg)))  # as the checkpoint keeps it
  assert "attention" not in saved and saved["hidden_size"] == cfg.hidden_size
  resume_check.check_same_model(saved, dataclasses.replace(cfg, attention="dense"), 3, "ck")
  resume_check.check_same_model(None, dataclasses.replace(cfg, num_layers=9), 3, "ck")
  bigger = dataclasses.replace(cfg, num_layers=cfg.num_layers + 1, rope_theta=1e4)
  with pytest.raises(InputError) as info:
    resume_check.check_same_model(saved, bigger, 3, "ck")
  assert "not the one checkpoint 3 in ck was trained from" in str(info.value)
  assert f"num_layers: {cfg.num_layers} -> {cfg.num_layers + 1}" in str(info.value)
  assert f"rope_theta: {cfg.rope_theta!r} -> 10000.0" in str(info.value)


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_numpy_cannot_take_is_refused_by_name(seed):
  config = load_config("tiny")
  config.seed = seed
  with pytest.raises(ConfigError, match=rf"seed must be in \[0, 2\*\*32\), got {seed}"):
    validate(config)


def test_algorithm_combinations_that_make_no_sense_are_refused_together_by_name(tmp_path):
  config = load_config("tiny")  # GRPO with dynamic sampling
  t = config.train
  t.critic_path = str(tmp_path)  # a critic for GRPO advantages
  t.gae_lambda = 0.95
  t.is_mode = "mask"  # ... and a mask with no bound (tis_cap 0, below)
  t.reward_kl_coef = 0.1  # a reward KL that GRPO's group advantages would ignore
  t.ratio_anchor = "behavior"
  t.tis_cap = 0.0
  with pytest.raises(ConfigError) as e:
    validate(config)
  for words in (
      "train.critic_path, train.gae_lambda set but train.advantage is 'grpo'",
      "train.reward_kl_coef puts a per-token KL into REINFORCE++'s returns; advantage 'grpo'",
      "is_mode='mask' needs an upper bound: tis_cap > 1",
  ):
    assert words in str(e.value)
  ppo = load_config("tiny")
  ppo.train.advantage = "gae"  # with the tiny config's dynamic sampling
  ppo.train.gae_lambda = 1.5
  with pytest.raises(ConfigError) as e:
    validate(ppo)
  assert "rollout.dynamic_sampling drops groups" in str(e.value)
  assert "train.gae_lambda must be in [0, 1], got 1.5" in str(e.value)
  ppo.rollout.dynamic_sampling, ppo.train.gae_lambda = False, 0.95
  validate(ppo)
  rpp = load_config("tiny")
  rpp.train.advantage, rpp.train.reward_kl_coef = "reinforce_plus_plus", 0.01
  validate(rpp)


def test_a_packing_budget_shorter_than_one_sample_is_refused_naming_the_fields():
  config = load_config("tiny")
  max_len = config.data.max_prompt_len + config.rollout.max_response_len
  config.train.pack_len = max_len - 1
  with pytest.raises(ConfigError) as info:
    validate(config)
  assert f"train.pack_len ({max_len - 1}) is shorter than one sample of max_len" in str(info.value)
  assert "data.max_prompt_len + rollout.max_response_len" in str(info.value)
  config.train.pack_len = max_len
  validate(config)
  config.train.packing, config.train.pack_len = False, max_len - 1  # unused when off
  validate(config)


def test_a_device_memory_that_is_not_a_positive_size_is_refused():
  for gb in (-1.0, 0.0, float("nan")):
    config = load_config("tiny")
    config.mesh.device_memory_gb = gb
    with pytest.raises(ConfigError, match="mesh.device_memory_gb must be a number of GB > 0"):
      validate(config)
