"""Policy losses for the RL update: PPO-clip and GSPO, importance-weighted, with KL and
entropy terms.

Two logprobs of the same response tokens enter the policy term:
  logp           the learner's current policy: the only one differentiated.
  old_logp       the ratio's anchor (no gradient): the learner's policy before this update
                 (recomputed, the proximal policy) or, with ratio_anchor "behavior", what
                 the sampler recorded while drawing the tokens.
Each token's term is multiplied by an importance weight (no gradient) that corrects for
the tokens older params drew (APRIL's partial rollouts) and for the sampler's numerics:
rl/corrections.py builds it from the proximal and behaviour logprobs (TIS, IcePop, MIS,
decoupled PPO).

Per-token losses are reduced by `aggregate`. For gradient accumulation the caller passes
the whole batch's `total_tokens` / `total_seqs` (see `batch_totals`, on the mask from
`effective_mask`) with every microbatch; then the loss and every metric but num_tokens
are additive: summed over microbatches they equal the full-batch values (num_tokens is
a plain count, additive too).

A sequence is a row, or in packed rows (rl/layout.py, `segments_BxT` given) the tokens of
a row that share a segment id: every per-sequence reduction (a sequence's mean, GSPO's
sequence ratio, the count of sequences) goes through `seq_sums`, so packed and unpacked
layouts give the same values.

Policy terms are registered by name; each returns per-token values:

    fn(cfg, logp_BxT, old_logp_BxT, advantages, mask_BxT[, segments_BxT=...])
        -> (loss_BxT, clipped_BxT, ratio_BxT)

segments_BxT is passed (by keyword) only for packed rows; a term that reduces per
sequence must take it and reduce with `seq_sums`.

advantages are per sample [B] (group estimators) or per token [B, T] (a critic's GAE).

Everything is pure jnp; `cfg` is a frozen dataclass, so it can be a static jit argument.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from april_jax.registry import Registry
from april_jax.rl import corrections

GSPO_EPS_CLIP = 3e-4
GSPO_EPS_CLIP_HIGH = 4e-4
GSPO_MAX_CLIP = 0.01  # larger clips on a sequence ratio are token-level clips by mistake


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The objective. Clips are ratio offsets: the ratio is clipped to
  [1 - eps_clip, 1 + eps_clip_high]; eps_clip_high None means eps_clip (DAPO: 0.28).

  GSPO clips a sequence-level ratio and wants far smaller clips than PPO; build GSPO
  configs with `LossConfig.for_gspo(...)`, which applies GSPO_EPS_CLIP /
  GSPO_EPS_CLIP_HIGH and GSPO's seq_mean_token_mean unless overridden.
  """

  policy_loss: str = "ppo_clip"  # "ppo_clip" | "gspo"
  eps_clip: float = 0.2
  eps_clip_high: float | None = None
  dual_clip_c: float | None = None  # e.g. 3.0: caps the loss at -A*c for A < 0
  aggregation: str = "token_mean"  # see AGGREGATIONS
  norm_len: int | None = None  # Dr. GRPO constant, for seq_mean_token_sum_norm
  kl_coef: float = 0.0
  kl_type: str = "low_var_kl"  # "k1" | "k3" | "low_var_kl"
  entropy_coef: float = 0.0
  # The importance weight pi_prox / pi_behav (rl/corrections.py): its upper bound (None:
  # no weight), level, what happens outside [is_low, tis_cap], and the ratio's anchor.
  tis_cap: float | None = None
  is_level: str = "token"  # token | sequence | geometric
  is_mode: str = "truncate"  # truncate | mask
  is_low: float = 0.0  # mask mode's lower bound
  ratio_anchor: str = "proximal"  # proximal | behavior
  mask_stale_tokens: bool = False

  @property
  def clip_high(self) -> float:
    return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

  @classmethod
  def for_gspo(cls, **overrides) -> LossConfig:
    """A GSPO config: GSPO's clips and aggregation, then `overrides`."""
    kw = dict(
        policy_loss="gspo",
        eps_clip=GSPO_EPS_CLIP,
        eps_clip_high=GSPO_EPS_CLIP_HIGH,
        aggregation="seq_mean_token_mean",
    )
    kw.update(overrides)
    return cls(**kw)

  @classmethod
  def from_config(cls, train) -> LossConfig:
    """From the config's train section. Clips and aggregation left unset (None) take the
    policy loss's own defaults: PPO's 0.2 / eps_clip / token_mean, GSPO's (for_gspo).
    Unset (None) optional knobs are off; tis_cap is off at 0 too (the command line cannot
    set None, and TIS is on by default)."""
    chosen = {
        k: train[k] for k in ("eps_clip", "eps_clip_high", "aggregation") if train[k] is not None
    }
    rest = dict(
        dual_clip_c=train.dual_clip_c,
        norm_len=train.norm_len,
        kl_coef=train.kl_coef,
        kl_type=train.kl_type,
        entropy_coef=train.entropy_coef,
        tis_cap=train.tis_cap or None,
        is_level=train.is_level,
        is_mode=train.is_mode,
        is_low=train.is_low,
        ratio_anchor=train.ratio_anchor,
        mask_stale_tokens=train.mask_stale_tokens,
    )
    if train.policy_loss == "gspo":
      return cls.for_gspo(**chosen, **rest)
    return cls(policy_loss=train.policy_loss, **chosen, **rest)


# --------------------------------------------------------------------------- aggregation


def _masked_log_ratio(a_BxT, b_BxT, mask_BxT):
  """a - b on masked tokens, 0 elsewhere, so padding never reaches an exp."""
  return jnp.where(mask_BxT > 0, a_BxT - b_BxT, 0.0)


def seq_sums(x_BxT: jax.Array, segments_BxT=None) -> tuple[jax.Array, jax.Array]:
  """Sums of x over every sequence [S], and each token's sequence index [B, T] (to read
  them per token: sums[index]). Without segments a sequence is a row (S = B); with them,
  the tokens of a row sharing a segment id (ids in [0, T): S = B * T, most empty)."""
  B, T = x_BxT.shape
  if segments_BxT is None:
    return jnp.sum(x_BxT, axis=-1), jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  index_BxT = segments_BxT + T * jnp.arange(B)[:, None]
  return jax.ops.segment_sum(x_BxT.reshape(-1), index_BxT.reshape(-1), B * T), index_BxT


def batch_totals(mask_BxT: jax.Array, segments_BxT=None) -> tuple[jax.Array, jax.Array]:
  """(total_tokens, total_seqs) of a batch: masked tokens, and sequences with >= 1 of
  them (all-padding rows do not count as sequences)."""
  mask_BxT = jnp.asarray(mask_BxT, jnp.float32)
  lengths_S = seq_sums(mask_BxT, segments_BxT)[0]
  return jnp.sum(mask_BxT), jnp.sum(lengths_S > 0).astype(jnp.float32)


def _token_mean(x_BxT, mask_BxT, total_tokens, total_seqs, norm_len, segments_BxT=None):
  del total_seqs, norm_len, segments_BxT
  return jnp.sum(x_BxT * mask_BxT) / jnp.maximum(total_tokens, 1.0)


def _seq_mean_token_mean(x_BxT, mask_BxT, total_tokens, total_seqs, norm_len, segments_BxT=None):
  del total_tokens, norm_len
  sums_S = seq_sums(x_BxT * mask_BxT, segments_BxT)[0]
  per_seq_S = sums_S / jnp.maximum(seq_sums(mask_BxT, segments_BxT)[0], 1.0)
  return jnp.sum(per_seq_S) / jnp.maximum(total_seqs, 1.0)


def _seq_mean_token_sum_norm(
    x_BxT, mask_BxT, total_tokens, total_seqs, norm_len, segments_BxT=None
):
  del total_tokens, segments_BxT
  if not norm_len or norm_len <= 0:
    raise ValueError(f"seq_mean_token_sum_norm needs norm_len > 0; got norm_len={norm_len}")
  return jnp.sum(x_BxT * mask_BxT) / (jnp.maximum(total_seqs, 1.0) * norm_len)


AGGREGATIONS: dict[str, Callable[..., jax.Array]] = {
    "token_mean": _token_mean,  # DAPO: every token weighs the same
    "seq_mean_token_mean": _seq_mean_token_mean,  # GRPO / GSPO: every sequence does
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,  # Dr. GRPO: constant normaliser
}


def aggregate(
    x_BxT: jax.Array,
    mask_BxT: jax.Array,
    mode: str,
    *,
    total_tokens=None,
    total_seqs=None,
    norm_len: int | None = None,
    segments_BxT=None,
) -> jax.Array:
  """Reduces per-token values to a scalar; totals default to this batch's (batch_totals).

  Masked-out positions contribute nothing, even when they hold inf or NaN.
  """
  if mode not in AGGREGATIONS:
    raise KeyError(f"unknown aggregation {mode!r}; known aggregations: {sorted(AGGREGATIONS)}")
  mask_BxT = jnp.asarray(mask_BxT, jnp.float32)
  x_BxT = jnp.where(mask_BxT > 0, jnp.asarray(x_BxT, jnp.float32), 0.0)
  own_tokens, own_seqs = batch_totals(mask_BxT, segments_BxT)
  total_tokens = own_tokens if total_tokens is None else jnp.asarray(total_tokens, jnp.float32)
  total_seqs = own_seqs if total_seqs is None else jnp.asarray(total_seqs, jnp.float32)
  return AGGREGATIONS[mode](x_BxT, mask_BxT, total_tokens, total_seqs, norm_len, segments_BxT)


# ------------------------------------------------------------------------------ KL terms


def _kl_k1(log_ratio_BxT):
  return -log_ratio_BxT


def _kl_k3(log_ratio_BxT):
  return jnp.exp(log_ratio_BxT) - log_ratio_BxT - 1.0


def _kl_low_var(log_ratio_BxT):
  # The inner clamp (as in verl) leaves the value unchanged (|log_ratio| > 20 already
  # gives k3 > 10) but keeps exp finite, so the gradient cannot become inf * 0 = NaN.
  return jnp.clip(_kl_k3(jnp.clip(log_ratio_BxT, -20.0, 20.0)), -10.0, 10.0)


# Each takes log_ratio = ref_logp - logp and returns the per-token KL(pi || ref) estimate.
KL_PENALTIES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "k1": _kl_k1,
    "k3": _kl_k3,
    "low_var_kl": _kl_low_var,
}


def kl_penalty(
    logp_BxT: jax.Array, ref_logp_BxT: jax.Array, kl_type: str, mask_BxT: jax.Array | None = None
) -> jax.Array:
  """Per-token KL estimate of kl_type between the current policy and the reference
  (0 on tokens outside mask_BxT, when given)."""
  if kl_type not in KL_PENALTIES:
    raise KeyError(f"unknown kl_type {kl_type!r}; known kl types: {sorted(KL_PENALTIES)}")
  ref_logp_BxT = jnp.asarray(ref_logp_BxT, jnp.float32)
  if mask_BxT is None:
    mask_BxT = jnp.ones(jnp.shape(logp_BxT), jnp.float32)
  return KL_PENALTIES[kl_type](_masked_log_ratio(ref_logp_BxT, logp_BxT, mask_BxT))


# -------------------------------------------------------------------------- policy terms

PolicyLossFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]

POLICY_LOSSES = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.lookup


def _per_token(advantages) -> jax.Array:
  """Advantages [B] as [B, 1], or [B, T] as they are: either broadcasts over tokens."""
  return advantages[:, None] if advantages.ndim == 1 else advantages


def _clipped_surrogate(cfg: LossConfig, ratio_BxT, adv_Bx1):
  """PPO's pessimistic surrogate; returns (loss_BxT, clipped_BxT)."""
  pg_BxT = -adv_Bx1 * ratio_BxT
  pg_clipped_BxT = -adv_Bx1 * jnp.clip(ratio_BxT, 1.0 - cfg.eps_clip, 1.0 + cfg.clip_high)
  return jnp.maximum(pg_BxT, pg_clipped_BxT), pg_clipped_BxT > pg_BxT


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    cfg: LossConfig, logp_BxT, old_logp_BxT, advantages_B, mask_BxT, segments_BxT=None
):
  """Token-level PPO-clip (clip-higher when eps_clip_high > eps_clip), optionally
  dual-clipped: for A < 0 the loss is capped at -A * dual_clip_c."""
  del segments_BxT  # every term is a token's own
  adv_Bx1 = _per_token(advantages_B)
  ratio_BxT = jnp.exp(_masked_log_ratio(logp_BxT, old_logp_BxT, mask_BxT))
  loss_BxT, clipped_BxT = _clipped_surrogate(cfg, ratio_BxT, adv_Bx1)
  if cfg.dual_clip_c is not None:
    loss_BxT = jnp.where(adv_Bx1 < 0, jnp.minimum(loss_BxT, -adv_Bx1 * cfg.dual_clip_c), loss_BxT)
  return loss_BxT, clipped_BxT, ratio_BxT


@register_policy_loss("gspo")
def gspo_loss(cfg: LossConfig, logp_BxT, old_logp_BxT, advantages_B, mask_BxT, segments_BxT=None):
  """GSPO in its token form: s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)), where
  s_i = exp(mean_t (logp - old_logp)) is the length-normalised sequence ratio. Its
  value is s_i on every token and its gradient that of sequence-level GSPO."""
  log_ratio_BxT = _masked_log_ratio(logp_BxT, old_logp_BxT, mask_BxT)
  log_ratio_S, index_BxT = seq_sums(log_ratio_BxT, segments_BxT)
  s_S = jnp.exp(log_ratio_S / jnp.maximum(seq_sums(mask_BxT, segments_BxT)[0], 1.0))
  live_logp_BxT = jnp.where(mask_BxT > 0, logp_BxT, 0.0)  # padding may hold -inf
  ratio_BxT = jax.lax.stop_gradient(s_S)[index_BxT] * jnp.exp(
      live_logp_BxT - jax.lax.stop_gradient(live_logp_BxT)
  )
  loss_BxT, clipped_BxT = _clipped_surrogate(cfg, ratio_BxT, _per_token(advantages_B))
  return loss_BxT, clipped_BxT, ratio_BxT


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


def _weighted_policy_term(
    cfg: LossConfig, logp_BxT, old_logp_BxT, advantages_B, mask_BxT, is_weight_BxT, segments_BxT
):
  """cfg.policy_loss's per-token term (given segments_BxT only for packed rows), the loss
  times the importance weight (no gradient; None: 1): (loss_BxT, clipped_BxT, ratio_BxT)."""
  packed = {} if segments_BxT is None else {"segments_BxT": segments_BxT}
  term_BxT, clipped_BxT, ratio_BxT = get_policy_loss(cfg.policy_loss)(
      cfg, logp_BxT, old_logp_BxT, advantages_B, mask_BxT, **packed
  )
  if is_weight_BxT is not None:
    term_BxT = term_BxT * jax.lax.stop_gradient(jnp.asarray(is_weight_BxT, jnp.float32))
  return term_BxT, clipped_BxT, ratio_BxT


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
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The scalar loss to minimise, and scalar metrics. segments_BxT: packed rows' segment
  ids (each a sequence of its own; see the module docstring).

  loss = aggregate(policy term * importance weight) + kl_coef * aggregate(KL)
         - entropy_coef * aggregate(entropy)
  is_weight_BxT: the weights from rl/corrections.py (None: 1); tokens a mask-mode
  correction removes are expected out of mask_BxT already.
  Metrics: pg_loss (the first term), pg_clipfrac, ratio_mean (token means), kl
  (aggregated; 0 without ref_logp), entropy (aggregated; only when entropy_BxT is given),
  num_tokens (sum of the effective mask).
  """
  mask_BxT = effective_mask(cfg, mask_BxT, stale_BxT)
  logp_BxT = jnp.asarray(logp_BxT, jnp.float32)
  old_logp_BxT = jax.lax.stop_gradient(jnp.asarray(old_logp_BxT, jnp.float32))
  advantages_B = jax.lax.stop_gradient(jnp.asarray(advantages_B, jnp.float32))
  agg = _aggregator(cfg, mask_BxT, total_tokens, total_seqs, segments_BxT)
  token_mean = lambda x_BxT: agg(jnp.asarray(x_BxT, jnp.float32), "token_mean")

  term_BxT, clipped_BxT, ratio_BxT = _weighted_policy_term(
      cfg, logp_BxT, old_logp_BxT, advantages_B, mask_BxT, is_weight_BxT, segments_BxT
  )
  loss = pg_loss = agg(term_BxT)
  loss, kl = _add_kl(cfg, loss, logp_BxT, ref_logp_BxT, mask_BxT, agg)

  metrics = {
      "pg_loss": pg_loss,
      "pg_clipfrac": token_mean(clipped_BxT),
      "kl": kl,
      "ratio_mean": token_mean(ratio_BxT),
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

  need(cfg.policy_loss in POLICY_LOSSES, "policy_loss", f"must be one of {sorted(POLICY_LOSSES)}")
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
      cfg.aggregation != "seq_mean_token_sum_norm" or (cfg.norm_len or 0) > 0,
      "norm_len",
      "seq_mean_token_sum_norm needs a constant norm_len > 0 (e.g. the max response length)",
  )
  need(cfg.kl_coef >= 0, "kl_coef", "must be >= 0")
  need(cfg.entropy_coef >= 0, "entropy_coef", "must be >= 0")
  if cfg.policy_loss == "gspo":
    # GSPO clips a length-normalised sequence ratio, which moves about 1000x less than a
    # token ratio: a PPO-size clip never binds, and a token-weighted mean is not GSPO.
    need(
        cfg.eps_clip < GSPO_MAX_CLIP,
        "eps_clip",
        f"GSPO clips a sequence-level ratio: must be < {GSPO_MAX_CLIP} "
        f"(GSPO's default {GSPO_EPS_CLIP}; leave it unset for that)",
    )
    need(
        cfg.clip_high < GSPO_MAX_CLIP,
        "eps_clip_high",
        f"GSPO clips a sequence-level ratio: must be < {GSPO_MAX_CLIP} "
        f"(GSPO's default {GSPO_EPS_CLIP_HIGH}; leave it unset for that)",
    )
    need(
        cfg.aggregation == "seq_mean_token_mean",
        "aggregation",
        "GSPO averages over sequences: must be 'seq_mean_token_mean' (leave it unset)",
    )
  if n_samples < 1:
    problems.append(f"n_samples={n_samples}: need at least 1 sample per prompt")
  return problems


def validate_loss_config(cfg: LossConfig, n_samples: int) -> None:
  """Raises ValueError listing every problem (see loss_config_problems)."""
  problems = loss_config_problems(cfg, n_samples)
  if problems:
    raise ValueError("; ".join(problems))
