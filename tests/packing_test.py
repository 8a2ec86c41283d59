"""Packed learner rows: every sample once and whole, attention kept to its own segment,
and the same losses, gradients and updates as a row per sample, for every aggregation and
advantage estimator, PPO's critic included."""

import dataclasses
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.benchmarks import layout_bench
from april_jax.models import attention, qwen3
from april_jax.rl import advantages as advantages_lib
from april_jax.rl import batch as batch_lib
from april_jax.rl import cov_tokens
from april_jax.rl import critic as critic_lib
from april_jax.rl import layout
from april_jax.rl import update as update_lib
from april_jax.rl.update import Learner
from april_jax.settings.train import TrainSettings
from conftest import tiny_qwen3
from learner_batches import critic_update, gae, learn_once, train_batch

CFG = tiny_qwen3()
T = 48
ROOT = Path(__file__).resolve().parents[1]


def test_packing_holds_every_sample_once_whole_and_in_order():
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 41, size=37)
  pieces = layout.packed_pieces(lengths, rows=4, pack_len=40)
  seen = []
  for p in pieces:
    assert p.sample.shape == (1, 4, p.T) and p.T in layout.pack_lengths(40)
    segments = p.segments()
    for r in range(4):
      row, pos = p.sample[0, r], p.pos[0, r]
      live = row >= 0
      assert not live[np.argmin(live) :].any() or live.all()  # padding only at the end
      for i in np.unique(row[live]):
        at = np.flatnonzero(row == i)
        assert np.array_equal(at, np.arange(at[0], at[0] + lengths[i]))  # whole, contiguous
        assert np.array_equal(pos[at], np.arange(lengths[i]))  # positions restart
        assert len(np.unique(segments[0, r, at])) == 1 and segments[0, r, at[0]] >= 1
        seen.append(i)
      assert (segments[0, r, ~live] == 0).all()
  assert sorted(seen) == list(range(37))
  assert layout.token_counts(pieces, lengths)["real_tokens"] == lengths.sum()


def test_a_sample_longer_than_the_budget_is_refused_by_name():
  with pytest.raises(ValueError, match="pack_len=16"):
    layout.pack(np.array([10, 17]), rows=2, pack_len=16)


@pytest.mark.parametrize("dist", ["dapo_math", "deepmath"])
def test_the_8b_batch_packs_within_5_percent_of_its_real_tokens(dist):
  """The 8B config's batch (256 samples, 32 microbatches of 8 rows on 8 devices, prompts
  of 100-400 tokens, responses to 16,384): at most 1.05 padded tokens per real token
  packed, against about 1.5 sorted and cut to power-of-two buckets."""
  spec = importlib.util.spec_from_file_location("qwen3_8b", ROOT / "configs" / "qwen3_8b.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  out = layout_bench.run(module.get_config(), dist, seeds=range(5), devices=8)
  assert out["samples"] == 256 and out["rows_per_call"] == 8
  for row in out["seeds"]:
    packed, unpacked = row["packed"], row["unpacked"]
    assert packed["real_tokens"] == unpacked["real_tokens"] > 256 * 100
    assert packed["padded_per_real"] <= 1.05 < 1.3 < unpacked["padded_per_real"]
    assert packed["calls"] <= 32 == unpacked["calls"]


@pytest.mark.parametrize("impl,chunk", [("dense", 512), ("blockwise", 8)])
def test_attention_over_packed_rows_equals_each_sample_alone(impl, chunk):
  """Values and gradients: a packed row of three samples and padding against each sample
  in a row of its own."""
  rng = np.random.default_rng(1)
  lengths = [11, 5, 9]
  L, K, G, H = 30, 2, 2, 8
  q, k, v = (jnp.asarray(rng.normal(size=(1, L, K * g, H)), jnp.float32) for g in (G, 1, 1))
  segments = np.zeros((1, L), np.int32)
  starts = np.cumsum([0] + lengths)
  for i, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
    segments[0, a:b] = i + 1
  cotangent = jnp.asarray(rng.normal(size=(1, L, K * G, H)), jnp.float32)

  def attend(q, k, v, seg, cot):
    out = attention.causal_attention(q, k, v, impl, chunk, seg)
    return jnp.sum(out * cot), out

  grad = jax.value_and_grad(attend, argnums=(0, 1, 2), has_aux=True)
  (_, packed), packed_grads = grad(q, k, v, jnp.asarray(segments), cotangent)
  assert np.isfinite(np.asarray(packed)).all()  # the padding run too
  for a, b in zip(starts[:-1], starts[1:]):
    cut = lambda x: x[:, a:b]
    (_, alone), alone_grads = grad(cut(q), cut(k), cut(v), None, cut(cotangent))
    np.testing.assert_allclose(packed[:, a:b], alone, atol=1e-5)
    for g_packed, g_alone in zip(packed_grads, alone_grads):
      np.testing.assert_allclose(g_packed[:, a:b], g_alone, atol=1e-5)


def test_segment_runs_give_cudnns_packed_layout():
  segments = jnp.asarray([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
  lengths, offsets = attention.segment_runs(segments, 4)
  np.testing.assert_array_equal(lengths, [[3, 2, 3, -1], [8, -1, -1, -1]])
  np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1]])


def _batch(seed: int, per_token: bool = False) -> dict[str, np.ndarray]:
  """Eight samples of 4 prompt and 3 to 40 response tokens in rows of T, as rl/batch.py
  lays them out, with sampler logprobs near the policy's and a stale tail on some."""
  rng = np.random.default_rng(seed)
  B = 8
  tokens = rng.integers(4, CFG.vocab_size, (B, T)).astype(np.int32)
  mask = np.zeros((B, T), np.float32)
  for b in range(B):  # half of them short enough to share a row
    mask[b, 3 : 3 + rng.integers(3, 41 if b % 2 else 20)] = 1.0
  lengths = batch_lib.row_lengths(mask)
  tokens[np.arange(T)[None, :] >= lengths[:, None]] = 0
  targets = np.concatenate([tokens[:, 1:], np.zeros((B, 1), np.int32)], axis=1)
  stale = (mask > 0) & (np.arange(T)[None, :] < 8) & (np.arange(B)[:, None] % 3 == 0)
  rewards = rng.choice([0.0, 1.0], size=B).astype(np.float32)
  return {
      "tokens": tokens,
      "targets": targets,
      "mask": mask,
      "behavior": np.where(mask > 0, rng.normal(-3.0, 0.5, (B, T)), 0.0).astype(np.float32),
      "stale": stale,
      "rewards": rewards,
      "advantages": rng.normal(size=(B, T) if per_token else B).astype(np.float32),
  }


def _train(packing: bool, **overrides):
  t = dict(lr=1e-3, logprob_chunk=16, num_microbatches=4, packing=packing, pack_len=T)
  return dataclasses.replace(TrainSettings(), **{**t, **overrides})


def _gradients(learner: Learner, batch: dict[str, np.ndarray]):
  """The summed gradients of the learner's first update on batch, through its own
  layout and programs (the old-logprob anchor and a reference 0.1 below it)."""
  batch = dict(batch, old_logp=learner.logprobs(learner.params, batch))
  batch.update(is_weight=np.ones_like(batch["mask"]), ref_logp=batch["old_logp"] - 0.1)
  batch = {k: v for k, v in batch.items() if k in update_lib.UPDATE_KEYS}
  trained = update_lib.trained_mask(learner.loss_cfg, batch["mask"], batch["stale"])
  if learner.selects_tokens:
    rng = np.random.default_rng(0)
    batch["selected"] = cov_tokens.select(
        learner.loss_cfg, batch["advantages"], batch["old_logp"], trained, rng
    )
    assert batch["selected"].any()
  totals = (np.float32(trained.sum()), np.float32((trained.sum(-1) > 0).sum()))
  grads = learner.programs.zeros(learner.params)
  for p in layout.plan(batch["mask"], learner.train)[0]:
    grads = learner.programs.grads(
        learner.params, learner.frozen, learner.piece(batch, p), totals, grads
    )[0]
  return grads


def _compare_updates(params, batch, learned: bool = False, **overrides):
  """Old logprobs and gradients, then the metrics of two updates, packed against
  unpacked: on the batch's advantages, or (learned) rl/learn.py's step, which derives
  them from the rewards and the passes."""
  out = {}
  for packing in (False, True):
    learner = Learner(CFG, jax.tree.map(jnp.copy, params), _train(packing, **overrides), 0.8, 4)
    if packing:  # packing really packs: some row holds two samples or more
      pieces = [p for mb in layout.plan(batch["mask"], learner.train) for p in mb]
      assert max(p.segments().max() for p in pieces) >= 2
    logp = learner.logprobs(learner.params, batch)
    grads = _gradients(learner, batch)
    if learned:
      metrics = [learn_once(train_batch(batch, 4), learner) for _ in range(2)]
    else:
      metrics = [learner.update(dict(batch)) for _ in range(2)]
    out[packing] = (logp, grads, metrics)
  (lp_u, g_u, m_u), (lp_p, g_p, m_p) = out[False], out[True]
  live = batch["mask"] > 0
  np.testing.assert_allclose(lp_p[live], lp_u[live], atol=1e-5)
  for a, b in zip(jax.tree.leaves(g_u), jax.tree.leaves(g_p)):
    np.testing.assert_allclose(b, a, atol=1e-6 * max(float(jnp.abs(a).max()), 1e-3))
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_u)) > 1e-3
  for a, b in zip(m_u, m_p):
    assert b["train/padded_per_real"] < a["train/padded_per_real"]  # the one that differs
    for k in set(a) - {"train/padded_per_real"}:
      assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
  return m_p


@pytest.fixture(scope="module")
def params():
  return qwen3.init_params(CFG, jax.random.key(0), std=0.3)


@pytest.mark.parametrize(
    "aggregation,extra",
    [
        ("token_mean", {}),
        ("seq_mean_token_mean", {}),
        ("seq_mean_token_sum_norm", {"norm_len": 40}),
    ],
)
def test_packed_rows_give_the_losses_and_gradients_of_a_row_per_sample(params, aggregation, extra):
  batch = _batch(0)
  metrics = _compare_updates(
      params, batch, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01, **extra
  )
  assert metrics[0]["train/grad_norm"] > 0


@pytest.mark.parametrize(
    "loss, knobs",
    [
        ("gspo", dict(tis_cap=2.0, is_level="sequence")),
        ("gmpo", dict(tis_cap=2.0)),
        ("cispo", dict(tis_cap=2.0)),
        ("clip_cov", dict(cov_ratio=0.2, clip_cov_lb=-1e9, clip_cov_ub=1e9)),
        ("kl_cov", dict(cov_ratio=0.2)),
    ],
)
def test_packed_rows_equal_unpacked_for_the_sequence_and_covariance_losses(params, loss, knobs):
  metrics = _compare_updates(params, _batch(1), policy_loss=loss, **knobs)
  if loss.endswith("_cov"):
    assert metrics[0]["train/cov_selected_frac"] > 0


@pytest.mark.parametrize("estimator", sorted(advantages_lib.ADVANTAGES))
def test_packed_rows_equal_unpacked_for_every_advantage_estimator(params, estimator):
  batch = _batch(2)
  rewards_GxN = batch["rewards"].reshape(2, 4)
  lengths = batch["mask"].sum(-1).reshape(2, 4)
  estimate = advantages_lib.get_advantage(estimator)
  batch["advantages"] = np.asarray(estimate(rewards_GxN, lengths_GxN=lengths)).reshape(-1)
  _compare_updates(params, batch, advantage=estimator, mask_stale_tokens=True)


def test_packed_rows_equal_unpacked_with_reinforce_pp_kl_in_the_reward(params):
  batch = _batch(3)
  metrics = _compare_updates(
      params, batch, learned=True, advantage="reinforce_plus_plus", reward_kl_coef=0.05
  )
  assert metrics[1]["train/kl"] != 0  # the second step's policy has moved off the reference


def test_packed_critic_gives_the_values_gae_and_update_of_a_row_per_sample(params):
  out = {}
  for packing in (False, True):
    batch = _batch(4)
    critic = critic_lib.Critic(
        CFG, params, _train(packing, advantage="gae", critic_lr=3e-3, value_clip=0.2), 4
    )
    critic.params = jax.tree.map(  # a head that gives nonzero values
        lambda x: x + 0.05 * jnp.ones_like(x) if x.ndim == 1 else x, critic.params
    )
    metrics = gae(critic, batch, batch["rewards"])
    metrics.update(critic_update(critic, batch))  # the first update: from the same params
    second = critic_update(critic, batch)
    out[packing] = (batch, metrics, second, critic.params)
  (b_u, m_u, s_u, p_u), (b_p, m_p, s_p, p_p) = out[False], out[True]
  live = b_u["mask"] > 0
  for k in ("old_values", "advantages", "returns"):
    np.testing.assert_allclose(b_p[k][live], b_u[k][live], atol=1e-5)
  for k in m_u:  # values, advantages, the first update's loss and gradients
    assert m_p[k] == pytest.approx(m_u[k], rel=1e-4, abs=1e-6), k
  # After an Adam step the params differ by float noise: Adam moves each weight about lr
  # (1e-3) a step whatever its gradient's size, so a weight whose gradient is noise (a
  # token seen only where nothing is trained) may differ by a fraction of a step. The
  # second update's losses and gradients agree to that; a count of values crossing the
  # clip threshold does not (one value on the threshold flips it), so it is not compared.
  for k in s_u:
    if "clipfrac" not in k:
      assert s_p[k] == pytest.approx(s_u[k], rel=1e-3, abs=1e-5), k
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4), p_u, p_p)
  assert np.abs(b_u["old_values"][live]).max() > 0.01


def test_the_last_microbatch_keeps_a_row_count_the_devices_split_evenly():
  assert (6, 1024) not in layout.last_shapes(12, 1024, min_rows=4)
  assert (12, 1024) not in layout.last_shapes(24, 1024, min_rows=8)
  assert {r for r, _ in layout.last_shapes(16, 1024, min_rows=4)} == {16, 8, 4}
  assert {r for r, _ in layout.last_shapes(8, 1024, min_rows=1)} == {8, 4, 2, 1}


def test_warm_up_compiles_every_packed_shape_even_past_the_batchs_longest_row(params, compiles):
  batch = _batch(5)
  learner = Learner(CFG, jax.tree.map(jnp.copy, params), _train(True, pack_len=64), 0.8, 2)
  learner.warm_up(8, batch_lib.all_bucket_lens(T))  # rows of 64 for a batch of 48
  compiled = len(compiles)
  metrics = learner.update(batch)
  assert len(compiles) == compiled, compiles[compiled:]  # every program was ready
  assert metrics["train/updates"] == 1 and metrics["train/padded_per_real"] >= 1
