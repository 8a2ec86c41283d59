"""Writes verl_reference.npz: inputs made here, and what verl's own functions compute on them.

tests/peer_verl_test.py compares april_jax's learner against these numbers. They were
made once with verl importable (its source tree on PYTHONPATH, torch on the CPU); the
suite needs only the .npz. Run from this folder:

    python make_verl_reference.py  [verl commit b178a3cd, 2026-01-29]

Inputs are float32 values (what april_jax computes in), handed to verl in float64; every
output is verl's, float64. Keys are "<case>/<field>"; "in/<name>" are the inputs.
The cases (the rows of docs/algorithms.md's table):

  adv/*     GRPO, Dr. GRPO, RLOO, REINFORCE++ (gamma 1) and its baseline variant, GAE
  agg/*     agg_loss's four modes on one loss matrix
  pg/*      the policy losses: vanilla PPO (dual clip c = 3, clip-higher), GSPO, clip-cov,
            kl-cov, GMPO (geo_mean), CISPO, each a loss and its gradient in log_prob
  kl/*      kl_penalty's estimators (k1, k2, k3, low_var_kl, abs): token-mean and gradient
  is/*      rollout correction weights (token, sequence; truncated at 2) and rejection
            masks (token_k1 and seq_sum_k1 with bounds 0.2 and 2)
  vf/*      compute_value_loss: loss, clip fraction, gradient in vpreds
  clamp/*   the safety clamps: PPO's and CISPO's log-ratio +-20, GSPO's sequence
            log-ratio 10, the rollout weights' log-ratio +-20, k3's +-20 and +-10
  pad/*     a batch with a row of padding only: GMPO, the sequence means
"""

import numpy as np
import torch

import verl.trainer.ppo.core_algos as core
import verl.trainer.ppo.rollout_corr_helper as corr
import verl.utils.torch_functional as verl_F
from verl.workers.config import FSDPActorConfig, PolicyLossConfig

G, N, T = 6, 4, 40
B = G * N
OUT = {}


def f64(x):
  return torch.tensor(np.asarray(x, np.float64))


def keep(prefix, **arrays):
  for k, v in arrays.items():
    if isinstance(v, torch.Tensor):
      v = v.detach().numpy()
    OUT[f"{prefix}/{k}"] = np.asarray(v, np.float64 if prefix != "in" else None)


def inputs():
  """The batch: 6 groups x 4 samples, lengths 1-40, two all-equal groups, ratios 0.08-12."""
  rng = np.random.default_rng(2026)
  lengths = rng.integers(1, T + 1, B)
  lengths[0], lengths[1] = 1, T
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
  rewards = rng.integers(0, 2, (G, N)).astype(np.float32)
  rewards[0], rewards[1] = 1.0, 0.0  # all equal: zero advantages
  rewards[2] = [1.0, 0.0, 0.0, 1.0]
  rewards[5] = [0.5, -0.3, 1.25, 0.0]
  old = -rng.uniform(0.05, 4.0, (B, T)).astype(np.float32)
  log_ratio = rng.normal(0.0, 0.15, (B, T))
  wide = rng.random((B, T)) < 0.25
  log_ratio[wide] = rng.uniform(np.log(0.08), np.log(12.0), wide.sum())
  logp = (old + log_ratio).astype(np.float32)
  behavior = (old - rng.normal(0.0, 0.2, (B, T))).astype(np.float32)
  far = rng.random((B, T)) < 0.03
  behavior[far] = old[far] - rng.choice([-3.0, 3.0], far.sum())
  ref = (logp + rng.normal(0.0, 0.4, (B, T))).astype(np.float32)
  logp_gspo = (old + rng.normal(0.0, 2e-3, (B, T)) + rng.normal(0, 4e-4, (B, 1))).astype(np.float32)
  old_values = rng.normal(0.0, 0.5, (B, T)).astype(np.float32)
  vpreds = (old_values + rng.normal(0.0, 0.15, (B, T))).astype(np.float32)
  returns = (old_values + rng.normal(0.0, 0.5, (B, T))).astype(np.float32)
  keep(
      "in",
      mask=mask,
      rewards=rewards,
      old=old,
      logp=logp,
      behavior=behavior,
      ref=ref,
      logp_gspo=logp_gspo,
      old_values=old_values,
      vpreds=vpreds,
      returns=returns,
  )
  return {k[3:]: v for k, v in OUT.items() if k.startswith("in/")}


def config(**kw):
  policy = PolicyLossConfig(
      loss_mode="vanilla",
      clip_cov_ratio=kw.pop("clip_cov_ratio", 0.0002),
      clip_cov_lb=kw.pop("clip_cov_lb", 1.0),
      clip_cov_ub=kw.pop("clip_cov_ub", 5.0),
      kl_cov_ratio=kw.pop("kl_cov_ratio", 0.0002),
      ppo_kl_coef=kw.pop("ppo_kl_coef", 1.0),
  )
  args = dict(
      strategy="fsdp",
      rollout_n=N,
      ppo_mini_batch_size=B,
      ppo_micro_batch_size_per_gpu=B,
      use_torch_compile=False,
      clip_ratio=0.2,
      clip_ratio_low=0.2,
      clip_ratio_high=0.2,
      clip_ratio_c=3.0,
      policy_loss=policy,
  )
  args.update(kw)
  return FSDPActorConfig(**args)


def token_rewards(rewards, mask):
  """The sample's reward on its last response token, as verl's outcome rewards lie."""
  out = np.zeros(mask.shape)
  last = mask.sum(-1).astype(int) - 1
  out[np.arange(mask.shape[0]), last] = np.asarray(rewards).reshape(-1)
  return f64(out)


def advantages(x):
  mask, scores = f64(x["mask"]), token_rewards(x["rewards"], x["mask"])
  index = np.repeat(np.arange(G), N)
  grpo, _ = core.compute_grpo_outcome_advantage(scores, mask, index)
  drgrpo, _ = core.compute_grpo_outcome_advantage(
      scores, mask, index, norm_adv_by_std_in_grpo=False
  )
  rloo, _ = core.compute_rloo_outcome_advantage(scores, mask, index)
  gamma1 = type("Algo", (), {"gamma": 1.0})()
  rpp, _ = core.compute_reinforce_plus_plus_outcome_advantage(scores, mask, config=gamma1)
  rpp_base, _ = core.compute_reinforce_plus_plus_baseline_outcome_advantage(scores, mask, index)
  gae, gae_returns = core.compute_gae_advantage_return(
      scores, f64(x["old_values"]), mask, gamma=0.99, lam=0.95
  )
  keep("adv", grpo=grpo, drgrpo=drgrpo, rloo=rloo, rpp=rpp, rpp_baseline=rpp_base)
  keep("adv", gae=gae, gae_returns=gae_returns)
  return grpo


def aggregations(x, adv):
  mask = f64(x["mask"])
  loss_mat = f64(x["logp"]) * adv  # any values; a product so rows differ
  for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
    keep("agg", **{mode: core.agg_loss(loss_mat, mask, mode)})
  keep("agg", norm=core.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", loss_scale_factor=64))
  keep("agg", loss_mat=loss_mat)


def policy(name, fn, cfg, x, adv, logp_key="logp", weights=None, **kw):
  log_prob = f64(x[logp_key]).requires_grad_(True)
  loss, metrics = fn(
      old_log_prob=f64(x["old"]),
      log_prob=log_prob,
      advantages=adv,
      response_mask=f64(x["mask"]),
      config=cfg,
      rollout_is_weights=weights,
      **kw,
  )
  loss.backward()
  keep(f"pg/{name}", loss=loss, grad=log_prob.grad)
  keep(f"pg/{name}", **{k.split("/")[-1]: v for k, v in metrics.items()})


def clip_cov_candidates(x, adv, lb, ub) -> int:
  """How many tokens clip-cov may pick from, computed as verl does."""
  mask, logp = f64(x["mask"]), f64(x["logp"])
  ratio = torch.exp(logp - f64(x["old"]))
  clipped = (-adv * torch.clamp(ratio, 0.8, 1.2) > -adv * ratio) & (mask > 0)
  cov = (adv - verl_F.masked_mean(adv, mask)) * (logp - verl_F.masked_mean(logp, mask))
  return int(((cov > lb) & (cov < ub) & (mask > 0) & ~clipped).sum())


def policy_losses(x, adv):
  policy("vanilla", core.compute_policy_loss_vanilla, config(), x, adv)
  policy("vanilla_higher", core.compute_policy_loss_vanilla, config(clip_ratio_high=0.28), x, adv)
  seq = dict(loss_agg_mode="seq-mean-token-mean")
  policy("vanilla_seq", core.compute_policy_loss_vanilla, config(), x, adv, **seq)
  gspo = config(clip_ratio_low=3e-4, clip_ratio_high=4e-4)
  policy("gspo", core.compute_policy_loss_gspo, gspo, x, adv, logp_key="logp_gspo")
  # clip-cov picks at random among its candidates; with fewer candidates than it may
  # pick (n = floor(0.08 * tokens)), every candidate is picked, so the result is fixed.
  clip_cov = config(clip_cov_ratio=0.08)
  assert clip_cov_candidates(x, adv, 1.0, 5.0) <= int(0.08 * x["mask"].sum()), "random pick"
  torch.manual_seed(0)
  policy("clip_cov", core.compute_policy_loss_clip_cov, clip_cov, x, adv)
  kl_cov = config(kl_cov_ratio=0.02, ppo_kl_coef=1.0)
  policy("kl_cov", core.compute_policy_loss_kl_cov, kl_cov, x, adv)
  gmpo = config(clip_ratio_low=0.4, clip_ratio_high=0.4)
  policy("gmpo", core.compute_policy_loss_geo_mean, gmpo, x, adv)
  cispo = config(clip_ratio_low=1.0, clip_ratio_high=0.2)
  policy("cispo", core.compute_policy_loss_cispo, cispo, x, adv)
  log_ratio = f64(x["old"]) - f64(x["behavior"])
  weights, _ = corr.compute_rollout_correction_weights(log_ratio, f64(x["mask"]), "token", 2.0)
  policy("vanilla_tis", core.compute_policy_loss_vanilla, config(), x, adv, weights=weights)
  policy("gmpo_tis", core.compute_policy_loss_geo_mean, gmpo, x, adv, weights=weights)


def kl_terms(x):
  mask = f64(x["mask"])
  for kind in ("k1", "k2", "k3", "low_var_kl", "abs"):
    logp = f64(x["logp"]).requires_grad_(True)
    kl = core.kl_penalty(logp, f64(x["ref"]), kind)
    value = core.agg_loss(kl, mask, "token-mean")
    value.backward()
    keep(f"kl/{kind}", value=value, grad=logp.grad)


def importance(x):
  mask, log_ratio = f64(x["mask"]), f64(x["old"]) - f64(x["behavior"])
  for level in ("token", "sequence"):
    weights, _ = corr.compute_rollout_correction_weights(log_ratio, mask, level, 2.0)
    keep(f"is/{level}", weights=weights)
  for option in ("token_k1", "seq_sum_k1"):
    kept, _ = corr.compute_rollout_rejection_mask(log_ratio, mask, option, "0.2_2")
    keep(f"is/{option}", mask=kept)


def value(x):
  vpreds = f64(x["vpreds"]).requires_grad_(True)
  args = (f64(x["returns"]), f64(x["old_values"]), f64(x["mask"]), 0.2)
  loss, clipfrac = core.compute_value_loss(vpreds, *args)
  loss.backward()
  keep("vf/batch", loss=loss, clipfrac=clipfrac, grad=vpreds.grad)
  # The reviewer's case: V_old + clip(V - V_old) is not V in float32.
  one = dict(v=[[-0.0102714645]], old=[[0.053261887]], ret=[[-0.013058329]])
  loss, clipfrac = core.compute_value_loss(
      f64(np.float32(one["v"])), f64(np.float32(one["ret"])), f64(np.float32(one["old"])),
      torch.ones(1, 1, dtype=torch.float64), 0.2,
  )  # fmt: skip
  keep("vf/rounding", loss=loss, clipfrac=clipfrac, **{k: np.float32(v) for k, v in one.items()})


def clamps():
  """Log-ratios past the safety clamps: a loss of 7.2e10 unclamped."""
  mask = torch.ones(3, 4, dtype=torch.float64)
  old = torch.full((3, 4), -1.0, dtype=torch.float64)
  log_ratio = f64([[25.0, 0.1, -25.0, 0.0], [12.0, 12.0, 12.0, 12.0], [-0.2, 21.0, 0.3, 0.0]])
  adv = f64([[-1.0], [-1.0], [1.0]]).expand(3, 4)
  keep("clamp", mask=mask, old=old, log_ratio=log_ratio, adv=adv[:, 0])
  for name, fn, cfg in (
      ("vanilla", core.compute_policy_loss_vanilla, config(clip_ratio_c=1e9)),
      ("gspo", core.compute_policy_loss_gspo, config(clip_ratio_low=3e-4, clip_ratio_high=4e-4)),
  ):
    log_prob = (old + log_ratio).requires_grad_(True)
    loss, _ = fn(
        old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask, config=cfg
    )
    loss.backward()
    keep(f"clamp/{name}", loss=loss, grad=log_prob.grad)
  for level in ("token", "sequence"):
    weights, _ = corr.compute_rollout_correction_weights(log_ratio, mask, level, 1e12)
    keep(f"clamp/is_{level}", weights=weights)
  cispo = config(clip_ratio_low=1.0, clip_ratio_high=0.2)
  log_prob = (old + log_ratio).requires_grad_(True)
  loss, _ = core.compute_policy_loss_cispo(
      old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask, config=cispo
  )
  loss.backward()
  keep("clamp/cispo", loss=loss, grad=log_prob.grad)
  for kind in ("k3", "low_var_kl"):  # ref - logp = -25, 25, 3 (the reviewer's 16.09), -3
    logp = f64([[-1.0, -30.0, -5.0, -2.0]]).requires_grad_(True)
    kl = core.kl_penalty(logp, f64([[-26.0, -5.0, -2.0, -5.0]]), kind)
    kl.sum().backward()
    keep(f"clamp/kl_{kind}", value=kl, grad=logp.grad)


def padding():
  """A batch with a row of padding only: verl's geo_mean counts it in its mean."""
  rng = np.random.default_rng(7)
  mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], np.float32)
  old = -rng.uniform(0.1, 3.0, mask.shape).astype(np.float32)
  logp = (old + rng.normal(0.0, 0.3, mask.shape)).astype(np.float32)
  adv = np.array([1.0, -1.0, 0.5, -0.5], np.float32)
  keep("pad", mask=mask, old=old, logp=logp, adv=adv)
  log_prob = f64(logp).requires_grad_(True)
  adv_BxT = f64(adv)[:, None] * f64(mask)
  gmpo = config(clip_ratio_low=0.4, clip_ratio_high=0.4)
  loss, _ = core.compute_policy_loss_geo_mean(
      old_log_prob=f64(old), log_prob=log_prob, advantages=adv_BxT, response_mask=f64(mask),
      config=gmpo,
  )  # fmt: skip
  loss.backward()
  keep("pad/gmpo", loss=loss, grad=log_prob.grad)
  for mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
    keep("pad", **{mode: core.agg_loss(f64(logp), f64(mask), mode)})


def main():
  x = inputs()
  adv_BxT = advantages(x)
  aggregations(x, adv_BxT)
  policy_losses(x, adv_BxT)
  kl_terms(x)
  importance(x)
  value(x)
  clamps()
  padding()
  np.savez_compressed("verl_reference.npz", **OUT)
  print(f"{len(OUT)} arrays, {int(x['mask'].sum())} tokens")


if __name__ == "__main__":
  main()
