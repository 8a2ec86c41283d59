"""One learner step: a step's TrainBatch in, the policy (and PPO's critic) updated.

  learn(state, batch, learners) -> (state, metrics)

    layout      the batch's pieces (rl/layout.py), decided by its mask, shared by every
                pass and update below
    passes      under the state's params: the policy's old logprobs and importance
                weights, the reference's logprobs where a KL term needs them
                (Learner.passes); the critic's values (PPO)
    advantages  `advantages`: every estimator's, here and nowhere else
    updates     the policy's (Learner.optimize), then the critic's (Critic.optimize)

`state` is what the step changes (the policy's and the critic's ModelState); `learners`
what it does not (programs, frozen and reference weights). A state given to `learn` is
consumed (its arrays are donated to the updates); use the one it returns. A step that
raises partway leaves no usable state: a run stops there (the trainer saves nothing after
an error), and resumes from its last checkpoint. The trainer
calls it once per RL step; it is the seam a learner running apart from the rollout
calls with batches the rollout hands it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from april_jax.rl import advantages as advantages_lib
from april_jax.rl import critic as critic_lib
from april_jax.rl import step
from april_jax.rl.batch import TrainBatch
from april_jax.rl.update import Learner, Passes, trained_mask


@dataclasses.dataclass(frozen=True)
class LearnState:
  """What one learner step changes: the policy's state, and PPO's critic's (else None)."""

  policy: step.ModelState
  critic: step.ModelState | None = None


@dataclasses.dataclass(frozen=True)
class Learners:
  """What a learner step runs and reads but never changes: the policy's learner and PPO's
  critic (None without one). They also hold the current state, which checkpoints save:
  `state()` reads it, `put` replaces it."""

  policy: Learner
  critic: critic_lib.Critic | None = None

  def state(self) -> LearnState:
    critic = None if self.critic is None else self.critic.model_state()
    return LearnState(self.policy.model_state(), critic)

  def put(self, state: LearnState) -> None:
    self.policy.set_model_state(state.policy)
    if self.critic is not None:
      self.critic.set_model_state(state.critic)

  def checkpoint(self) -> tuple[dict, dict]:
    """What a checkpoint keeps of them: the policy's arrays and host record, the
    critic's under "critic" when there is one."""
    arrays, host = self.policy.state()
    if self.critic is not None:
      arrays["critic"], host["critic"] = self.critic.state()
    return arrays, host

  def restore(self, arrays: dict, host: dict) -> None:
    """Back to a `checkpoint()` (a LoRA one over another base is refused)."""
    self.policy.restore(arrays, host)
    if self.critic is not None:
      self.critic.restore(arrays["critic"], host["critic"])


@dataclasses.dataclass(frozen=True)
class Advantages:
  """A step's advantages ([B] per sample, or [B, T] per token), the critic's value
  targets (returns [B, T], PPO only) and metrics."""

  values: np.ndarray
  returns: np.ndarray | None = None
  metrics: dict = dataclasses.field(default_factory=dict)


def critic_advantages(train, rewards_B, mask_BxT, old_values_BxT, stale_BxT=None) -> Advantages:
  """GAE over the critic's values (rl/critic.py), whitened over the trained tokens when
  train.gae_whiten (by train.whitening); critic/* metrics on the drawn tokens."""
  adv, returns = critic_lib.gae(
      rewards_B, old_values_BxT, mask_BxT, train.gae_gamma, train.gae_lambda
  )
  trained = trained_mask(train, mask_BxT, stale_BxT)
  whitened = (
      advantages_lib.whiten_tokens(adv, trained, whitening=train.whitening)
      if train.gae_whiten
      else adv
  )
  live = mask_BxT > 0
  v, r = old_values_BxT[live], returns[live]
  explained = 1.0 - np.var(r - v) / np.var(r) if r.size and np.var(r) > 0 else 0.0
  metrics = {
      "critic/values_mean": float(v.mean()) if v.size else 0.0,
      "critic/returns_mean": float(r.mean()) if r.size else 0.0,
      "critic/advantages_mean": float(adv[live].mean()) if v.size else 0.0,
      "critic/explained_variance": float(explained),
  }
  return Advantages(whitened, returns, metrics)


def advantages(train, batch: TrainBatch, passes: Passes, old_values_BxT=None) -> Advantages:
  """The step's advantages, by train.advantage: GAE over the critic's values (given
  old_values_BxT); REINFORCE++ with the KL to the reference in each token's return
  (train.reward_kl_coef > 0, from the passes' old and reference logprobs); else the
  named estimator over each group's rewards (rl/advantages.py)."""
  if train.advantage in advantages_lib.CRITIC_ADVANTAGES:
    rewards = batch.rewards.reshape(-1)
    return critic_advantages(train, rewards, batch.mask, old_values_BxT, batch.stale)
  if train.reward_kl_coef > 0:
    drawn = batch.mask > 0
    per_token = advantages_lib.reinforce_pp_kl_advantages(
        batch.rewards.reshape(-1),
        passes.old_logp,
        passes.ref_logp,
        drawn,
        train.reward_kl_coef,
        whiten_mask=trained_mask(train, drawn, batch.stale),
        whitening=train.whitening,
    )
    return Advantages(per_token)
  estimator = advantages_lib.get_advantage(train.advantage)
  per_sample = estimator(batch.rewards, lengths_GxN=batch.lengths, whitening=train.whitening)
  return Advantages(np.asarray(per_sample).reshape(-1))


def learn(
    state: LearnState, batch: TrainBatch, learners: Learners
) -> tuple[LearnState, dict[str, float]]:
  """One RL step's learning (see the module docstring): the new state and the step's
  train/* and critic/* metrics."""
  policy, critic = learners.policy, learners.critic
  rows = batch.rows()
  plan = policy.plan(rows)
  passes = policy.passes(state.policy, rows, plan)
  values = None if critic is None else critic.values(rows, plan, params=state.critic.params)
  adv = advantages(policy.train, batch, passes, values)
  policy_state, metrics = policy.optimize(state.policy, rows, passes, adv.values, plan)
  metrics = {**adv.metrics, **metrics}
  critic_state = None
  if critic is not None:
    critic_state, critic_metrics = critic.optimize(state.critic, rows, values, adv.returns, plan)
    metrics.update(critic_metrics)
  return LearnState(policy_state, critic_state), metrics
