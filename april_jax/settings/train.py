"""The `train` section: the objective (estimator, policy loss, clips, KL terms), the
corrections for stale tokens, the optimizer and how an RL step's batch is split, and
`train.lora`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoraSettings:
  """train.lora: LoRA adapters instead of a full fine-tune (models/lora.py)."""

  # Adapters of this rank are trained (float32, AdamW) and the base model stays frozen in
  # model.dtype; 0 = no LoRA, every weight trains
  rank: int = 0
  alpha: float = 32.0  # the update is (alpha / rank) B A
  targets: str = "q,k,v,o,gate,up,down"  # the adapted projections, comma-separated
  lr: float = 1e-5  # the adapters' AdamW learning rate (train.lr is the full fine-tune's)
  # How the sampler decodes: merged (a copy of the base with the adapters merged in, made
  # once per update) | unmerged (the base itself, the adapters applied in every decode
  # step: no second copy of the base, room for more KV; one device only)
  decode: str = "merged"


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  # grpo | drgrpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline, or gae: PPO
  # with a learned critic (rl/critic.py, the knobs below)
  advantage: str = "grpo"
  critic_path: str = ""  # a Qwen3 folder to start the critic from; "" = the policy's weights
  critic_lr: float = 1e-5  # the critic's learning rate
  value_clip: float = 0.2  # around the values at the start of the update; 0 = no clip
  gae_gamma: float = 1.0  # GAE's discount
  gae_lambda: float = 1.0  # GAE's lambda
  gae_whiten: bool = True  # advantages whitened over the batch's trained tokens
  # How REINFORCE++ and GAE whiten over tokens: bessel (verl's and slime's: the unbiased
  # variance, 1e-8 inside the root) | population ((x - mu) / (sigma + eps), the population
  # std, eps outside the root)
  whitening: str = "bessel"
  # ppo_clip | gspo | clip_cov | kl_cov | gmpo | cispo (docs/algorithms.md)
  policy_loss: str = "ppo_clip"
  # Unset (None): the policy loss's own clips and aggregation: PPO's 0.2 / eps_clip /
  # token_mean, GSPO's 3e-4 / 4e-4 / seq_mean_token_mean, GMPO's 0.4 / 0.4 (on the
  # log-ratio) / seq_mean_token_mean, CISPO's 1.0 / 0.2 (no lower bound).
  eps_clip: float | None = None
  eps_clip_high: float | None = None  # DAPO's clip-higher: 0.28
  # None = off (slime's default); 3.0 is verl's (always on there). ppo_clip and clip_cov.
  dual_clip_c: float | None = None
  # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm
  # (Dr. GRPO as its paper: / (sequences x norm_len)) | token_sum_norm (verl's
  # seq-mean-token-sum-norm: / norm_len)
  aggregation: str | None = None
  norm_len: int | None = None  # Dr.GRPO's constant normaliser (tokens)
  # clip_cov / kl_cov (arXiv 2505.22617): the fraction of the step's trained tokens
  # selected by the covariance of advantage and logprob (at least one)
  cov_ratio: float = 2e-4
  clip_cov_lb: float = 1.0  # clip_cov picks among covariances in (clip_cov_lb, clip_cov_ub)
  clip_cov_ub: float = 5.0  # (above)
  kl_cov_coef: float = 0.1  # kl_cov: the coefficient of |log ratio| on the selected tokens
  kl_coef: float = 0.0  # the KL loss term; 0 (and reward_kl_coef 0): no reference params held
  # REINFORCE++'s KL in the reward (advantage reinforce_plus_plus only): each drawn token's
  # reward -reward_kl_coef * (logp - ref_logp); 0 = off
  reward_kl_coef: float = 0.0
  kl_type: str = "low_var_kl"  # k1 | k2 | k3 (= low_var_kl, clamped) | low_var_kl | abs
  entropy_coef: float = 0.0  # an entropy bonus in the loss; 0 = off
  # Stale-data corrections (rl/corrections.py). Each token's term is weighted by
  # w = pi_prox / pi_behav (the learner's logprob at the start of the update over the
  # sampler's), at is_level token | sequence | geometric; is_mode truncate: min(w, tis_cap)
  # (TIS); mask: w inside [is_low, tis_cap], outside the token or sample leaves the loss
  # (IcePop: token, 0.5, 5; MIS: sequence or geometric). tis_cap 0 = no weight.
  tis_cap: float = 2.0
  is_level: str = "token"  # token | sequence | geometric (above)
  is_mode: str = "truncate"  # truncate | mask (above)
  is_low: float = 0.0  # mask's lower bound (above)
  # The ratio's anchor: proximal (the params at the start of the update; with a weight
  # this is decoupled PPO) | behavior (the sampler's logprobs: coupled PPO, no old-logprob
  # pass, tis_cap must be 0).
  ratio_anchor: str = "proximal"
  # Tokens drawn by an older policy version leave the loss (slime's
  # --mask-offpolicy-in-partial-rollout: the tokens a partial sample drew before it was cut).
  mask_stale_tokens: bool = False
  overlong_buffer_len: int | None = None  # DAPO's, in tokens; None = off
  overlong_penalty_factor: float = 1.0  # the overlong penalty at the budget's end
  lr: float = 1e-6  # AdamW's peak learning rate
  lr_schedule: str = "constant"  # constant | cosine
  warmup_steps: int = 0  # linear warm-up, in updates
  min_lr_ratio: float = 0.1  # cosine: the last learning rate / lr
  weight_decay: float = 0.0  # AdamW's
  b1: float = 0.9  # AdamW's
  b2: float = 0.999  # AdamW's
  # AdamW's two moments are kept in float32 | bfloat16 (computed in float32 either way):
  # bfloat16 halves the learner's largest arrays (rl/step.py, docs/moe.md).
  moments_dtype: str = "float32"
  # A mixture-of-experts model's load-balancing loss (Switch's, as transformers' Qwen3-MoE
  # computes it) added to the policy loss with this weight: 0 = off, as RL recipes set it.
  router_aux_loss_coef: float = 0.0
  max_grad_norm: float = 1.0  # gradients clipped to this global norm
  num_minibatches: int = 1  # optimizer updates per RL step (per epoch)
  num_microbatches: int = 1  # gradient accumulation per update
  # Samples packed end to end into rows of pack_len tokens (rl/layout.py): a microbatch is
  # B / (num_minibatches x num_microbatches) such rows, as many microbatches as the tokens
  # need; each sample attends to itself only. pack_len 0: data.max_prompt_len +
  # rollout.max_response_len. Off: a row per sample, padded.
  packing: bool = True
  pack_len: int = 0  # tokens a packed row holds (above)
  # Unpacked: rows sorted by length, each microbatch cut to its own padded length.
  microbatch_by_length: bool = True
  ppo_epochs: int = 1  # passes over the batch per step
  logprob_chunk: int = 512  # sequence chunk for logits (memory bound)
  warm_up: bool = False  # compile the update for every length bucket ahead of time
  sft_steps: int = 0  # supervised warm-start steps (built-in task)
  sft_lr: float = 1e-3  # the warm start's learning rate
  sft_batch_size: int = 32  # the warm start's demonstrations per step
  lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)
  lora_path: str = ""  # a PEFT LoRA folder to start the adapters from (matching train.lora)
