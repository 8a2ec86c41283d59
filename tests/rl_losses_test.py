"""RL advantages and policy losses against independent NumPy references (plain loops)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.rl.advantages import ADVANTAGES, get_advantage, overlong_penalty
from april_jax.rl.aggregation import aggregate
from april_jax.rl.kl import kl_penalty
from april_jax.rl.losses import GSPO_EPS_CLIP, GSPO_EPS_CLIP_HIGH, LossConfig
from april_jax.rl.losses import policy_loss, validate_loss_config

# ---------------------------------------------------------------- a hand-built batch
# Ratios chosen so both branches occur for both signs of A (eps 0.2, eps_high 0.28):
#   row 0, A=+1: 1.4 > 1.28 clipped; 0.7 < 0.8 stays unclipped (pessimistic side).
#   row 1, A=-1: 0.5 < 0.8 clipped; 1.5 stays unclipped.
#   row 2, A=+2: 1.25 unclipped at eps_high 0.28, clipped at 0.2.
RATIOS = np.array(
    [
        [1.0, 1.1, 1.4, 0.7, 1.0],
        [0.5, 0.9, 1.5, 1.0, 1.0],
        [1.25, 1.3, 1.0, 1.0, 1.0],
        [1.0, 0.6, 0.85, 1.2, 1.05],
    ],
    np.float32,
)
MASK = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], np.float32)
ADV = np.array([1.0, -1.0, 2.0, -0.5], np.float32)
OLD = -np.random.default_rng(0).uniform(0.1, 3.0, RATIOS.shape).astype(np.float32)
LOGP = (OLD + np.log(RATIOS)).astype(np.float32)


def np_ratios(logp, old):
  return np.exp(logp.astype(np.float64) - old.astype(np.float64))


def np_ppo_tokens(logp, old, adv, mask, eps, eps_high, dual_c=None):
  """Per-token PPO-clip loss and clipped flags, one token at a time."""
  B, T = logp.shape
  loss, clipped = np.zeros((B, T)), np.zeros((B, T))
  for b in range(B):
    for t in range(T):
      if not mask[b, t]:
        continue
      r = np.exp(float(logp[b, t]) - float(old[b, t]))
      a = float(adv[b])
      pg = -a * r
      pgc = -a * min(max(r, 1 - eps), 1 + eps_high)
      value = max(pg, pgc)
      if dual_c is not None and a < 0:
        value = min(value, -a * dual_c)
      loss[b, t], clipped[b, t] = value, float(pgc > pg)
  return loss, clipped


def np_aggregate(x, mask, mode, total_tokens=None, total_seqs=None, norm_len=0):
  B, T = x.shape
  tokens = sum(mask[b, t] for b in range(B) for t in range(T))
  seqs = sum(1 for b in range(B) if mask[b].sum() > 0)
  total_tokens = tokens if total_tokens is None else total_tokens
  total_seqs = seqs if total_seqs is None else total_seqs
  masked_sum = sum(x[b, t] * mask[b, t] for b in range(B) for t in range(T))
  if mode == "token_mean":
    return masked_sum / total_tokens
  if mode == "seq_mean_token_mean":
    per_seq = [
        sum(x[b, t] * mask[b, t] for t in range(T)) / max(mask[b].sum(), 1) for b in range(B)
    ]
    return sum(per_seq) / total_seqs
  if mode == "seq_mean_token_sum_norm":
    return masked_sum / (total_seqs * norm_len)
  if mode == "seq_mean_token_sum":
    return masked_sum / total_seqs
  if mode == "token_sum_norm":
    return masked_sum / norm_len
  raise ValueError(mode)


def np_token_mean(x, mask):
  return np_aggregate(np.asarray(x, np.float64), mask, "token_mean")


def run_loss(cfg, logp=LOGP, old=OLD, adv=ADV, mask=MASK, **kw):
  loss, metrics = policy_loss(
      cfg, jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), **kw
  )
  return float(loss), {k: float(v) for k, v in metrics.items()}


# ------------------------------------------------------------------------ advantages


def test_grpo_advantages_match_numpy_and_equal_reward_group_is_zero():
  rewards = np.array(
      [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, -1.0, 2.0, 0.0]], np.float32
  )
  expected = np.zeros_like(rewards, np.float64)
  for g, row in enumerate(rewards.astype(np.float64)):
    mean = sum(row) / len(row)
    std = (sum((r - mean) ** 2 for r in row) / (len(row) - 1)) ** 0.5
    expected[g] = [(r - mean) / (std + 1e-6) for r in row]
  got = np.asarray(get_advantage("grpo")(jnp.asarray(rewards)))
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  assert np.all(got[1] == 0.0) and np.all(np.isfinite(got))


def test_drgrpo_advantages_are_centered_rewards_without_std_division():
  rewards = np.array([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 4.0, 6.0]], np.float32)
  expected = [[r - sum(row) / len(row) for r in row] for row in rewards.tolist()]
  np.testing.assert_allclose(get_advantage("drgrpo")(jnp.asarray(rewards)), expected, rtol=1e-6)


def test_grpo_with_one_sample_per_group_raises_naming_n():
  with pytest.raises(ValueError, match="n=1"):
    get_advantage("grpo")(jnp.ones((3, 1)))


def test_rloo_is_each_reward_minus_the_mean_of_the_others():
  rewards = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, -1.0, 2.0, 0.0]], np.float32)
  # By hand: group 2, sample 0: 3 - (-1 + 2 + 0) / 3 = 2.6667; sample 1: -1 - 5/3.
  expected = [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [3 - 1 / 3, -1 - 5 / 3, 2 - 2 / 3, 0 - 4 / 3]]
  got = get_advantage("rloo")(jnp.asarray(rewards))
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  with pytest.raises(ValueError, match="n=1"):
    get_advantage("rloo")(jnp.ones((3, 1)))


def test_reinforce_plus_plus_whitens_rewards_over_the_batch_s_tokens():
  rewards = np.array([[1.0, 0.0], [0.0, 0.0]], np.float32)
  lengths = np.array([[2, 1], [1, 4]], np.float32)
  # Tokens: 1, 1, 0, 0, 0, 0, 0, 0 -> mean 1/4, var 3/16, std sqrt(3)/4.
  std = 3**0.5 / 4
  expected = [[(1 - 0.25) / std, -0.25 / std], [-0.25 / std, -0.25 / std]]
  rpp = functools.partial(get_advantage("reinforce_plus_plus"), whitening="population")
  got = rpp(jnp.asarray(rewards), lengths_GxN=lengths)
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  # Without lengths every sample counts once: 1, 0, 0, 0 -> mean 1/4, std sqrt(3)/4 too.
  np.testing.assert_allclose(rpp(jnp.asarray(rewards)), expected, rtol=1e-5)
  # The default, verl's and slime's: the unbiased variance over the 8 tokens, eps inside.
  bessel = get_advantage("reinforce_plus_plus")(jnp.asarray(rewards), lengths_GxN=lengths)
  np.testing.assert_allclose(
      bessel, np.array(expected) * std / (3 / 16 * 8 / 7 + 1e-8) ** 0.5, rtol=1e-5
  )
  # A group's shared difficulty stays in the advantage (no group baseline) ...
  easy = rpp(jnp.asarray([[1.0, 1.0], [0.0, 0.0]]))
  np.testing.assert_allclose(easy, [[1.0, 1.0], [-1.0, -1.0]], rtol=1e-5)
  # ... and the baseline form removes it first.
  base = get_advantage("reinforce_plus_plus_baseline")(jnp.asarray([[1.0, 1.0], [0.0, 0.0]]))
  np.testing.assert_allclose(base, 0.0, atol=1e-6)


def test_reinforce_plus_plus_baseline_centres_groups_then_whitens_over_tokens():
  rewards = np.array([[1.0, 0.0], [2.0, 2.0], [0.0, 3.0]], np.float32)
  lengths = np.array([[1, 3], [2, 2], [1, 1]], np.float32)
  # Centred: [0.5, -0.5], [0, 0], [-1.5, 1.5]; as tokens (x length): 0.5, -0.5 x3, 0 x4,
  # -1.5, 1.5 -> 10 tokens, mean (0.5 - 1.5 - 1.5 + 1.5) / 10 = -0.1.
  centred = np.array([[0.5, -0.5], [0.0, 0.0], [-1.5, 1.5]])
  mean = (centred * lengths).sum() / lengths.sum()
  std = (((centred - mean) ** 2 * lengths).sum() / lengths.sum()) ** 0.5
  assert mean == pytest.approx(-0.1)
  rpp_baseline = get_advantage("reinforce_plus_plus_baseline")
  got = rpp_baseline(jnp.asarray(rewards), lengths_GxN=lengths, whitening="population")
  np.testing.assert_allclose(got, (centred - mean) / (std + 1e-6), rtol=1e-5)


def test_unknown_advantage_lists_known_names():
  with pytest.raises(KeyError, match="drgrpo"):
    get_advantage("nope")
  assert {"grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"} <= set(
      ADVANTAGES
  )


def test_overlong_penalty_hand_values():
  got = overlong_penalty(jnp.array([10, 16, 17, 18, 20, 25]), max_len=20, buffer_len=4)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0], rtol=1e-6)
  scaled = overlong_penalty(jnp.array([18]), max_len=20, buffer_len=4, factor=2.0)
  np.testing.assert_allclose(scaled, [-1.0], rtol=1e-6)


# ----------------------------------------------------------------------- aggregation

AGG_X = np.random.default_rng(1).normal(size=(5, 6)).astype(np.float32)
AGG_MASK = np.array(
    [
        [1, 1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],  # all padding: not a sequence
        [1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
    ],
    np.float32,
)
MODES = [
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_sum_norm",
]


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_numpy_on_variable_length_masks(mode):
  got = aggregate(jnp.asarray(AGG_X), jnp.asarray(AGG_MASK), mode, norm_len=8)
  expected = np_aggregate(AGG_X.astype(np.float64), AGG_MASK, mode, norm_len=8)
  np.testing.assert_allclose(float(got), expected, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_microbatch_aggregates_with_full_batch_totals_sum_to_full_batch(mode):
  total_tokens = AGG_MASK.sum()
  total_seqs = float((AGG_MASK.sum(-1) > 0).sum())
  full = float(aggregate(jnp.asarray(AGG_X), jnp.asarray(AGG_MASK), mode, norm_len=8))
  parts = [
      float(
          aggregate(
              jnp.asarray(AGG_X[s]),
              jnp.asarray(AGG_MASK[s]),
              mode,
              total_tokens=total_tokens,
              total_seqs=total_seqs,
              norm_len=8,
          )
      )
      for s in (slice(0, 2), slice(2, 5))
  ]
  np.testing.assert_allclose(sum(parts), full, rtol=1e-5)
  # And the per-microbatch loss (with its metrics) is additive the same way.
  cfg = LossConfig(aggregation=mode, norm_len=8)
  _, metrics_full = run_loss(cfg)
  micro = [
      run_loss(cfg, LOGP[s], OLD[s], ADV[s], MASK[s], total_tokens=MASK.sum(), total_seqs=4.0)[1]
      for s in (slice(0, 1), slice(1, 4))
  ]
  for key in ("pg_loss", "pg_clipfrac", "ratio_mean", "num_tokens"):
    np.testing.assert_allclose(sum(m[key] for m in micro), metrics_full[key], rtol=1e-5)


def test_seq_mean_token_sum_norm_needs_norm_len():
  with pytest.raises(ValueError, match="norm_len"):
    aggregate(jnp.asarray(AGG_X), jnp.asarray(AGG_MASK), "seq_mean_token_sum_norm")


def test_masked_positions_holding_inf_do_not_leak_into_aggregate():
  x = np.where(AGG_MASK > 0, AGG_X, np.inf).astype(np.float32)
  got = aggregate(jnp.asarray(x), jnp.asarray(AGG_MASK), "token_mean")
  np.testing.assert_allclose(float(got), np_aggregate(AGG_X, AGG_MASK, "token_mean"), rtol=1e-5)


# -------------------------------------------------------------------------- ppo_clip


@pytest.mark.parametrize("eps_high", [None, 0.28])
def test_ppo_clip_loss_and_clipfrac_match_numpy(eps_high):
  cfg = LossConfig(eps_clip=0.2, eps_clip_high=eps_high)
  loss, metrics = run_loss(cfg)
  tokens, clipped = np_ppo_tokens(LOGP, OLD, ADV, MASK, 0.2, eps_high or 0.2)
  # Both branches taken for both signs of A.
  for b in (0, 1):
    assert clipped[b][MASK[b] > 0].any() and not clipped[b][MASK[b] > 0].all()
  np.testing.assert_allclose(loss, np_token_mean(tokens, MASK), rtol=1e-5)
  np.testing.assert_allclose(metrics["pg_clipfrac"], np_token_mean(clipped, MASK), rtol=1e-6)
  np.testing.assert_allclose(
      metrics["ratio_mean"], np_token_mean(np_ratios(LOGP, OLD), MASK), rtol=1e-5
  )
  assert metrics["num_tokens"] == MASK.sum()


def test_clip_higher_changes_the_loss_on_a_ratio_of_1_25_with_positive_advantage():
  logp, old = np.array([[np.log(1.25)]], np.float32), np.zeros((1, 1), np.float32)
  adv, mask = np.array([1.0], np.float32), np.ones((1, 1), np.float32)
  symmetric, _ = run_loss(LossConfig(eps_clip=0.2), logp, old, adv, mask)
  higher, _ = run_loss(LossConfig(eps_clip=0.2, eps_clip_high=0.28), logp, old, adv, mask)
  np.testing.assert_allclose(symmetric, -1.2, rtol=1e-6)
  np.testing.assert_allclose(higher, -1.25, rtol=1e-6)


def test_dual_clip_caps_negative_advantage_loss_at_minus_a_times_c():
  ratios = np.array([[5.0, 2.0, 0.5], [4.0, 1.0, 1.0]], np.float32)
  old = np.full(ratios.shape, -1.0, np.float32)
  logp = (old + np.log(ratios)).astype(np.float32)
  adv, mask = np.array([-1.0, 2.0], np.float32), np.ones(ratios.shape, np.float32)
  loss, _ = run_loss(LossConfig(dual_clip_c=3.0), logp, old, adv, mask)
  tokens, _ = np_ppo_tokens(logp, old, adv, mask, 0.2, 0.2, dual_c=3.0)
  assert tokens[0, 0] == pytest.approx(3.0)  # -A * c, not -A * 5
  assert tokens[1, 0] == pytest.approx(-2.0 * 1.2)  # A > 0 untouched
  np.testing.assert_allclose(loss, np_token_mean(tokens, mask), rtol=1e-5)


def test_ppo_clip_gradient_is_zero_on_clipped_tokens_and_minus_a_ratio_over_n_else():
  cfg = LossConfig(eps_clip=0.2, eps_clip_high=0.28)
  grad = jax.grad(
      lambda lp: policy_loss(cfg, lp, jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK))[0]
  )(jnp.asarray(LOGP))
  _, clipped = np_ppo_tokens(LOGP, OLD, ADV, MASK, 0.2, 0.28)
  ratios, n = np_ratios(LOGP, OLD), MASK.sum()
  expected = np.zeros(LOGP.shape)
  for b in range(LOGP.shape[0]):
    for t in range(LOGP.shape[1]):
      if MASK[b, t] and not clipped[b, t]:
        expected[b, t] = -ADV[b] * ratios[b, t] / n
  np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-7)


def test_jit_with_static_config_matches_eager():
  cfg = LossConfig(eps_clip_high=0.28, dual_clip_c=3.0, aggregation="seq_mean_token_mean")
  jitted = jax.jit(functools.partial(policy_loss, cfg))
  args = [jnp.asarray(a) for a in (LOGP, OLD, ADV, MASK)]
  np.testing.assert_allclose(float(jitted(*args)[0]), float(policy_loss(cfg, *args)[0]), rtol=1e-6)


def test_padding_with_minus_inf_logprobs_gives_finite_loss_and_gradient():
  logp = np.where(MASK > 0, LOGP, -np.inf).astype(np.float32)
  for cfg in (LossConfig(kl_coef=0.1), LossConfig.for_gspo(kl_coef=0.1)):
    fn = lambda lp, cfg=cfg: policy_loss(
        cfg,
        lp,
        jnp.asarray(OLD),
        jnp.asarray(ADV),
        jnp.asarray(MASK),
        ref_logp_BxT=jnp.asarray(OLD),
    )[0]
    value, grad = jax.value_and_grad(fn)(jnp.asarray(logp))
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))


# ------------------------------------------------------------------------------ gspo

# Mean log-ratios per row: inside the clip, above it (A>0), below it (A<0), inside (A<0).
GSPO_MEAN_LOG_RATIO = np.array([1e-4, 1e-3, -1e-3, 2e-4])
GSPO_ADV = np.array([1.0, 0.5, -0.5, -2.0], np.float32)


def _gspo_batch():
  rng = np.random.default_rng(2)
  noise = rng.normal(scale=1e-3, size=MASK.shape) * MASK
  noise -= (noise.sum(-1, keepdims=True) / MASK.sum(-1, keepdims=True)) * MASK  # zero mean
  log_ratio = (noise + GSPO_MEAN_LOG_RATIO[:, None]) * MASK
  return (OLD + log_ratio).astype(np.float32)


def np_gspo_loss(logp, old, adv, mask, eps, eps_high):
  """Sequence-level GSPO, averaged over sequences."""
  losses = []
  for b in range(logp.shape[0]):
    n = mask[b].sum()
    mean_lr = (
        sum(float(logp[b, t]) - float(old[b, t]) for t in range(logp.shape[1]) if mask[b, t]) / n
    )
    s = np.exp(mean_lr)
    a = float(adv[b])
    losses.append(max(-a * s, -a * min(max(s, 1 - eps), 1 + eps_high)))
  return sum(losses) / len(losses)


def test_gspo_defaults_come_from_for_gspo():
  cfg = LossConfig.for_gspo()
  assert (cfg.policy_loss, cfg.eps_clip, cfg.clip_high, cfg.aggregation) == (
      "gspo",
      GSPO_EPS_CLIP,
      GSPO_EPS_CLIP_HIGH,
      "seq_mean_token_mean",
  )
  assert LossConfig.for_gspo(eps_clip_high=1e-3).clip_high == 1e-3


def test_gspo_loss_matches_numpy_sequence_level_reference():
  cfg = LossConfig.for_gspo()
  logp = _gspo_batch()
  loss, metrics = run_loss(cfg, logp, OLD, GSPO_ADV, MASK)
  expected = np_gspo_loss(logp, OLD, GSPO_ADV, MASK, GSPO_EPS_CLIP, GSPO_EPS_CLIP_HIGH)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  # Rows 1 and 2 are clipped on every token, rows 0 and 3 on none.
  np.testing.assert_allclose(
      metrics["pg_clipfrac"], (MASK[1].sum() + MASK[2].sum()) / MASK.sum(), rtol=1e-6
  )


def test_gspo_token_form_gradient_equals_sequence_level_gspo_gradient():
  cfg = LossConfig.for_gspo()
  logp, old, adv, mask = (jnp.asarray(a) for a in (_gspo_batch(), OLD, GSPO_ADV, MASK))

  def sequence_gspo(lp):
    s = jnp.exp(jnp.sum(mask * (lp - old), -1) / jnp.sum(mask, -1))
    clipped = jnp.clip(s, 1 - GSPO_EPS_CLIP, 1 + GSPO_EPS_CLIP_HIGH)
    return jnp.mean(-jnp.minimum(s * adv, clipped * adv))

  ours = jax.grad(lambda lp: policy_loss(cfg, lp, old, adv, mask)[0])(logp)
  direct = jax.grad(sequence_gspo)(logp)
  assert np.abs(np.asarray(direct)).max() > 0  # rows 0 and 3 carry gradient
  np.testing.assert_allclose(np.asarray(ours), np.asarray(direct), rtol=1e-5, atol=1e-8)


def test_reinforce_pp_with_the_kl_in_the_reward_matches_a_hand_computation():
  from april_jax.rl.advantages import reinforce_pp_kl_advantages, whiten_tokens

  # Row 0: drawn tokens at t = 0, 1, 3 (t = 2 an observation), reward 1; row 1: t = 0..2,
  # reward 0. logp - ref_logp per token, beta 0.5.
  mask = np.array([[1, 1, 0, 1], [1, 1, 1, 0]], np.float32)
  ref = np.zeros((2, 4))
  logp = np.array([[0.2, -0.1, 9.0, 0.3], [0.0, 0.1, 0.1, 9.0]])
  # token rewards: row 0 [-0.1, 0.05, -, -0.15 + 1]; row 1 [0, -0.05, -0.05]
  returns = [[0.8, 0.9, 0.0, 0.85], [-0.1, -0.1, -0.05, 0.0]]
  live = np.array([0.8, 0.9, 0.85, -0.1, -0.1, -0.05])
  expected = np.where(mask > 0, (np.array(returns) - live.mean()) / (live.std() + 1e-6), 0.0)
  got = reinforce_pp_kl_advantages(
      np.array([1.0, 0.0]), logp, ref, mask, kl_coef=0.5, whitening="population"
  )
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  population = whiten_tokens(returns, mask, whitening="population")
  np.testing.assert_allclose(population, expected, rtol=1e-4, atol=1e-5)
  # Without the KL every token's return is its sample's reward: plain REINFORCE++.
  plain = get_advantage("reinforce_plus_plus")(
      jnp.array([[1.0, 0.0]]), lengths_GxN=jnp.array([[3.0, 3.0]])
  )
  no_kl = reinforce_pp_kl_advantages(np.array([1.0, 0.0]), logp, ref, mask, kl_coef=0.0)
  np.testing.assert_allclose(no_kl[0, 0], plain[0, 0], rtol=1e-5)
  np.testing.assert_allclose(no_kl[1, 2], plain[0, 1], rtol=1e-5)


# ------------------------------------------------------------------ importance weights


def test_importance_weights_multiply_each_token_term_and_carry_no_gradient():
  weights = np.random.default_rng(1).uniform(0.0, 2.0, MASK.shape).astype(np.float32)
  loss, _ = run_loss(LossConfig(tis_cap=2.0), is_weight_BxT=jnp.asarray(weights))
  tokens, _ = np_ppo_tokens(LOGP, OLD, ADV, MASK, 0.2, 0.2)
  np.testing.assert_allclose(loss, np_token_mean(tokens * weights, MASK), rtol=1e-5)
  fn = lambda w: policy_loss(
      LossConfig(),
      jnp.asarray(LOGP),
      jnp.asarray(OLD),
      jnp.asarray(ADV),
      jnp.asarray(MASK),
      is_weight_BxT=w,
  )[0]
  assert not np.any(np.asarray(jax.grad(fn)(jnp.asarray(weights))))


# --------------------------------------------------------------------------- masking


def test_stale_tokens_are_excluded_only_when_mask_stale_tokens_is_set():
  stale = np.zeros(MASK.shape, bool)
  stale[0, 2] = stale[1, :] = stale[3, 4] = True
  fresh_mask = MASK * ~stale
  tokens, _ = np_ppo_tokens(LOGP, OLD, ADV, MASK, 0.2, 0.2)
  for mode in MODES:
    on = LossConfig(mask_stale_tokens=True, aggregation=mode, norm_len=6)
    off = LossConfig(mask_stale_tokens=False, aggregation=mode, norm_len=6)
    loss_on, m_on = run_loss(on, stale_BxT=jnp.asarray(stale))
    loss_off, m_off = run_loss(off, stale_BxT=jnp.asarray(stale))
    np.testing.assert_allclose(
        loss_on, np_aggregate(tokens, fresh_mask, mode, norm_len=6), rtol=1e-5
    )
    np.testing.assert_allclose(loss_off, np_aggregate(tokens, MASK, mode, norm_len=6), rtol=1e-5)
    assert (m_on["num_tokens"], m_off["num_tokens"]) == (fresh_mask.sum(), MASK.sum())


# -------------------------------------------------------------------------------- KL


def test_kl_estimators_match_numpy_and_k3_is_clamped_as_low_var_kl():
  logp = np.array([[-1.0, -2.0, -0.5, -3.0, -1.0, -5.0]], np.float32)
  ref = np.array([[-1.5, -1.0, -0.5, -40.0, 25.0, -2.0]], np.float32)
  for kl_type in ("k1", "k2", "k3", "low_var_kl", "abs"):
    expected = []
    for lp, rf in zip(logp[0].tolist(), ref[0].tolist()):
      log_ratio = rf - lp
      k3 = np.exp(min(max(log_ratio, -20.0), 20.0)) - min(max(log_ratio, -20.0), 20.0) - 1
      expected.append(
          {
              "k1": -log_ratio,
              "k2": 0.5 * log_ratio**2,
              "k3": min(max(k3, -10.0), 10.0),
              "low_var_kl": min(max(k3, -10.0), 10.0),
              "abs": abs(log_ratio),
          }[kl_type]
      )
    got = np.asarray(kl_penalty(jnp.asarray(logp), jnp.asarray(ref), kl_type))[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl", "abs"])
def test_kl_term_adds_kl_coef_times_aggregate_and_nothing_at_zero_coef(kl_type):
  ref = (OLD + np.random.default_rng(3).normal(scale=0.3, size=OLD.shape)).astype(np.float32)
  log_ratio = ref.astype(np.float64) - LOGP
  kl_tokens = {
      "k1": -log_ratio,
      "k2": 0.5 * log_ratio**2,
      "k3": np.clip(np.exp(log_ratio) - log_ratio - 1, -10, 10),
      "low_var_kl": np.clip(np.exp(log_ratio) - log_ratio - 1, -10, 10),
      "abs": np.abs(log_ratio),
  }[kl_type]
  expected_kl = np_token_mean(kl_tokens, MASK)
  base, m_none = run_loss(LossConfig(kl_type=kl_type))
  with_kl, m_kl = run_loss(LossConfig(kl_type=kl_type, kl_coef=0.1), ref_logp_BxT=jnp.asarray(ref))
  zero_coef, m_zero = run_loss(
      LossConfig(kl_type=kl_type, kl_coef=0.0), ref_logp_BxT=jnp.asarray(ref)
  )
  np.testing.assert_allclose(with_kl, base + 0.1 * expected_kl, rtol=1e-5)
  assert zero_coef == base and m_none["kl"] == 0.0
  np.testing.assert_allclose([m_kl["kl"], m_zero["kl"]], [expected_kl] * 2, rtol=1e-5)


# ---------------------------------------------------------------------------- entropy


def test_entropy_bonus_lowers_loss_by_coef_times_aggregate():
  entropy = np.random.default_rng(4).uniform(0.0, 3.0, MASK.shape).astype(np.float32)
  for mode in MODES:
    base, m_base = run_loss(LossConfig(aggregation=mode, norm_len=6))
    loss, metrics = run_loss(
        LossConfig(aggregation=mode, norm_len=6, entropy_coef=0.01),
        entropy_BxT=jnp.asarray(entropy),
    )
    expected_entropy = np_aggregate(entropy.astype(np.float64), MASK, mode, norm_len=6)
    np.testing.assert_allclose(loss, base - 0.01 * expected_entropy, rtol=1e-5)
    np.testing.assert_allclose(metrics["entropy"], expected_entropy, rtol=1e-5)
    assert "entropy" not in m_base


# ------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field, kw",
    [
        ("policy_loss", dict(policy_loss="reinforce")),
        ("aggregation", dict(aggregation="sum")),
        ("kl_type", dict(kl_type="k5")),
        ("dual_clip_c", dict(policy_loss="cispo", dual_clip_c=3.0)),
        ("norm_len", dict(aggregation="token_sum_norm")),
        ("aggregation", dict(policy_loss="gmpo", aggregation="token_mean")),
        ("cov_ratio", dict(policy_loss="kl_cov", cov_ratio=0.0)),
        ("clip_cov_lb", dict(policy_loss="clip_cov", clip_cov_lb=5.0)),
        ("eps_clip", dict(eps_clip=0.0)),
        ("eps_clip_high", dict(eps_clip_high=-0.1)),
        ("tis_cap", dict(tis_cap=1.0)),
        ("dual_clip_c", dict(dual_clip_c=1.0)),
        ("norm_len", dict(aggregation="seq_mean_token_sum_norm", norm_len=0)),
    ],
)
def test_validate_loss_config_names_the_field(field, kw):
  with pytest.raises(ValueError, match=field):
    validate_loss_config(LossConfig(**kw), n_samples=4)


def test_validate_loss_config_accepts_defaults_and_gspo():
  validate_loss_config(LossConfig(), n_samples=4)
  validate_loss_config(LossConfig.for_gspo(tis_cap=2.0), n_samples=8)
  for name in ("clip_cov", "kl_cov", "gmpo", "cispo"):
    validate_loss_config(LossConfig.for_loss(name, tis_cap=2.0), n_samples=8)


def test_unknown_policy_loss_lists_known_names():
  with pytest.raises(KeyError, match="ppo_clip"):
    run_loss(LossConfig(policy_loss="nope"))


# ----------------------------------------------------------------------- kl_cov's kink


def test_kl_cov_penalty_has_no_gradient_at_r_1_and_coef_times_sign_past_it():
  """|log r| has no gradient at r = 1: within float32 rounding of it, and in a step of one
  update (where r is 1 but for rounding), the penalty adds nothing, as verl's on-policy
  step does; past it, kl_cov_coef x sign(log r) per selected token, over the tokens."""
  selected = jnp.asarray(MASK)
  drift = np.where(np.arange(MASK.size).reshape(MASK.shape) % 2, 0.1, -0.1).astype(np.float32)

  def penalty_grad(cfg, logp):
    grad = lambda sel: jax.grad(
        lambda lp: policy_loss(
            cfg, lp, jnp.asarray(OLD), jnp.asarray(ADV), jnp.asarray(MASK), selected_BxT=sel
        )[0]
    )(jnp.asarray(logp))
    return np.asarray(grad(selected) - grad(jnp.zeros_like(selected)))

  cfg = LossConfig.for_loss("kl_cov", kl_cov_coef=0.5)
  assert not penalty_grad(cfg, OLD + np.float32(1e-7)).any()  # rounding of r = 1
  one_update = LossConfig.for_loss("kl_cov", kl_cov_coef=0.5, one_update=True)
  assert not penalty_grad(one_update, OLD + drift).any()
  expected = np.where(MASK > 0, 0.5 * np.sign(drift) / MASK.sum(), 0.0)
  np.testing.assert_allclose(penalty_grad(cfg, OLD + drift), expected, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_a_covariance_loss_without_its_selection_says_so(name):
  with pytest.raises(ValueError, match=f"{name} needs selected_BxT"):
    run_loss(LossConfig.for_loss(name))


# ------------------------------------------------- GMPO, CISPO, clip-cov, kl-cov by hand


def np_new_loss(name, logp, old, adv, mask, selected, eps, eps_high, coef=0.1):
  """The papers' formulas, one token (GMPO: one sequence) at a time, in float64."""
  B, T = logp.shape
  per_seq, tokens = [], np.zeros((B, T))
  for b in range(B):
    a, live = float(adv[b]), [t for t in range(T) if mask[b, t]]
    if name == "gmpo":  # -A exp(mean_t m_t), m_t clipped on the pessimistic side of A
      m = []
      for t in live:
        lr = float(logp[b, t]) - float(old[b, t])
        m.append(min(lr, eps_high) if a > 0 else max(lr, -eps) if a < 0 else 0.0)
      per_seq.append(-a * np.exp(np.mean(m)))
      continue
    for t in live:
      lr = float(logp[b, t]) - float(old[b, t])
      r = np.exp(lr)
      if name == "cispo":  # -sg(clip(r)) A logp
        tokens[b, t] = -min(max(r, 1 - eps), 1 + eps_high) * a * float(logp[b, t])
      elif name == "clip_cov":  # PPO-clip, detached where selected
        value = max(-a * r, -a * min(max(r, 1 - eps), 1 + eps_high))
        tokens[b, t] = 0.0 if selected[b, t] else value
      elif name == "kl_cov":  # -A r, + coef |log r| where selected
        tokens[b, t] = -a * r + (coef * abs(lr) if selected[b, t] else 0.0)
  if name == "gmpo":
    return float(np.mean(per_seq))
  return np_aggregate(tokens, mask, "token_mean")


@pytest.mark.parametrize("name", ["gmpo", "cispo", "clip_cov", "kl_cov"])
def test_new_policy_losses_match_their_papers_formulas_by_hand(name):
  selected = np.zeros(MASK.shape, np.float32)
  selected[[0, 1, 3], [2, 0, 2]] = 1.0  # clipped tokens (rows 0, 1), an unclipped one
  cfg = LossConfig.for_loss(name)
  kw = {"selected_BxT": jnp.asarray(selected)} if name.endswith("_cov") else {}
  loss, _ = run_loss(cfg, **kw)
  expected = np_new_loss(name, LOGP, OLD, ADV, MASK, selected, cfg.eps_clip, cfg.clip_high)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  # The new terms move the loss: none of them is PPO-clip's value.
  assert abs(loss - run_loss(LossConfig())[0]) > 1e-4
