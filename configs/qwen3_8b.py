"""Qwen3-8B with DAPO on DAPO-Math-17k, the APRIL paper's settings.

  python -m april_jax.main --config=configs/qwen3_8b.py --workdir=runs/qwen3_8b \
      --config.model.path=/models/Qwen3-8B \
      --config.data.source=/data/dapo-math-17k.parquet \
      --config.eval.path=/data/aime24.jsonl

N = 32 prompt groups of n = 8 per step, N' = 64 admitted (APRIL), learning rate 1e-6, DAPO
clip-higher 0.2 / 0.28, dynamic sampling, token-mean loss, overlong shaping. The synchronous
baseline is the same config with --config.rollout.partial_rollout=False
--config.rollout.over_sampling_batch_size=32. Variant `4b` (configs/qwen3_4b.py) changes
only the model. Params in bfloat16, sharded fully (FSDP) over every device.
"""

from april_jax.configs import base
from april_jax.configs.qwen3_shapes import QWEN3_SHAPES


def get_config(arg=None):
  del arg
  c = base.get_config()
  c.seed = 0
  c.num_steps = 400
  c.checkpoint_every = 20
  c.eval_every = 20

  c.model.path = ""                 # required: a Qwen3-8B HF folder
  c.model.init.update(QWEN3_SHAPES["qwen3_8b"])  # its shape, for the planner
  c.model.dtype = "bfloat16"
  c.model.kv_dtype = "bfloat16"
  c.model.remat = True
  c.mesh.shape = (1, -1, 1)

  c.data.source = ""                # required: DAPO-Math-17k (parquet) or another math set
  c.data.max_prompt_len = 1024
  c.data.system_prompt = ""
  c.data.enable_thinking = False

  c.rollout.batch_size = 32
  c.rollout.n_samples_per_prompt = 8
  c.rollout.over_sampling_batch_size = 64
  c.rollout.partial_rollout = True
  c.rollout.resume_mode = "kv"
  c.rollout.max_staleness = 4
  c.rollout.num_slots = 128
  c.rollout.sync_every = 32
  c.rollout.max_response_len = 8192
  c.rollout.temperature = 1.0
  c.rollout.dynamic_sampling = True
  c.rollout.reward = "math_dapo"
  c.rollout.reward_workers = 8

  c.train.advantage = "grpo"
  c.train.policy_loss = "ppo_clip"
  c.train.eps_clip = 0.2
  c.train.eps_clip_high = 0.28
  c.train.aggregation = "token_mean"
  c.train.tis_cap = 2.0
  c.train.overlong_buffer_len = 1024
  c.train.lr = 1e-6
  c.train.warmup_steps = 10
  c.train.weight_decay = 0.1
  c.train.num_minibatches = 4
  c.train.num_microbatches = 8          # 8 rows: one per device on 8 GPUs
  c.train.logprob_chunk = 1024

  c.eval.num_prompts = 30
  c.eval.k = 8
  c.eval.temperature = 0.6
  return c
