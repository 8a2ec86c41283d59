"""PPO's critic (rl/critic.py): GAE and the value loss against hand computations, the
value model's shape and start, and a critic whose value loss falls on a fixed batch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.errors import InputError
from april_jax.models import hf_io, qwen3
from april_jax.rl import advantages
from april_jax.rl import critic as critic_lib
from april_jax.rl.update import Learner
from april_jax.settings.train import TrainSettings
from conftest import TINY_HF_CONFIGS, mesh_or_skip, save_random_hf_qwen3, tiny_qwen3
from learner_batches import critic_update, gae

CFG = tiny_qwen3(tie_word_embeddings=False)  # an output head, which the critic drops


def test_gae_with_lambda_1_and_gamma_1_is_the_return_minus_the_value():
  mask = np.array([[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], np.float32)
  values = np.random.default_rng(0).normal(size=mask.shape)
  rewards = np.array([1.0, -0.5, 3.0])
  adv, returns = critic_lib.gae(rewards, values, mask, gamma=1.0, lam=1.0)
  live = mask > 0
  np.testing.assert_allclose(adv[live], (rewards[:, None] - values)[live], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(returns[live], np.broadcast_to(rewards[:, None], mask.shape)[live])
  assert not adv[~live].any() and not returns[~live].any()  # the empty row too


def test_gae_matches_a_hand_computation_and_skips_observation_tokens():
  # Drawn tokens at t = 0, 1 and 4 (t = 2, 3: an environment's observation), values
  # 0.5, 0.2, 0.4 there, reward 1 at the last drawn token; gamma 0.9, lambda 0.8.
  mask = np.array([[1, 1, 0, 0, 1, 0]], np.float32)
  values = np.array([[0.5, 0.2, 9.0, 9.0, 0.4, 9.0]])
  g, lam = 0.9, 0.8
  d3 = 1.0 - 0.4  # the last: no value after it
  d2 = 0.0 + g * 0.4 - 0.2
  d1 = 0.0 + g * 0.2 - 0.5
  a3 = d3
  a2 = d2 + g * lam * a3
  a1 = d1 + g * lam * a2
  adv, returns = critic_lib.gae(np.array([1.0]), values, mask, gamma=g, lam=lam)
  np.testing.assert_allclose(adv[0], [a1, a2, 0, 0, a3, 0], rtol=1e-6)
  np.testing.assert_allclose(returns[0], [a1 + 0.5, a2 + 0.2, 0, 0, a3 + 0.4, 0], rtol=1e-6)


def test_value_loss_clips_around_the_old_values_by_hand():
  v = jnp.array([[1.0, 0.0, 2.0]])
  old = jnp.array([[0.0, 0.0, 1.9]])
  ret = jnp.array([[2.0, 1.0, 0.0]])
  mask = jnp.array([[1.0, 1.0, 1.0]])
  # Token 0: V moved 1.0 past the clip 0.2 toward the return: clipped V 0.2 is further
  # from it, (0.2 - 2)^2 = 3.24 > (1 - 2)^2 = 1, so 3.24 counts (clipped). Token 1: 1.
  # Token 2: V - old = 0.1 inside the clip, 4.
  loss, metrics = critic_lib.value_loss(v, old, ret, mask, 0.2, jnp.float32(3))
  assert float(loss) == pytest.approx(0.5 * (3.24 + 1.0 + 4.0) / 3, rel=1e-6)
  assert float(metrics["value_clipfrac"]) == pytest.approx(1 / 3)
  unclipped, _ = critic_lib.value_loss(v, old, ret, mask, 0.0, jnp.float32(3))
  assert float(unclipped) == pytest.approx(0.5 * (1.0 + 1.0 + 4.0) / 3, rel=1e-6)


def test_whitened_advantages_have_zero_mean_unit_std_on_the_trained_tokens():
  mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  x = np.array([[1.0, 3.0, 99.0], [5.0, -7.0, 0.0]])
  for whitening, ddof in (("bessel", 1), ("population", 0)):  # verl's and slime's; the other
    w = advantages.whiten_tokens(x, mask, whitening=whitening)
    live = w[mask > 0]
    np.testing.assert_allclose([live.mean(), live.std(ddof=ddof)], [0.0, 1.0], atol=1e-6)
    assert not w[mask == 0].any()


def _train(**overrides):
  t = dict(critic_lr=3e-3, logprob_chunk=16, value_clip=0.0, advantage="gae")
  return dataclasses.replace(TrainSettings(), **{**t, **overrides})


def test_the_critic_starts_from_the_policy_backbone_at_value_zero():
  policy = qwen3.init_params(CFG, jax.random.key(0), std=0.3)
  critic = critic_lib.Critic(CFG, policy, _train(), total_updates=1)
  assert "lm_head" not in critic.params and critic.params["value_head"]["w"].shape == (32,)
  np.testing.assert_array_equal(critic.params["layers"]["q"], policy["layers"]["q"])
  tokens = np.arange(20, dtype=np.int32).reshape(2, 10) % 48
  batch = {"tokens": tokens, "mask": np.ones((2, 10), np.float32)}
  np.testing.assert_array_equal(critic.values(batch), np.zeros((2, 10)))


def test_the_value_loss_falls_on_a_fixed_batch():
  policy = qwen3.init_params(CFG, jax.random.key(1), std=0.3)
  critic = critic_lib.Critic(CFG, policy, _train(), total_updates=20)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 48, (8, 16)).astype(np.int32)
  mask = np.zeros((8, 16), np.float32)
  for b in range(8):
    mask[b, 4 : 6 + b] = 1.0  # responses of 2..9 tokens
  batch = {"tokens": tokens, "mask": mask}
  rewards = rng.choice([0.0, 1.0], 8)
  metrics = gae(critic, batch, rewards)
  assert metrics["critic/values_mean"] == 0.0 and batch["advantages"].shape == (8, 16)
  losses = [critic_update(critic, batch)["critic/value_loss"] for _ in range(20)]
  assert losses[0] == pytest.approx(
      0.5 * np.mean(np.repeat(rewards, mask.sum(1).astype(int)) ** 2), rel=1e-5
  )
  assert losses[-1] < 0.25 * losses[0], losses
  assert all(np.isfinite(losses))
  # After training, the critic's values move toward each sample's return.
  values = critic.values(batch)
  err = lambda v: np.abs(v - rewards[:, None])[mask > 0].mean()
  assert err(values) < 0.5 * err(np.zeros_like(values))


def test_the_policy_loss_takes_a_critics_per_token_advantages(tmp_path):
  del tmp_path
  policy = qwen3.init_params(CFG, jax.random.key(2), std=0.3)
  learner = Learner(CFG, jax.tree.map(jnp.copy, policy), _train(lr=1e-3), 1.0, 1)
  tokens = np.random.default_rng(1).integers(0, 48, (4, 16)).astype(np.int32)
  mask = np.zeros((4, 16), np.float32)
  mask[:, 3:9] = 1.0
  batch = {
      "tokens": tokens,
      "targets": np.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1),
      "mask": mask,
      "stale": np.zeros((4, 16), bool),
      "advantages": np.zeros((4, 16), np.float32),
  }
  batch["behavior"] = learner.logprobs(learner.params, batch)
  # Advantage on one token only: the update raises that token's logprob, leaves the rest
  # of the batch's tokens nearly as they were.
  batch["advantages"][0, 5] = 1.0
  before = batch["behavior"][0, 5]
  learner.update(batch)
  after = learner.logprobs(learner.params, batch)
  assert after[0, 5] > before + 1e-3


def test_a_critic_starts_from_a_model_folder_of_the_policys_shape_and_no_other(tmp_path):
  folder = save_random_hf_qwen3(tmp_path / "critic", **TINY_HF_CONFIGS["head_dim_decoupled"])
  cfg = hf_io.load_config(folder)
  params = critic_lib.load_backbone(str(folder), cfg)
  critic = critic_lib.Critic(cfg, params, _train(), total_updates=1)
  _, reference = hf_io.load_pretrained(folder)
  np.testing.assert_array_equal(critic.params["layers"]["down"], reference["layers"]["down"])
  np.testing.assert_array_equal(critic.params["embed"], reference["embed"])
  other = dataclasses.replace(cfg, num_layers=3)
  with pytest.raises(InputError, match="another shape than the policy's"):
    critic_lib.load_backbone(str(folder), other)


def test_the_critic_sharded_over_8_devices_gives_the_values_and_update_of_one():
  mesh = mesh_or_skip((2, 2, 2))
  policy = qwen3.init_params(CFG, jax.random.key(3), std=0.3)
  rng = np.random.default_rng(2)
  batch = {"tokens": rng.integers(0, 48, (8, 16)).astype(np.int32)}
  batch["mask"] = (rng.random((8, 16)) < 0.6).astype(np.float32)
  rewards = rng.normal(size=8)
  out = []
  for m in (None, mesh):
    params = policy if m is None else jax.device_put(policy, qwen3.param_shardings(CFG, m))
    critic = critic_lib.Critic(CFG, params, _train(), total_updates=2, mesh=m)
    b = dict(batch)
    gae(critic, b, rewards)
    metrics = [critic_update(critic, b) for _ in range(2)]
    out.append((critic.values(b), metrics, jax.tree.map(np.asarray, critic.params)))
    if m is not None:
      spec = critic.params["layers"]["gate"].sharding.spec
      assert spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
  (v1, m1, p1), (v8, m8, p8) = out
  np.testing.assert_allclose(v8, v1, atol=1e-5)
  for a, b in zip(m1, m8):
    assert b["critic/value_loss"] == pytest.approx(a["critic/value_loss"], rel=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), p1, p8)
