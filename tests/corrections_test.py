"""Stale-data corrections (rl/corrections.py) against hand computations: importance
weights at token, sequence and geometric level, truncated or masked, their metrics, and
what the learner does with them (a masked sample trains as if it were absent; a coupled
PPO anchor equals the proximal one when the sampler agrees with the learner)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.rl import corrections
from april_jax.rl.losses import LossConfig, validate_loss_config

# Two samples: row 0 has three trained tokens, row 1 two (its last position is padding,
# where the logprobs hold garbage that must not matter).
MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
LOG_W = np.array([[math.log(0.25), math.log(1.5), math.log(3.0)], [0.1, 0.2, 99.0]])
BEHAVIOR = np.array([[-1.0, -2.0, -0.5], [-0.3, -1.2, -7.0]])
PROX = BEHAVIOR + LOG_W


def _weights(level, mode, low=0.0, high=2.0):
  return corrections.importance_weights(level, mode, low, high, PROX, BEHAVIOR, MASK)


def test_token_truncation_is_tis():
  w = _weights("token", "truncate")
  np.testing.assert_allclose(
      w.weight_BxT, [[0.25, 1.5, 2.0], [math.exp(0.1), math.exp(0.2), 1.0]], rtol=1e-6
  )
  assert w.keep_BxT.tolist() == [[True, True, True], [True, True, False]]
  assert w.metrics["is_outside_frac"] == pytest.approx(1 / 5)  # the 3.0, cut to 2
  assert w.metrics["is_masked_frac"] == 0.0
  assert w.metrics["is_weight_max"] == pytest.approx(3.0)
  assert w.metrics["is_weight_min"] == pytest.approx(0.25)
  raw = [0.25, 1.5, 3.0, math.exp(0.1), math.exp(0.2)]
  assert w.metrics["is_weight_mean"] == pytest.approx(sum(raw) / 5)
  kl = sum(r - 1 - math.log(r) for r in raw) / 5  # k3 of KL(behav || prox)
  assert w.metrics["prox_behav_kl"] == pytest.approx(kl)


def test_token_mask_is_icepop_the_outside_tokens_leave_the_loss():
  w = _weights("token", "mask", low=0.5, high=2.0)
  np.testing.assert_allclose(
      w.weight_BxT, [[0.0, 1.5, 0.0], [math.exp(0.1), math.exp(0.2), 1.0]], rtol=1e-6
  )
  assert w.keep_BxT.tolist() == [[False, True, False], [True, True, False]]
  assert w.metrics["is_masked_frac"] == pytest.approx(2 / 5)
  assert w.metrics["is_outside_frac"] == pytest.approx(2 / 5)


def test_sequence_weight_is_the_product_of_token_weights_on_every_token():
  w = _weights("sequence", "truncate", high=2.0)
  row0 = 0.25 * 1.5 * 3.0  # 1.125: inside
  row1 = math.exp(0.3)  # 1.35: inside
  np.testing.assert_allclose(w.weight_BxT, [[row0] * 3, [row1, row1, 1.0]], rtol=1e-6)
  w = _weights("sequence", "truncate", high=1.2)
  np.testing.assert_allclose(w.weight_BxT, [[row0] * 3, [1.2, 1.2, 1.0]], rtol=1e-6)
  assert w.metrics["is_outside_frac"] == pytest.approx(2 / 5)


def test_geometric_mask_drops_whole_samples_by_their_per_token_mean():
  geo0 = (0.25 * 1.5 * 3.0) ** (1 / 3)  # 1.040
  geo1 = math.exp(0.15)  # 1.162
  w = _weights("geometric", "mask", low=0.9, high=1.1)
  np.testing.assert_allclose(w.weight_BxT, [[geo0] * 3, [0.0, 0.0, 1.0]], rtol=1e-6)
  assert w.keep_BxT.tolist() == [[True, True, True], [False, False, False]]
  assert w.metrics["is_masked_frac"] == pytest.approx(2 / 5)
  assert w.metrics["is_weight_max"] == pytest.approx(geo1)


def test_without_an_upper_bound_the_weights_are_one_and_only_measured():
  w = _weights("token", "mask", high=None)
  np.testing.assert_array_equal(w.weight_BxT, np.ones_like(MASK))
  assert w.keep_BxT.tolist() == (MASK > 0).tolist()
  assert w.metrics["is_weight_max"] == pytest.approx(3.0)
  assert w.metrics["is_outside_frac"] == 0.0


def test_a_sequence_weight_of_exp_hundreds_stays_finite():
  w = corrections.importance_weights(
      "sequence", "mask", 0.5, 2.0, np.full((1, 8), 0.0), np.full((1, 8), -50.0), np.ones((1, 8))
  )
  assert np.isfinite(w.metrics["is_weight_max"]) and np.isfinite(w.metrics["prox_behav_kl"])
  assert not w.keep_BxT.any() and w.metrics["is_masked_frac"] == 1.0


def test_combinations_that_make_no_sense_are_refused_together_by_name():
  cfg = LossConfig(tis_cap=2.0, ratio_anchor="behavior", is_mode="truncate", is_low=0.3)
  with pytest.raises(ValueError) as e:
    validate_loss_config(cfg, n_samples=4)
  assert "ratio_anchor='behavior'" in str(e.value) and "is_low=0.3" in str(e.value)
  for bad, field in (
      (dict(is_level="word"), "is_level"),
      (dict(is_mode="clip"), "is_mode"),
      (dict(ratio_anchor="old"), "ratio_anchor"),
      (dict(tis_cap=2.0, is_mode="mask", is_low=1.5), "is_low"),
      (dict(tis_cap=0.9), "tis_cap"),
  ):
    with pytest.raises(ValueError, match=field):
      validate_loss_config(LossConfig(**bad), n_samples=4)
  validate_loss_config(LossConfig(ratio_anchor="behavior"), n_samples=4)  # no weight: fine
  validate_loss_config(
      LossConfig(tis_cap=5.0, is_mode="mask", is_low=0.5, is_level="token"), n_samples=4
  )
