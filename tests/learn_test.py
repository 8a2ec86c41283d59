"""The learner's seam: a read-only TrainBatch built once from a step's groups, and
rl/learn.py's `learn(state, batch, learners)`, the one place advantages are derived."""

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.models import qwen3
from april_jax.rl import advantages, learn
from april_jax.rl import critic as critic_lib
from april_jax.rl.batch import TrainBatch
from april_jax.rl.update import Learner
from april_jax.rollout.group import Group
from april_jax.settings.train import TrainSettings
from conftest import tiny_qwen3
import learner_batches

CFG = tiny_qwen3()
PACKAGE = Path(__file__).resolve().parent.parent / "april_jax"


def _train(**overrides):
  return dataclasses.replace(TrainSettings(), **{"lr": 1e-3, "logprob_chunk": 16, **overrides})


def _groups(rewards_GxN, response_lens):
  """Scored groups of hand-made samples: prompts of 3 tokens, these response lengths."""
  groups = []
  for g, (rewards, lens) in enumerate(zip(rewards_GxN, response_lens)):
    prompt = np.array([5, 6, 7 + g], np.int32)
    samples = []
    for R in lens:
      response = np.append(np.full(R - 1, 9, np.int32), learner_batches.STOP)
      logprobs = np.full(R, -2.0, np.float32)
      samples.append(learner_batches.sample(prompt, response, logprobs, np.ones(R, np.int32)))
    groups.append(Group(g, g, prompt, "", samples, first_step=0, rewards=list(rewards)))
  return groups


def test_a_train_batch_is_read_only_and_its_own_copy():
  groups = _groups([[1.0, 0.0], [0.0, 0.0]], [[4, 6], [2, 9]])
  batch = TrainBatch.from_groups(groups, version=1)
  assert batch.tokens.shape == (4, 32) and batch.rewards.shape == (2, 2)
  np.testing.assert_array_equal(batch.lengths, [[4, 6], [2, 9]])
  for name in ("tokens", "mask", "behavior", "stale", "rewards", "lengths"):
    with pytest.raises(ValueError, match="read-only"):
      getattr(batch, name)[0] = 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    batch.rewards = np.zeros((2, 2))  # pylint: disable=attribute-defined-outside-init
  rows = {k: np.array(v) for k, v in batch.rows().items()}
  made = TrainBatch(**rows, rewards=np.zeros((2, 2)), lengths=np.ones((2, 2)), version=1)
  rows["tokens"][:] = 0  # the caller's arrays change; the batch's do not
  assert made.tokens.any()


def test_a_train_batch_refuses_unscored_groups_and_mismatched_shapes():
  groups = _groups([[1.0, 0.0]], [[4, 6]])
  groups[0].rewards = None
  with pytest.raises(ValueError, match=r"groups \[0\] have no rewards"):
    TrainBatch.from_groups(groups, version=0)
  rows = TrainBatch.from_groups(_groups([[1.0, 0.0]], [[4, 6]]), version=0).rows()
  with pytest.raises(ValueError, match=r"TrainBatch.rewards is \(3,\)"):
    TrainBatch(**rows, rewards=np.zeros(3), lengths=np.ones((1, 2)), version=0)
  with pytest.raises(ValueError, match=r"TrainBatch.mask is \(2, 5\)"):
    TrainBatch(**dict(rows, mask=np.zeros((2, 5))), rewards=np.zeros((1, 2)),
               lengths=np.ones((1, 2)), version=0)  # fmt: skip


def test_the_overlong_penalty_is_in_the_batchs_rewards():
  t = _train(overlong_buffer_len=4, overlong_penalty_factor=1.0)
  groups = _groups([[1.0, 1.0]], [[4, 8]])  # at most 10 tokens: 8 is 2 into the last 4
  batch = TrainBatch.from_groups(groups, 0, train=t, max_response_len=10)
  np.testing.assert_allclose(batch.rewards, [[1.0, 1.0 - 2 / 4]])


@pytest.fixture(scope="module")
def params():
  return qwen3.init_params(CFG, jax.random.key(0), std=0.3)


def test_learn_derives_the_estimators_advantages_and_updates_as_the_policy_alone_would(params):
  rows = learner_batches.random_batch(3, CFG.vocab_size)
  batch = learner_batches.train_batch(rows, 4)
  t = _train(advantage="rloo")
  a = Learner(CFG, jax.tree.map(jnp.copy, params), t, 0.8, 2)
  b = Learner(CFG, jax.tree.map(jnp.copy, params), t, 0.8, 2)
  learners = learn.Learners(a)
  new, metrics = learn.learn(learners.state(), batch, learners)
  learners.put(new)
  assert new.policy.attempted == 1 and new.critic is None
  rloo = advantages.rloo_advantages(batch.rewards)  # r_i - mean of the others
  np.testing.assert_allclose(
      np.asarray(rloo)[0], batch.rewards[0] - (batch.rewards[0].sum() - batch.rewards[0]) / 3,
      rtol=1e-6,
  )  # fmt: skip
  by_hand = b.update(batch.with_advantages(rloo))
  assert metrics == pytest.approx(by_hand)
  jax.tree.map(np.testing.assert_array_equal, a.params, b.params)


def test_learn_with_a_critic_gives_gae_advantages_and_trains_both(params):
  rows = learner_batches.random_batch(4, CFG.vocab_size)
  batch = learner_batches.train_batch(rows, 4)
  t = _train(advantage="gae", critic_lr=1e-2)
  learner = Learner(CFG, jax.tree.map(jnp.copy, params), t, 0.8, 2)
  critic = critic_lib.Critic(CFG, params, t, 2)
  before = jax.tree.map(np.array, critic.params)
  metrics = learner_batches.learn_once(batch, learner, critic)
  # A zero value head: the first values are 0, so each token's return is its reward.
  assert metrics["critic/values_mean"] == 0.0
  live = batch.mask > 0
  expected = np.repeat(batch.rewards.reshape(-1), live.sum(1))
  assert metrics["critic/returns_mean"] == pytest.approx(expected.mean(), rel=1e-5)
  assert metrics["critic/value_loss"] > 0 and metrics["train/updates"] == 1
  head = critic.params[critic_lib.HEAD]["w"]
  assert np.abs(np.asarray(head) - before[critic_lib.HEAD]["w"]).max() > 0


def _calls(tree: ast.AST) -> set[str]:
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      f = node.func
      names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
  return names


def test_advantages_are_derived_in_one_place():
  """The estimators, REINFORCE++'s per-token KL returns and GAE are called from
  rl/learn.py alone (rl/advantages.py and rl/critic.py define them)."""
  derived = {"get_advantage", "reinforce_pp_kl_advantages", "gae", "whiten_tokens"}
  callers = {}
  for path in PACKAGE.rglob("*.py"):
    found = _calls(ast.parse(path.read_text())) & derived
    if found:
      callers[str(path.relative_to(PACKAGE))] = found
  allowed = {"rl/learn.py", "rl/advantages.py"}
  assert set(callers) <= allowed, callers
  assert callers["rl/learn.py"] == derived
