"""Every config field april_jax reads, with defaults. Files in configs/ start from here.

Configs are Python (ml_collections): `configs/<name>.py` defines `get_config(arg)`,
starting from `base.get_config()` and changing what it needs; any field can be
overridden on the command line, e.g. `--config.rollout.over_sampling_batch_size=64`.
`april_jax.configs.validate` checks the whole config once at start-up, before anything
compiles, and names the field at fault.
"""

import ml_collections
from ml_collections import config_dict

from april_jax import sharding


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_steps = 100
  c.checkpoint_every = 50        # steps; 0 = only at the end and on SIGTERM
  c.eval_every = 0               # steps; 0 = never
  c.log_every = 1

  c.model = ml_collections.ConfigDict()
  c.model.path = ""              # HF folder (config.json + safetensors); "" = random init
  c.model.tokenizer_path = ""    # default: model.path
  c.model.dtype = "float32"      # compute dtype: float32 | bfloat16 (master weights and
                                 # AdamW moments are float32 either way)
  c.model.kv_dtype = "float32"
  c.model.remat = False          # rematerialise layers in the update
  c.model.attention = "auto"     # auto | dense | blockwise | cudnn (models/attention.py)
  c.model.attention_chunk = 512  # keys per block of blockwise attention
  c.model.init = ml_collections.ConfigDict(dict(
      vocab_size=0, hidden_size=0, intermediate_size=0, num_layers=0, num_heads=0,
      num_kv_heads=0, head_dim=0, rope_theta=1e6, rms_norm_eps=1e-6,
      tie_word_embeddings=True, std=0.02))

  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (1, -1, 1)      # (data, fsdp, tensor); -1 takes the devices left
  c.mesh.rules = sharding.TRAIN_RULES          # the learner: FSDP x tensor
  c.mesh.decode_rules = sharding.DECODE_RULES  # the sampler: tensor parallel, slots over data
  c.mesh.device_memory_gb = config_dict.placeholder(float)  # per device, for the start-up
                                                           # plan; None = ask the device

  c.distributed = ml_collections.ConfigDict()  # one process per host (april_jax/distributed.py)
  c.distributed.auto = False              # jax.distributed from the cluster env (SLURM, Open MPI)
  c.distributed.coordinator_address = ""  # host:port of process 0; "" = one process (unless auto)
  c.distributed.num_processes = 1
  c.distributed.process_id = 0
  c.distributed.local_device_ids = ""     # "0,1,...,7": this process's GPUs ("" = JAX decides)
  c.distributed.heartbeat_timeout_s = 60  # a peer silent this long ends the run
  c.distributed.initialization_timeout_s = 300  # waiting for every process to join

  c.data = ml_collections.ConfigDict()
  c.data.source = "longtail"     # "longtail" (built-in task) or a .jsonl/.json/.parquet path
  c.data.prompt_key = ""         # "" = first of question/problem/prompt
  c.data.answer_key = ""         # "" = answer, or reward_model.ground_truth
  c.data.max_prompt_len = 512    # tokens; longer prompts are skipped and counted
  c.data.shuffle = True
  c.data.system_prompt = ""
  c.data.enable_thinking = False
  c.data.task = ml_collections.ConfigDict()  # the built-in task (data.source = "longtail")
  c.data.task.ring_size = 64     # symbols on the ring; walks are at most this long
  c.data.task.median = 8.0       # answer lengths: log-normal with this median ...
  c.data.task.sigma = 0.9        # ... and this sigma of the log (the tail's weight)

  c.rollout = ml_collections.ConfigDict()
  c.rollout.batch_size = 8                   # N: prompt groups per training step
  c.rollout.n_samples_per_prompt = 4         # n
  c.rollout.over_sampling_batch_size = 16    # N' >= N: groups admitted per step
  c.rollout.partial_rollout = True           # False: the synchronous baseline
  c.rollout.resume_mode = "kv"               # kv | recompute
  c.rollout.max_staleness = config_dict.placeholder(int)  # policy versions; None = unlimited
  c.rollout.num_slots = 32
  c.rollout.sync_every = 16                  # decode steps per host round trip
  c.rollout.max_response_len = 256
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0
  c.rollout.dynamic_sampling = False         # DAPO: drop groups whose rewards are equal
  c.rollout.reward = "math"
  c.rollout.reward_timeout_s = 10.0
  c.rollout.reward_fallback = 0.0
  c.rollout.reward_workers = 2

  c.train = ml_collections.ConfigDict()
  c.train.advantage = "grpo"                 # grpo | drgrpo
  c.train.policy_loss = "ppo_clip"           # ppo_clip | gspo
  # Unset (None): the policy loss's own clips and aggregation, PPO's 0.2 / eps_clip /
  # token_mean or GSPO's 3e-4 / 4e-4 / seq_mean_token_mean.
  c.train.eps_clip = config_dict.placeholder(float)
  c.train.eps_clip_high = config_dict.placeholder(float)  # DAPO's clip-higher: 0.28
  c.train.dual_clip_c = config_dict.placeholder(float)  # None = off; e.g. 3.0
  c.train.aggregation = config_dict.placeholder(str)  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
  c.train.norm_len = config_dict.placeholder(int)  # Dr.GRPO's constant normaliser (tokens)
  c.train.kl_coef = 0.0                      # 0: no reference params are held
  c.train.kl_type = "low_var_kl"             # k1 | k3 | low_var_kl
  c.train.entropy_coef = 0.0
  c.train.tis_cap = 2.0                      # truncated importance sampling cap; 0 = off
  c.train.mask_stale_tokens = False          # drop tokens of older policy versions from the loss
  c.train.overlong_buffer_len = config_dict.placeholder(int)  # DAPO overlong shaping
                                                              # (tokens); None = off
  c.train.overlong_penalty_factor = 1.0
  c.train.lr = 1e-6
  c.train.lr_schedule = "constant"           # constant | cosine
  c.train.warmup_steps = 0
  c.train.min_lr_ratio = 0.1
  c.train.weight_decay = 0.0
  c.train.b1 = 0.9
  c.train.b2 = 0.999
  c.train.max_grad_norm = 1.0
  c.train.num_minibatches = 1                # optimizer updates per RL step (per epoch)
  c.train.num_microbatches = 1               # gradient accumulation per update
  c.train.microbatch_by_length = True        # rows sorted by length, each microbatch cut to
                                             # its own padded length (needs microbatches > 1)
  c.train.ppo_epochs = 1
  c.train.logprob_chunk = 512                # sequence chunk for logits (memory bound)
  c.train.warm_up = False                    # compile the update for every length bucket
                                             # ahead of time (from shapes; nothing runs)
  c.train.sft_steps = 0                      # supervised warm-start steps (built-in task)
  c.train.sft_lr = 1e-3
  c.train.sft_batch_size = 32

  c.eval = ml_collections.ConfigDict()
  c.eval.path = ""                           # "" = held-out built-in task prompts
  c.eval.num_prompts = 32
  c.eval.k = 4                               # avg@k samples per prompt; 0 = greedy only
  c.eval.temperature = 0.6
  c.eval.top_p = 1.0                         # nucleus of the avg@k samples
  return c
