"""The learner's numbers against verl's on the same inputs: every row of docs/algorithms.md.

tests/data/verl_reference.npz holds a batch (6 groups x 4 samples, lengths 1-40, 523
tokens, two all-equal groups, ratios 0.08-12) and what verl's own functions computed on
it in float64 (tests/data/make_verl_reference.py made it). april_jax computes in float32
here, so values agree to float32 rounding. Where april_jax's default differs from
verl's by design, a test says so: it shows the difference, and the config value that
gives verl's number.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.rl import advantages as adv_lib
from april_jax.rl import corrections, cov_tokens
from april_jax.rl import critic as critic_lib
from april_jax.rl.aggregation import aggregate
from april_jax.rl.kl import kl_penalty
from april_jax.rl.losses import LossConfig, policy_loss

REF = np.load(Path(__file__).parent / "data" / "verl_reference.npz")
X = {k[3:]: REF[k] for k in REF.files if k.startswith("in/")}
MASK = X["mask"]
LIVE = MASK > 0
G, N = X["rewards"].shape
ADV_B = REF["adv/grpo"][:, 0].astype(np.float32)  # every row has a token at t = 0
LENGTHS_GxN = MASK.sum(-1).reshape(G, N)


def close(got, want, rtol=2e-5, atol=None):
  """Equal to float32 rounding: relative, with an absolute floor at the data's scale."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  atol = rtol * max(np.abs(want).max(), 1e-3) if atol is None else atol
  np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def on_mask(x_BxT):
  return np.where(LIVE, x_BxT, 0.0)


def loss_and_grad(cfg, logp=X["logp"], old=X["old"], adv=ADV_B, mask=MASK, **kw):
  """policy_loss's value, metrics and gradient in logp (as verl's log_prob.grad)."""
  fn = lambda lp: policy_loss(cfg, lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), **kw)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp))
  return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def check_policy(case, cfg, loss_atol=None, **kw):
  loss, metrics, grad = loss_and_grad(cfg, **kw)
  close(loss, REF[f"pg/{case}/loss"], atol=loss_atol)
  close(grad, REF[f"pg/{case}/grad"])
  return metrics


# ------------------------------------------------------------------------ advantages


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_group_advantages_equal_verls(name):
  got = np.asarray(adv_lib.get_advantage(name)(X["rewards"])).reshape(-1)
  close(on_mask(np.broadcast_to(got[:, None], MASK.shape)), REF[f"adv/{name}"])


@pytest.mark.parametrize("name, key", [("reinforce_plus_plus", "rpp"), ("reinforce_plus_plus_baseline", "rpp_baseline")])  # fmt: skip
def test_reinforce_pp_whitening_equals_verls_and_population_is_its_scale(name, key):
  fn = adv_lib.get_advantage(name)
  bessel = np.asarray(fn(X["rewards"], lengths_GxN=LENGTHS_GxN)).reshape(-1)  # the default
  close(on_mask(np.broadcast_to(bessel[:, None], MASK.shape)), REF[f"adv/{key}"])
  # train.whitening=population: the population std, eps outside the root. It differs
  # by sqrt(N / (N - 1)) over N = 523 tokens.
  population = np.asarray(fn(X["rewards"], lengths_GxN=LENGTHS_GxN, whitening="population"))
  population = population.reshape(-1)
  tokens = MASK.sum()
  assert not np.allclose(population, bessel, rtol=1e-5)
  close(population, bessel * np.sqrt(tokens / (tokens - 1)), rtol=1e-4)


def test_gae_returns_and_bessel_whitened_advantages_equal_verls():
  rewards_B = X["rewards"].reshape(-1)
  adv, returns = critic_lib.gae(rewards_B, X["old_values"], MASK, gamma=0.99, lam=0.95)
  close(returns, on_mask(REF["adv/gae_returns"]))
  whitened = adv_lib.whiten_tokens(adv, MASK)  # the default, bessel
  close(whitened, on_mask(REF["adv/gae"]))


def test_estimators_that_need_a_group_refuse_one_sample_per_prompt():
  # verl treats a lone sample as its own group of mean 0 and std 1 (GRPO then trains on
  # the raw reward, Dr. GRPO and RLOO too); april_jax refuses, by design: a group
  # estimator without a group has no baseline. Dr. GRPO would otherwise train on zeros.
  for name in adv_lib.NEED_GROUPS:
    with pytest.raises(ValueError, match="n >= 2"):
      adv_lib.get_advantage(name)(np.ones((3, 1), np.float32))


# ---------------------------------------------------------------------- aggregation


@pytest.mark.parametrize(
    "mode, key",
    [
        ("token_mean", "token-mean"),
        ("seq_mean_token_mean", "seq-mean-token-mean"),
        ("seq_mean_token_sum", "seq-mean-token-sum"),
        ("token_sum_norm", "norm"),
    ],
)
def test_aggregations_equal_verls_agg_loss(mode, key):
  x = REF["agg/loss_mat"].astype(np.float32)
  close(float(aggregate(jnp.asarray(x), jnp.asarray(MASK), mode, norm_len=64)), REF[f"agg/{key}"])


def test_dr_grpos_paper_normaliser_is_verls_over_the_sequences_by_design():
  x = REF["agg/loss_mat"].astype(np.float32)
  paper = float(
      aggregate(jnp.asarray(x), jnp.asarray(MASK), "seq_mean_token_sum_norm", norm_len=64)
  )
  close(paper, REF["agg/norm"] / MASK.shape[0])


# ------------------------------------------------------------------- policy losses


def test_ppo_clip_with_dual_clip_3_equals_verls_vanilla_and_the_default_differs():
  metrics = check_policy("vanilla", LossConfig(dual_clip_c=3.0))
  close(metrics["pg_clipfrac"], REF["pg/vanilla/pg_clipfrac"], rtol=1e-6)
  close(metrics["pg_clipfrac_lower"], REF["pg/vanilla/pg_clipfrac_lower"], rtol=1e-6)
  assert REF["pg/vanilla/pg_clipfrac_lower"] > 0  # the dual clip binds on this batch
  loss, _, _ = loss_and_grad(LossConfig())  # the default: no dual clip (as slime's)
  assert abs(loss - REF["pg/vanilla/loss"]) > 1e-3


def test_clip_higher_and_sequence_mean_equal_verls():
  check_policy("vanilla_higher", LossConfig(dual_clip_c=3.0, eps_clip_high=0.28))
  check_policy("vanilla_seq", LossConfig(dual_clip_c=3.0, aggregation="seq_mean_token_mean"))


def test_gspo_equals_verls():
  # Terms of about 1 (A s, s within 1e-3 of 1) that cancel to 4e-6: float32 rounds each
  # by 6e-8, so the loss agrees to 1e-7 absolute, its gradient to float32 relative.
  check_policy("gspo", LossConfig.for_gspo(), loss_atol=1e-7, logp=X["logp_gspo"])


def test_clip_cov_selects_every_candidate_and_equals_verl():
  cfg = LossConfig.for_loss("clip_cov", cov_ratio=0.08)
  ratio = np.exp(X["logp"].astype(np.float64) - X["old"])
  adv = ADV_B[:, None]
  clipped = (-adv * np.clip(ratio, 0.8, 1.2) > -adv * ratio) & LIVE
  rng = np.random.default_rng(0)
  selected = cov_tokens.clip_cov(ADV_B, X["logp"], MASK, 0.08, 1.0, 5.0, rng, clipped)
  assert selected.sum() == round(REF["pg/clip_cov/pg_clipfrac"] * MASK.sum()) == 39
  check_policy("clip_cov", cfg, selected_BxT=jnp.asarray(selected, jnp.float32))


def test_kl_cov_selects_the_largest_covariances_and_equals_verl():
  cfg = LossConfig.for_loss("kl_cov", cov_ratio=0.02, kl_cov_coef=1.0)
  selected = cov_tokens.kl_cov(ADV_B, X["logp"], MASK, 0.02)
  assert selected.sum() == int(0.02 * MASK.sum()) == 10
  check_policy("kl_cov", cfg, selected_BxT=jnp.asarray(selected, jnp.float32))


def test_gmpo_equals_verls_geo_mean():
  check_policy("gmpo", LossConfig.for_loss("gmpo"))


def test_cispo_equals_verls():
  metrics = check_policy("cispo", LossConfig.for_loss("cispo"))
  close(metrics["pg_clipfrac"], REF["pg/cispo/pg_clipfrac"], rtol=1e-6)


@pytest.mark.parametrize("loss, case", [("ppo_clip", "vanilla_tis"), ("gmpo", "gmpo_tis")])
def test_truncated_importance_weights_multiply_as_verls(loss, case):
  weights = corrections.importance_weights(
      "token", "truncate", 0.0, 2.0, X["old"], X["behavior"], MASK
  )
  cfg = LossConfig.for_loss(loss, dual_clip_c=3.0 if loss == "ppo_clip" else None)
  check_policy(case, cfg, is_weight_BxT=jnp.asarray(weights.weight_BxT))


# ------------------------------------------------------------------------------ KL


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl", "abs"])
def test_kl_estimators_equal_verls_value_and_gradient(kind):
  def mean_kl(logp):
    return aggregate(kl_penalty(logp, jnp.asarray(X["ref"]), kind, MASK), MASK, "token_mean")

  value, grad = jax.value_and_grad(mean_kl)(jnp.asarray(X["logp"]))
  close(float(value), REF[f"kl/{kind}/value"])
  close(np.asarray(grad), REF[f"kl/{kind}/grad"])


# ------------------------------------------------------------------ corrections


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_weights_equal_verls_rollout_correction(level):
  weights = corrections.importance_weights(
      level, "truncate", 0.0, 2.0, X["old"], X["behavior"], MASK
  )
  close(on_mask(weights.weight_BxT), REF[f"is/{level}/weights"])


@pytest.mark.parametrize("level, option", [("token", "token_k1"), ("sequence", "seq_sum_k1")])
def test_icepop_bounds_are_the_inverse_of_verls_k1_thresholds(level, option):
  # verl bounds pi_rollout / pi_old in [0.2, 2]; april_jax bounds w = pi_prox / pi_behav,
  # its inverse, in [1 / 2, 1 / 0.2] = [0.5, 5]: the same tokens stay.
  weights = corrections.importance_weights(level, "mask", 0.5, 5.0, X["old"], X["behavior"], MASK)
  kept = REF[f"is/{option}/mask"] > 0
  assert (weights.keep_BxT == kept).all() and 0 < kept.sum() < LIVE.sum()


# ------------------------------------------------------------------------ critic


def test_value_loss_clip_fraction_and_gradient_equal_verls():
  value_grad = jax.value_and_grad(
      lambda v: critic_lib.value_loss(v, X["old_values"], X["returns"], MASK, 0.2, MASK.sum()),
      has_aux=True,
  )
  (loss, metrics), grad = value_grad(jnp.asarray(X["vpreds"]))
  close(float(loss), REF["vf/batch/loss"])
  close(float(metrics["value_clipfrac"]), REF["vf/batch/clipfrac"], rtol=1e-6)
  close(np.asarray(grad), REF["vf/batch/grad"])


def test_value_clip_fraction_does_not_count_float_rounding():
  v, old, ret = (jnp.asarray(REF[f"vf/rounding/{k}"], jnp.float32) for k in ("v", "old", "ret"))
  loss, metrics = critic_lib.value_loss(v, old, ret, jnp.ones((1, 1)), 0.2, jnp.float32(1))
  assert float(metrics["value_clipfrac"]) == REF["vf/rounding/clipfrac"] == 0.0
  close(float(loss), REF["vf/rounding/loss"])


# ------------------------------------------------------------------------ clamps

CLAMP = {k.split("/")[1]: REF[k] for k in REF.files if k.startswith("clamp/") and k.count("/") == 1}


def test_ppo_and_gspo_clamp_extreme_log_ratios_as_verl():
  old, mask = CLAMP["old"].astype(np.float32), CLAMP["mask"].astype(np.float32)
  logp = (CLAMP["old"] + CLAMP["log_ratio"]).astype(np.float32)
  adv = CLAMP["adv"].astype(np.float32)
  for cfg, case in ((LossConfig(), "vanilla"), (LossConfig.for_gspo(), "gspo")):
    loss, metrics, grad = loss_and_grad(cfg, logp, old, adv, mask)
    assert np.isfinite(loss) and loss < 1e9  # unclamped: 7.2e10
    close(loss, REF[f"clamp/{case}/loss"])
    close(grad, REF[f"clamp/{case}/grad"])
    clamped = {"vanilla": 3 / 12, "gspo": 4 / 12}[case]  # |25|, |-25|, 21; the row of 12s
    assert metrics["log_ratio_clamped_frac"] == pytest.approx(clamped)


def test_cispo_clamps_extreme_log_ratios_as_verl():
  logp = (CLAMP["old"] + CLAMP["log_ratio"]).astype(np.float32)
  args = (logp, CLAMP["old"].astype(np.float32), CLAMP["adv"].astype(np.float32), CLAMP["mask"])
  loss, metrics, grad = loss_and_grad(LossConfig.for_loss("cispo"), *args)
  close(loss, REF["clamp/cispo/loss"])
  close(grad, REF["clamp/cispo/grad"])
  assert metrics["log_ratio_clamped_frac"] == pytest.approx(3 / 12)


@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_k3_is_clamped_as_low_var_kl_at_both_clamps_as_verls(kind):
  # ref - logp = -25 (clamped to -20 before the exp), 25, 3 (16.09 unclamped, gradient
  # -19.09), all three estimates past 10; -3 inside (2.05).
  logp = jnp.asarray([[-1.0, -30.0, -5.0, -2.0]])
  ref = jnp.asarray([[-26.0, -5.0, -2.0, -5.0]])
  grad = jax.grad(lambda lp: kl_penalty(lp, ref, kind).sum())(logp)
  close(np.asarray(kl_penalty(logp, ref, kind)), REF[f"clamp/kl_{kind}/value"])
  close(np.asarray(grad), REF[f"clamp/kl_{kind}/grad"])
  np.testing.assert_allclose(REF[f"clamp/kl_{kind}/value"][0, :3], 10.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_log_weights_are_clamped_at_20_as_verls(level):
  prox = CLAMP["old"] + CLAMP["log_ratio"]
  weights = corrections.importance_weights(
      level, "truncate", 0.0, 1e12, prox, CLAMP["old"], CLAMP["mask"]
  )
  close(weights.weight_BxT, REF[f"clamp/is_{level}/weights"])
  assert weights.metrics["is_clamped_frac"] > 0


# ------------------------------------------------------------- a row of padding only

PAD = {k.split("/")[1]: REF[k] for k in REF.files if k.startswith("pad/") and k.count("/") == 1}


def test_gmpo_skips_a_row_of_padding_where_verls_mean_counts_it_by_design():
  args = (PAD["logp"], PAD["old"], PAD["adv"], PAD["mask"])
  loss, _, grad = loss_and_grad(LossConfig.for_loss("gmpo"), *args)
  rows, live_rows = PAD["mask"].shape[0], int((PAD["mask"].sum(-1) > 0).sum())  # 4, 3
  close(loss, REF["pad/gmpo/loss"] * rows / live_rows)
  close(grad, REF["pad/gmpo/grad"] * rows / live_rows)


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum"])
def test_sequence_means_leave_a_row_of_padding_out_as_verls(mode):
  got = aggregate(jnp.asarray(PAD["logp"]), jnp.asarray(PAD["mask"]), mode)
  close(float(got), REF["pad/" + mode.replace("_", "-")])
