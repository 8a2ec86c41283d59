"""RL objectives: advantage estimators and policy losses (registries), and the jitted update."""

from april_jax.rl.advantages import (ADVANTAGES, get_advantage, overlong_penalty,
                                     register_advantage)
from april_jax.rl.losses import (AGGREGATIONS, GSPO_EPS_CLIP, GSPO_EPS_CLIP_HIGH,
                                 KL_PENALTIES, POLICY_LOSSES, LossConfig, aggregate,
                                 batch_totals, effective_mask, get_policy_loss, kl_penalty,
                                 policy_loss, register_policy_loss, validate_loss_config)

__all__ = ["ADVANTAGES", "AGGREGATIONS", "GSPO_EPS_CLIP", "GSPO_EPS_CLIP_HIGH",
           "KL_PENALTIES", "LossConfig", "POLICY_LOSSES", "aggregate", "batch_totals",
           "effective_mask", "get_advantage", "get_policy_loss", "kl_penalty",
           "overlong_penalty", "policy_loss", "register_advantage", "register_policy_loss",
           "validate_loss_config"]
