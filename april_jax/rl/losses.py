"""The RL update's loss: a policy term (rl/policy_terms.py) times the importance weights,
aggregated (rl/aggregation.py), with KL (rl/kl.py) and entropy terms; its config, and
the checks of that config.

Two logprobs of the same response tokens enter the policy term:
  logp           the learner's current policy: the only one differentiated.
  old_logp       the ratio's anchor (no gradient): the learner's policy before this update
                 (recomputed, the proximal policy) or, with ratio_anchor "behavior", what
                 the sampler recorded while drawing the tokens.
Each token's term is multiplied by an importance weight (no gradient) that corrects for
the tokens older params drew (APRIL's partial rollouts) and for the sampler's numerics:
rl/corrections.py builds it from the proximal and behaviour logprobs (TIS, IcePop, MIS,
decoupled PPO).

For gradient accumulation the caller passes the whole minibatch's `total_tokens` /
`total_seqs` (see aggregation.batch_totals, on the mask from `effective_mask`) with every
microbatch; then the loss and every metric but num_tokens are additive: summed over
microbatches they equal the full-batch values (num_tokens is a plain count, additive too).

Everything is pure jnp; `cfg` is a frozen dataclass, so it can be a static jit argument.
docs/algorithms.md sets every choice here beside verl's and slime's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from april_jax.rl import corrections
from april_jax.rl.aggregation import AGGREGATIONS, NEED_NORM_LEN, aggregate, seq_sums
from april_jax.rl.kl import KL_PENALTIES, kl_penalty
from april_jax.rl.policy_terms import COVARIANCE_TERMS, POLICY_TERMS, get_policy_term
from april_jax.settings.train import TrainSettings

GSPO_EPS_CLIP = 3e-4
GSPO_EPS_CLIP_HIGH = 4e-4
GSPO_MAX_CLIP = 0.01  # larger clips on a sequence ratio are token-level clips by mistake
# Each policy term's own clips and aggregation, where they differ from PPO's 0.2 / eps_clip
# / token_mean; a config's unset (None) fields take them.
LOSS_DEFAULTS = {
    "gspo": dict(
        eps_clip=GSPO_EPS_CLIP, eps_clip_high=GSPO_EPS_CLIP_HIGH, aggregation="seq_mean_token_mean"
    ),
    # GMPO clips the log-ratio to [-0.4, 0.4] (its paper's and verl's example) and
    # averages over sequences.
    "gmpo": dict(eps_clip=0.4, eps_clip_high=0.4, aggregation="seq_mean_token_mean"),
    # CISPO's weight has no lower bound (1 - 1.0 = 0), its upper one verl's example's.
    "cispo": dict(eps_clip=1.0, eps_clip_high=0.2),
}
# Terms whose aggregation is part of their definition (a mean over sequences).
SEQUENCE_TERMS = ("gspo", "gmpo")
DUAL_CLIP_TERMS = ("ppo_clip", "clip_cov")


_TRAIN = TrainSettings  # the class: its fields' defaults


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The objective. Clips are ratio offsets: the ratio is clipped to
  [1 - eps_clip, 1 + eps_clip_high]; eps_clip_high None means eps_clip (DAPO: 0.28).
  GMPO clips the log-ratio to [-eps_clip, eps_clip_high] instead.

  GSPO clips a sequence-level ratio and wants far smaller clips than PPO; build a term's
  config with `LossConfig.for_loss(name, ...)`, which applies its LOSS_DEFAULTS unless
  overridden.
  """

  # The fields a train section names the same mean the same and take its defaults
  # (settings/train.py); eps_clip and aggregation are resolved (PPO's here).
  policy_loss: str = _TRAIN.policy_loss  # see rl/policy_terms.py
  eps_clip: float = 0.2
  eps_clip_high: float | None = _TRAIN.eps_clip_high
  dual_clip_c: float | None = _TRAIN.dual_clip_c  # e.g. 3.0: caps the loss at -A*c for A < 0
  aggregation: str = "token_mean"  # see rl/aggregation.py
  norm_len: int | None = _TRAIN.norm_len  # seq_mean_token_sum_norm's and token_sum_norm's
  kl_coef: float = _TRAIN.kl_coef
  kl_type: str = _TRAIN.kl_type  # see rl/kl.py
  entropy_coef: float = _TRAIN.entropy_coef
  # clip_cov / kl_cov (rl/cov_tokens.py): the fraction of tokens selected, clip_cov's
  # window of covariances to select from, kl_cov's coefficient of |log r|.
  cov_ratio: float = _TRAIN.cov_ratio
  clip_cov_lb: float = _TRAIN.clip_cov_lb
  clip_cov_ub: float = _TRAIN.clip_cov_ub
  kl_cov_coef: float = _TRAIN.kl_cov_coef
  # A step makes one optimizer update, from the proximal params (one minibatch, one
  # epoch, ratio_anchor "proximal"): log r is 0 at its gradient but for float rounding.
  one_update: bool = False
  # The importance weight pi_prox / pi_behav (rl/corrections.py): its upper bound (None:
  # no weight), level, what happens outside [is_low, tis_cap], and the ratio's anchor.
  tis_cap: float | None = None
  is_level: str = _TRAIN.is_level  # token | sequence | geometric
  is_mode: str = _TRAIN.is_mode  # truncate | mask
  is_low: float = _TRAIN.is_low  # mask mode's lower bound
  ratio_anchor: str = _TRAIN.ratio_anchor  # proximal | behavior
  mask_stale_tokens: bool = _TRAIN.mask_stale_tokens

  @property
  def clip_high(self) -> float:
    return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

  @classmethod
  def for_loss(cls, policy_loss: str, **overrides) -> LossConfig:
    """A config of `policy_loss` with its LOSS_DEFAULTS, then `overrides`."""
    kw = dict(LOSS_DEFAULTS.get(policy_loss, {}), policy_loss=policy_loss)
    kw.update(overrides)
    return cls(**kw)

  @classmethod
  def for_gspo(cls, **overrides) -> LossConfig:
    """A GSPO config: GSPO's clips and aggregation, then `overrides`."""
    return cls.for_loss("gspo", **overrides)

  @classmethod
  def from_config(cls, train) -> LossConfig:
    """From the config's train section. Clips and aggregation left unset (None) take the
    policy loss's own defaults (LOSS_DEFAULTS; else PPO's 0.2 / eps_clip / token_mean).
    Unset (None) optional knobs are off; tis_cap is off at 0 too (the command line cannot
    set None, and TIS is on by default)."""
    chosen = {
        k: getattr(train, k)
        for k in ("eps_clip", "eps_clip_high", "aggregation")
        if getattr(train, k) is not None
    }
    rest = dict(
        dual_clip_c=train.dual_clip_c,
        norm_len=train.norm_len,
        kl_coef=train.kl_coef,
        kl_type=train.kl_type,
        entropy_coef=train.entropy_coef,
        cov_ratio=train.cov_ratio,
        clip_cov_lb=train.clip_cov_lb,
        clip_cov_ub=train.clip_cov_ub,
        kl_cov_coef=train.kl_cov_coef,
        one_update=(
            int(train.ppo_epochs) == 1
            and int(train.num_minibatches) == 1
            and train.ratio_anchor == "proximal"
        ),
        tis_cap=train.tis_cap or None,
        is_level=train.is_level,
        is_mode=train.is_mode,
        is_low=train.is_low,
        ratio_anchor=train.ratio_anchor,
        mask_stale_tokens=train.mask_stale_tokens,
    )
    return cls.for_loss(train.policy_loss, **chosen, **rest)


# ------------------------------------------------------------------------------ the loss


def effective_mask(cfg: LossConfig, mask_BxT: jax.Array, stale_BxT=None) -> jax.Array:
  """The float32 mask every term uses: mask, minus stale tokens when cfg masks them.
  Compute a batch's totals for microbatching on this mask."""
  mask_BxT = jnp.asarray(mask_BxT).astype(bool)
  if cfg.mask_stale_tokens and stale_BxT is not None:
    mask_BxT = mask_BxT & ~jnp.asarray(stale_BxT).astype(bool)
  return mask_BxT.astype(jnp.float32)


def _aggregator(cfg: LossConfig, mask_BxT, total_tokens, total_seqs, segments_BxT):
  """`aggregate` on this batch's mask, totals and segments: agg(x_BxT, mode) with mode
  cfg.aggregation unless given."""
  return lambda x_BxT, mode=cfg.aggregation: aggregate(
      x_BxT,
      mask_BxT,
      mode,
      total_tokens=total_tokens,
      total_seqs=total_seqs,
      norm_len=cfg.norm_len,
      segments_BxT=segments_BxT,
  )


def _sequence_geometric_mean(weight_BxT, mask_BxT, segments_BxT):
  """Each sequence's geometric mean of its tokens' weights, on every one of its tokens
  (how GMPO, a term per sequence, takes token-level weights, as verl's geo_mean does)."""
  log_w_BxT = jnp.where(mask_BxT > 0, jnp.log(weight_BxT + 1e-10), 0.0)
  log_w_S, index_BxT = seq_sums(log_w_BxT, segments_BxT)
  length_S = jnp.maximum(seq_sums(mask_BxT, segments_BxT)[0], 1.0)
  return jnp.exp(log_w_S / length_S)[index_BxT]


def _weighted_policy_term(
    cfg: LossConfig,
    logp_BxT,
    old_logp_BxT,
    advantages_B,
    mask_BxT,
    is_weight_BxT,
    segments_BxT,
    selected_BxT,
):
  """cfg.policy_loss's Term, its loss times the importance weight (no gradient; None:
  1; GMPO's per sequence, their geometric mean)."""
  term = get_policy_term(cfg.policy_loss)(
      cfg,
      logp_BxT,
      old_logp_BxT,
      advantages_B,
      mask_BxT,
      segments_BxT=segments_BxT,
      selected_BxT=selected_BxT,
  )
  if is_weight_BxT is None:
    return term
  weight_BxT = jax.lax.stop_gradient(jnp.asarray(is_weight_BxT, jnp.float32))
  if cfg.policy_loss == "gmpo":
    weight_BxT = _sequence_geometric_mean(weight_BxT, mask_BxT, segments_BxT)
  return term._replace(loss_BxT=term.loss_BxT * weight_BxT)


def _add_kl(cfg: LossConfig, loss, logp_BxT, ref_logp_BxT, mask_BxT, agg):
  """(loss, with kl_coef x the aggregated KL to the reference added when kl_coef > 0; that
  KL, 0 without ref_logp_BxT)."""
  kl = jnp.zeros((), jnp.float32)
  if ref_logp_BxT is not None:
    ref_logp_BxT = jax.lax.stop_gradient(jnp.asarray(ref_logp_BxT, jnp.float32))
    kl = agg(kl_penalty(logp_BxT, ref_logp_BxT, cfg.kl_type, mask_BxT))
    if cfg.kl_coef > 0:
      loss = loss + cfg.kl_coef * kl
  return loss, kl


def policy_loss(
    cfg: LossConfig,
    logp_BxT: jax.Array,
    old_logp_BxT: jax.Array,
    advantages_B: jax.Array,
    mask_BxT: jax.Array,
    *,
    is_weight_BxT=None,
    ref_logp_BxT=None,
    entropy_BxT=None,
    stale_BxT=None,
    total_tokens=None,
    total_seqs=None,
    segments_BxT=None,
    selected_BxT=None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The scalar loss to minimise, and scalar metrics. segments_BxT: packed rows' segment
  ids (each a sequence of its own; see rl/aggregation.py). selected_BxT: the tokens
  clip_cov and kl_cov treat apart (rl/cov_tokens.py; those two terms only).

  loss = aggregate(policy term * importance weight) + kl_coef * aggregate(KL)
         - entropy_coef * aggregate(entropy)
  is_weight_BxT: the weights from rl/corrections.py (None: 1); tokens a mask-mode
  correction removes are expected out of mask_BxT already.
  Metrics: pg_loss (the first term); token means of pg_clipfrac (the clip changed the
  term), pg_clipfrac_lower (the dual clip capped it), log_ratio_clamped_frac (a safety
  clamp bound the log-ratio) and ratio_mean; kl (aggregated; 0 without ref_logp), entropy
  (aggregated; only when entropy_BxT is given), num_tokens (sum of the effective mask).
  """
  mask_BxT = effective_mask(cfg, mask_BxT, stale_BxT)
  logp_BxT = jnp.asarray(logp_BxT, jnp.float32)
  old_logp_BxT = jax.lax.stop_gradient(jnp.asarray(old_logp_BxT, jnp.float32))
  advantages_B = jax.lax.stop_gradient(jnp.asarray(advantages_B, jnp.float32))
  agg = _aggregator(cfg, mask_BxT, total_tokens, total_seqs, segments_BxT)
  token_mean = lambda x_BxT: agg(jnp.asarray(x_BxT, jnp.float32), "token_mean")

  term = _weighted_policy_term(
      cfg, logp_BxT, old_logp_BxT, advantages_B, mask_BxT, is_weight_BxT, segments_BxT, selected_BxT
  )
  loss = pg_loss = agg(term.loss_BxT)
  loss, kl = _add_kl(cfg, loss, logp_BxT, ref_logp_BxT, mask_BxT, agg)

  metrics = {
      "pg_loss": pg_loss,
      "pg_clipfrac": token_mean(term.clipped_BxT),
      "pg_clipfrac_lower": token_mean(term.dual_clipped_BxT),
      "log_ratio_clamped_frac": token_mean(term.clamped_BxT),
      "kl": kl,
      "ratio_mean": token_mean(term.ratio_BxT),
      "num_tokens": jnp.sum(mask_BxT),
  }
  if entropy_BxT is not None:
    entropy = agg(jnp.asarray(entropy_BxT, jnp.float32))
    metrics["entropy"] = entropy
    if cfg.entropy_coef > 0:
      loss = loss - cfg.entropy_coef * entropy
  metrics = {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
  return loss, metrics


# ------------------------------------------------------------------------------ checking


def loss_config_problems(cfg: LossConfig, n_samples: int) -> list[str]:
  """Every problem of a LossConfig, each naming its field (empty: the config is valid)."""
  problems = []

  def need(ok: bool, field: str, why: str):
    if not ok:
      problems.append(f"LossConfig.{field}={getattr(cfg, field, None)!r}: {why}")

  need(cfg.policy_loss in POLICY_TERMS, "policy_loss", f"must be one of {sorted(POLICY_TERMS)}")
  need(cfg.aggregation in AGGREGATIONS, "aggregation", f"must be one of {sorted(AGGREGATIONS)}")
  need(cfg.kl_type in KL_PENALTIES, "kl_type", f"must be one of {sorted(KL_PENALTIES)}")
  need(cfg.eps_clip > 0, "eps_clip", "must be > 0")
  need(
      cfg.eps_clip_high is None or cfg.eps_clip_high > 0,
      "eps_clip_high",
      "must be > 0 (or None for eps_clip)",
  )
  problems += [
      f"LossConfig.{p}"
      for p in corrections.problems(
          cfg.is_level, cfg.is_mode, cfg.is_low, cfg.tis_cap, cfg.ratio_anchor
      )
  ]
  need(
      cfg.dual_clip_c is None or cfg.dual_clip_c > 1,
      "dual_clip_c",
      "must be > 1 (or None for no dual clip)",
  )
  need(
      cfg.dual_clip_c is None or cfg.policy_loss in DUAL_CLIP_TERMS,
      "dual_clip_c",
      f"the dual clip caps a PPO-clip term: policy_loss must be one of {list(DUAL_CLIP_TERMS)} "
      "(leave it unset)",
  )
  need(
      cfg.aggregation not in NEED_NORM_LEN or (cfg.norm_len or 0) > 0,
      "norm_len",
      f"{cfg.aggregation} needs a constant norm_len > 0 (e.g. the max response length)",
  )
  need(cfg.kl_coef >= 0, "kl_coef", "must be >= 0")
  need(cfg.entropy_coef >= 0, "entropy_coef", "must be >= 0")
  problems += _term_problems(cfg)
  if n_samples < 1:
    problems.append(f"n_samples={n_samples}: need at least 1 sample per prompt")
  return problems


def _term_problems(cfg: LossConfig) -> list[str]:
  """The problems of the knobs one policy term reads."""
  out = []

  def need(ok: bool, field: str, why: str):
    if not ok:
      out.append(f"LossConfig.{field}={getattr(cfg, field, None)!r}: {why}")

  if cfg.policy_loss == "gspo":
    # GSPO clips a length-normalised sequence ratio, which moves about 1000x less than a
    # token ratio: a PPO-size clip never binds.
    for field, value, default in (
        ("eps_clip", cfg.eps_clip, GSPO_EPS_CLIP),
        ("eps_clip_high", cfg.clip_high, GSPO_EPS_CLIP_HIGH),
    ):
      need(
          value < GSPO_MAX_CLIP,
          field,
          f"GSPO clips a sequence-level ratio: must be < {GSPO_MAX_CLIP} "
          f"(GSPO's default {default}; leave it unset for that)",
      )
  if cfg.policy_loss in SEQUENCE_TERMS:
    need(
        cfg.aggregation == "seq_mean_token_mean",
        "aggregation",
        f"{cfg.policy_loss.upper()} averages over sequences: must be 'seq_mean_token_mean' "
        "(leave it unset)",
    )
  if cfg.policy_loss in COVARIANCE_TERMS:
    need(0 < cfg.cov_ratio <= 1, "cov_ratio", "the fraction of tokens selected: in (0, 1]")
    need(cfg.kl_cov_coef >= 0, "kl_cov_coef", "must be >= 0")
    need(
        cfg.clip_cov_lb < cfg.clip_cov_ub,
        "clip_cov_lb",
        f"the covariance window [clip_cov_lb, clip_cov_ub] is empty (clip_cov_ub="
        f"{cfg.clip_cov_ub})",
    )
  return out


def validate_loss_config(cfg: LossConfig, n_samples: int) -> None:
  """Raises ValueError listing every problem (see loss_config_problems)."""
  problems = loss_config_problems(cfg, n_samples)
  if problems:
    raise ValueError("; ".join(problems))
