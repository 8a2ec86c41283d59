"""A short supervised warm-start (cross-entropy on reference answers) before RL.

Used by the tiny config so that RL starts from a policy that sometimes succeeds on the
built-in task; a pretrained Qwen3 does not need it.

It runs on the learner's own update (rl/update.py), not a second training step: with
every advantage 1 and the ratio at 1 (one epoch, old logprobs = current), the PPO loss
-A * ratio, averaged over tokens, has the gradient of the token-mean cross-entropy. The
optimizer is plain Adam at `train.sft_lr` (no clipping, no weight decay, no KL).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from april_jax import sharding
from april_jax.models import qwen3
from april_jax.rl.update import Learner

# The train section overrides that turn the RL update into supervised learning: a plain
# PPO token mean with no extra terms, Adam at a constant rate, one update per batch.
SFT_LOSS = dict(policy_loss="ppo_clip", aggregation="token_mean", eps_clip=0.2)
SFT_LOSS.update(eps_clip_high=None, dual_clip_c=None, tis_cap=0.0, mask_stale_tokens=False)
SFT_LOSS.update(is_mode="truncate", is_low=0.0, ratio_anchor="proximal", reward_kl_coef=0.0)
SFT_LOSS.update(advantage="grpo")  # unused (the batch brings its own), but no critic's
SFT_LOSS.update(kl_coef=0.0, entropy_coef=0.0)
SFT_OPTIMIZER = dict(lr_schedule="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0)
SFT_OPTIMIZER.update(b1=0.9, b2=0.999)
SFT_BATCHING = dict(num_minibatches=1, num_microbatches=1, microbatch_by_length=False)
SFT_BATCHING.update(packing=False)
SFT_BATCHING.update(ppo_epochs=1)


def _cross_entropy(learner: Learner, batch: dict[str, np.ndarray]) -> float:
  logp = learner.logprobs(learner.params, batch)
  return float(-np.sum(logp * batch["mask"]) / max(batch["mask"].sum(), 1.0))


def warm_start(
    model_cfg: qwen3.Qwen3Config,
    params,
    batches: Iterable,
    train,
    *,
    mesh=None,
    rules=sharding.TRAIN_RULES,
    compute_dtype: str = "float32",
):
  """One update per batch (tokens, targets, mask [B, T]); returns (float32 params, the
  cross-entropy of the first batch before and of the last batch after)."""
  sft_train = dataclasses.replace(
      train, **SFT_LOSS, **SFT_OPTIMIZER, **SFT_BATCHING, lr=train.sft_lr
  )
  batches = list(batches)
  learner = Learner(
      model_cfg,
      params,
      sft_train,
      1.0,
      total_updates=len(batches),
      mesh=mesh,
      rules=rules,
      compute_dtype=compute_dtype,
  )
  del params  # donated to the learner
  losses = []
  for i, (tokens, targets, mask) in enumerate(batches):
    mask = np.asarray(mask, np.float32)
    batch = {
        "tokens": np.asarray(tokens),
        "targets": np.asarray(targets),
        "mask": mask,
        "behavior": np.zeros_like(mask),
        "stale": np.zeros(mask.shape, bool),
        "advantages": np.ones(mask.shape[0], np.float32),
    }
    if i == 0:
      losses.append(_cross_entropy(learner, batch))
    learner.update(batch)
  losses.append(_cross_entropy(learner, batch))
  return learner.params, losses
