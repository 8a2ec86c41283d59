"""APRIL rollouts: the scheduler, the partial buffer, reward threads, step metrics, and the
rollout as the learner holds it (base.py: colocated, threaded, in another process)."""

from april_jax.rollout.buffer import PartialBuffer
from april_jax.rollout.group import Group
from april_jax.rollout.metrics import rollout_metrics
from april_jax.rollout.reward_runner import RewardRunner
from april_jax.rollout.scheduler import AprilScheduler, RolloutResult, RolloutSettings
