"""Qwen3-8B with DAPO on DAPO-Math-17k: APRIL's own DAPO setting, exactly.

  python -m april_jax.main --config=configs/qwen3_8b.py --workdir=runs/qwen3_8b \
      --config.model.path=/models/Qwen3-8B \
      --config.data.source=/data/dapo-math-17k.parquet \
      --config.eval.path=/data/aime24.jsonl

As APRIL's DAPO scripts: N = 32 prompt groups of n = 8 per step, N' = 64 admitted,
responses up to 16,384 tokens at temperature 0.8, DAPO's dynamic sampling and
clip-higher 0.2 / 0.28, GRPO advantages, a per-sample mean of token means, one optimizer
step per rollout (the whole 256-sample batch), Adam lr 1e-6 constant, beta2 0.98,
weight decay 0.1; no KL, no importance-sampling correction, no overlong shaping and no
staleness limit. Evaluation: avg@16 on AIME-2024 at temperature 0.8, top-p 0.7 (and
greedy pass@1). Params in bfloat16, sharded fully (FSDP) over every device.

Variants, joined by '+' (`--config=configs/qwen3_8b.py:baseline`, `...:tis+overlong`):
  baseline   the synchronous baseline: partial_rollout=False, N' = N = 32
  tis        truncated importance sampling, weights capped at 2 (partial samples were
             drawn by older params)
  overlong   DAPO's overlong shaping over the last 1,024 tokens of the budget
  stale4     the staleness limit: no trained token more than 4 versions old
  ppo        PPO with a learned critic (GAE) instead of GRPO's group advantages
  async      rollout and learner on their own devices, overlapped (docs/async.md): the
             rollout on 4 GPUs (tensor parallel 4, 256 slots), the learner on the other
             4 (FSDP, twice the microbatches), versions at most 2 behind
  lora       LoRA (rank 32 on every projection, the base frozen, decoded unmerged) on
             ONE 80 GB GPU: 64 slots sharing 784 KV pages (`lora+ppo`: 768)
configs/qwen3_4b.py takes the same variants with the 4B model.
"""

from april_jax.settings import base
from april_jax.settings.qwen3_shapes import QWEN3_SHAPES


def _baseline(c):
  c.rollout.partial_rollout = False
  c.rollout.over_sampling_batch_size = c.rollout.batch_size


def _tis(c):
  c.train.tis_cap = 2.0


def _overlong(c):
  c.train.overlong_buffer_len = 1024
  c.train.overlong_penalty_factor = 1.0


def _stale4(c):
  c.rollout.max_staleness = 4


def _ppo(c):
  # PPO with a learned critic (rl/critic.py), started from the policy's weights: GAE with
  # gamma = lambda = 1 (advantage = reward - value), value clip 0.2, critic lr 1e-5. No
  # dynamic sampling: a critic gives a group of equal rewards nonzero advantages.
  c.train.advantage = "gae"
  c.train.critic_lr = 1e-5
  c.train.value_clip = 0.2
  c.train.gae_gamma = 1.0
  c.train.gae_lambda = 1.0
  c.rollout.dynamic_sampling = False
  if c.train.lora.rank > 0:  # lora+ppo or ppo+lora: the critic takes some of the pool
    _lora_pool(c)


def _lora(c):
  # LoRA on ONE 80 GB GPU: adapters of rank 32 on all seven projections, the bfloat16
  # base frozen. The recipe of "LoRA Without Regret" (Schulman et al., 2025): every
  # layer, MLP included; alpha 32 (the update is (32 / rank) B A), with which the best
  # learning rate barely depends on the rank; and that rate about 10x full fine-tuning's,
  # RL included: 1e-5 against this config's 1e-6. In RL even rank 1 matched a full
  # fine-tune there, so rank 32 is capacity to spare. The same AdamW otherwise (beta2
  # 0.98, weight decay 0.1, which pulls the adapters toward the base).
  c.train.lora.rank = 32
  c.train.lora.alpha = 32.0
  c.train.lora.targets = "q,k,v,o,gate,up,down"
  c.train.lora.lr = 1e-5
  # The sampler reads the frozen base and applies the adapters in each decode step: no
  # second copy of the base, so 2.2x the KV pool of a merged decode copy (784 pages
  # against 360) for +1% of a decode step's FLOPs and +2.6% of its bytes (compiled at
  # this shape; 1.07x the merged step's time on a CPU): python -m april_jax.bench
  # --mode=lora_decode, BENCHMARKS.md. train.lora.decode=merged with kv_pages=360 is the
  # other way.
  c.train.lora.decode = "unmerged"
  c.mesh.shape = (1, 1, 1)
  c.train.num_microbatches = 256  # one packed row of 17,408 tokens per gradient call
  c.rollout.num_slots = 64
  _lora_pool(c)


def _lora_pool(c):
  # The KV pool beside the LoRA learner on one 80 GB device: the frozen base (16.4 GB),
  # the adapters and their AdamW (1.0 GB), and the gradients program's 31.3 GB (one row
  # of 17,408 tokens, compiled) leave 784 pages of 256 positions (29.6 GB: 11 sequences at
  # max_len, about 64 at a DAPO-like mean of 3.1k) for 64 slots; PPO's critic (its
  # adapters, head and AdamW, 1.0 GB) leaves 768 (python -m april_jax.plan
  # --config=configs/qwen3_8b.py:lora --compile --devices=1 --device_memory_gb=80: 79.7 GB).
  c.rollout.kv_pages = 768 if c.train.advantage == "gae" else 784


def _async(c):
  # Split 4 + 4: the split `python -m april_jax.plan --config=configs/qwen3_8b.py
  # --devices=8 --device_memory_gb=80 --rollout_s=R --learn_s=L --rollout_scaling=a`
  # chooses for this model (4 is the only k that shards its 32 heads and 8 KV heads and
  # leaves the learner room). Each learner device keeps its 1 row per gradient call: 64
  # microbatches. The rollout mesh holds only the decode copy (4.1 GB a device), so the
  # KV pool grows to 6,144 pages of 256 positions (1.6M positions for 256 slots; the plan
  # allows 7,476, the rest is the compile check's margin). Versions
  # at most 2 behind: 1 for the pipeline, 1 more for a partial continued next step.
  c.mesh.rollout_devices = 4
  c.mesh.rollout_shape = (1, 1, 4)
  c.train.num_microbatches = 64
  c.rollout.num_slots = 256
  c.rollout.kv_pages = 6144
  c.rollout.max_staleness = 2


VARIANTS = {
    "async": _async,
    "baseline": _baseline,
    "tis": _tis,
    "overlong": _overlong,
    "stale4": _stale4,
    "ppo": _ppo,
    "lora": _lora,
}


def apply_variants(c, arg, path="configs/qwen3_8b.py"):
  """Applies the '+'-joined variants of `arg` ('' or None: none) to config c."""
  for name in filter(None, (arg or "").split("+")):
    if name not in VARIANTS:
      raise ValueError(f"{path} variant {name!r}: one of {sorted(VARIANTS)}, joined by '+'")
    VARIANTS[name](c)
  return c


def get_config(arg=None):
  c = base.get_config()
  c.seed = 0
  c.num_steps = 400
  c.checkpoint_every = 20
  c.eval_every = 20

  c.model.path = ""  # required: a Qwen3-8B HF folder
  c.model.init.update(QWEN3_SHAPES["qwen3_8b"])  # its shape, for the planner
  c.model.dtype = "bfloat16"
  c.model.kv_dtype = "bfloat16"
  c.model.remat = True
  c.mesh.shape = (1, -1, 1)

  c.data.source = ""  # required: DAPO-Math-17k (parquet) or another math set
  c.data.max_prompt_len = 1024
  c.data.system_prompt = ""
  c.data.enable_thinking = False

  c.rollout.batch_size = 32
  c.rollout.n_samples_per_prompt = 8
  c.rollout.over_sampling_batch_size = 64
  c.rollout.partial_rollout = True
  c.rollout.resume_mode = "kv"
  c.rollout.max_staleness = None
  # The KV page pool: 4,352 pages of 256 positions per device (20.6 GB, what 8 x 80 GB
  # hold beside training: 64 sequences at max_len, about 350 at a DAPO-like mean of 3.1k)
  # shared by 256 slots; decode attention reads 128 live pages per chunk. When the pool
  # runs out, the youngest slot is preempted into the partial buffer.
  c.rollout.num_slots = 256
  c.rollout.page_size = 256
  c.rollout.kv_pages = 4352
  c.rollout.decode_block = 32768
  c.rollout.sync_every = 32
  c.rollout.max_response_len = 16384
  c.rollout.temperature = 0.8
  c.rollout.dynamic_sampling = True
  c.rollout.reward = "math_dapo"
  c.rollout.reward_workers = 8

  c.train.advantage = "grpo"
  c.train.policy_loss = "ppo_clip"
  c.train.eps_clip = 0.2
  c.train.eps_clip_high = 0.28
  c.train.aggregation = "seq_mean_token_mean"
  c.train.kl_coef = 0.0
  c.train.tis_cap = 0.0
  c.train.overlong_buffer_len = None
  c.train.lr = 1e-6
  c.train.lr_schedule = "constant"
  c.train.warmup_steps = 0
  c.train.weight_decay = 0.1
  c.train.b1 = 0.9
  c.train.b2 = 0.98
  c.train.num_minibatches = 1  # one optimizer step per rollout
  c.train.num_microbatches = 32  # 8 rows each: one per device on 8 GPUs
  c.train.logprob_chunk = 1024

  c.eval.num_prompts = 30  # AIME-2024
  c.eval.k = 16
  c.eval.temperature = 0.8
  c.eval.top_p = 0.7
  return apply_variants(c, arg)
