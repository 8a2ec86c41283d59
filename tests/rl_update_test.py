"""The learner: same-version logprobs match the sampler, sharding, accumulation and
length-sorted microbatches change nothing, a non-finite step is skipped, no reference params
without KL. Batches are built from hand-made samples (learner_batches.py), but for the one
test of a real scheduler step's batch."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax import sharding
from april_jax.models import qwen3
from april_jax.rl import advantages, batch as batch_lib
from april_jax.rl.update import Learner
from april_jax.data import PromptItem
from april_jax.rollout import AprilScheduler, RewardRunner, RolloutSettings
from april_jax.sampler import EngineConfig, SlotEngine
from april_jax.settings.train import TrainSettings
from conftest import mesh_or_skip, tiny_qwen3
import learner_batches

CFG = tiny_qwen3()
TEMPERATURE = 0.8


def _train_config(**overrides) -> TrainSettings:
  return dataclasses.replace(TrainSettings(), **{"lr": 1e-3, "logprob_chunk": 16, **overrides})


def _rollout_batch(params, seed=0):
  """A real scheduler step's rollouts (version 0) turned into a training batch."""
  engine = SlotEngine(
      CFG, params, EngineConfig(num_slots=6, max_len=48, sync_every=4, stop_ids=(3,))
  )
  counter = iter(range(10**6))

  def source():
    i = next(counter)
    prompt = np.random.default_rng([seed, i]).integers(4, CFG.vocab_size, 3 + i % 4)
    return PromptItem(prompt_id=i, tokens=prompt, answer="")

  settings = RolloutSettings(
      batch_size=2,
      n_samples_per_prompt=4,
      over_sampling_batch_size=4,
      max_response_len=24,
      temperature=TEMPERATURE,
  )
  rewards = RewardRunner(
      lambda text, answer: float(len(text)), decode=lambda ids: "x" * len(ids), processes=False
  )
  result = AprilScheduler(engine, settings, source, rewards, seed=seed).step(0)
  adv = np.asarray(advantages.get_advantage("grpo")(np.array([g.rewards for g in result.groups])))
  return batch_lib.TrainBatch.from_groups(result.groups, 0, max_len=48).with_advantages(adv)


def _batch(seed, **kw):
  """Two prompts' groups of four hand-made samples (learner_batches.random_batch)."""
  return learner_batches.random_batch(seed, CFG.vocab_size, **kw)


@pytest.fixture(scope="module")
def params():
  return qwen3.init_params(CFG, jax.random.key(0), std=0.3)


def test_learner_logprobs_equal_sampler_behavior_logprobs_same_version(params):
  batch = _rollout_batch(params)
  learner = Learner(
      CFG, jax.tree.map(jnp.copy, params), _train_config(), TEMPERATURE, total_updates=1
  )
  old = learner.logprobs(learner.params, batch)
  mask = batch["mask"] > 0
  assert mask.sum() > 20
  np.testing.assert_allclose(old[mask], batch["behavior"][mask], atol=2e-5)
  metrics = learner.update(batch)
  assert metrics["train/logprob_diff_mean"] < 1e-5
  assert metrics["train/skipped_updates"] == 0 and metrics["train/updates"] == 1


def test_update_changes_params_and_reduces_loss_on_repeat(params):
  batch = _batch(1)
  assert np.abs(batch["advantages"]).max() > 0.1
  learner = Learner(
      CFG,
      jax.tree.map(jnp.copy, params),
      _train_config(ppo_epochs=1),
      TEMPERATURE,
      total_updates=10,
  )
  before = jax.tree.map(
      lambda x: np.array(x, copy=True), learner.params
  )  # not a view: params are donated
  first = learner.update(batch)
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), learner.params, before)
  assert max(jax.tree.leaves(moved)) > 0
  assert np.isfinite(first["train/loss"]) and first["train/grad_norm"] > 0


def test_gradient_accumulation_equals_one_big_batch(params):
  batch = _batch(2)
  one = Learner(CFG, jax.tree.map(jnp.copy, params), _train_config(), TEMPERATURE, 1)
  two = Learner(
      CFG, jax.tree.map(jnp.copy, params), _train_config(num_microbatches=4), TEMPERATURE, 1
  )
  m1, m2 = one.update(batch), two.update(batch)
  assert m1["train/loss"] == pytest.approx(m2["train/loss"], abs=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6), one.params, two.params)


def _long_tail_batch(seed, T=48):
  """A batch padded to T, with its shortest row stretched to T: one long tail."""
  batch = _batch(seed)
  lengths = batch_lib.row_lengths(batch["mask"])
  assert lengths.max() <= 32
  pad = lambda x: np.pad(x, ((0, 0), (0, T - x.shape[1])))
  long = {k: pad(v) if v.ndim == 2 else v.copy() for k, v in batch.items()}
  row = int(np.argmin(lengths))
  start = int(lengths[row]) - 1  # the row's last response token, then the padding
  long["tokens"][row, start:] = 5
  long["targets"][row, start - 1 : -1] = 5
  long["mask"][row, start - 1 : -1] = 1.0
  long["behavior"][row, start - 1 : -1] = -3.0
  assert batch_lib.row_lengths(long["mask"])[row] == T
  return long


@pytest.mark.parametrize("minibatches,microbatches", [(1, 4), (2, 2)])
def test_length_sorted_microbatches_equal_plain_microbatches(params, minibatches, microbatches):
  batch = _long_tail_batch(seed=7)
  pieces = batch_lib.microbatches(batch["mask"], 4, by_length=True)
  assert sorted(T for _, T in pieces) == [32, 32, 32, 48]  # only the tail pays for 48
  cfg = lambda by_length: _train_config(
      num_minibatches=minibatches,
      num_microbatches=microbatches,
      microbatch_by_length=by_length,
      ppo_epochs=2,
      packing=False,
  )
  plain = Learner(CFG, jax.tree.map(jnp.copy, params), cfg(False), TEMPERATURE, 4)
  by_length = Learner(CFG, jax.tree.map(jnp.copy, params), cfg(True), TEMPERATURE, 4)
  mask = batch["mask"] > 0  # past a microbatch's cut there is nothing to score
  np.testing.assert_allclose(
      by_length.logprobs(by_length.params, batch)[mask],
      plain.logprobs(plain.params, batch)[mask],
      atol=1e-5,
  )
  m_plain, m_sorted = plain.update(batch), by_length.update(batch)
  assert m_sorted["train/updates"] == m_plain["train/updates"] == 2 * minibatches
  for k in (
      "train/loss",
      "train/pg_loss",
      "train/entropy",
      "train/grad_norm",
      "train/ratio_mean",
      "train/is_weight_mean",
  ):
    assert m_sorted[k] == pytest.approx(m_plain[k], rel=1e-4, abs=1e-6), k
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), plain.params, by_length.params
  )


def test_microbatch_plan_keeps_every_row_and_token():
  rng = np.random.default_rng(0)
  mask = np.zeros((12, 72), np.float32)
  ends = rng.integers(3, 71, size=12)
  for b, end in enumerate(ends):
    mask[b, 2:end] = 1.0
  mask[4] = 0.0  # a row with no response token
  pieces = batch_lib.microbatches(mask, 3, by_length=True)
  rows = np.concatenate([r.reshape(-1) for r, _ in pieces])
  assert sorted(rows) == list(range(12)) and all(r.shape == (1, 4) for r, _ in pieces)
  for r, T in pieces:
    assert T in batch_lib.all_bucket_lens(72)
    assert not mask[r.reshape(-1), T:].any()  # nothing masked is cut off
  lengths = [batch_lib.row_lengths(mask)[r].max() for r, _ in pieces]
  assert lengths == sorted(lengths) and batch_lib.row_lengths(mask)[4] == 1
  plain = batch_lib.microbatches(mask, 3, by_length=False)
  assert len(plain) == 1 and plain[0][1] == 72 and plain[0][0].shape == (3, 4)


@pytest.mark.parametrize("kl_coef,mesh_shape", [(0.0, None), (0.05, (2, 2, 2))])
def test_warm_up_compiles_every_update_program_ahead_of_time_without_running(
    params, kl_coef, mesh_shape, compiles
):
  mesh = mesh_or_skip(mesh_shape)
  batch = _long_tail_batch(seed=8)
  learner = Learner(
      CFG,
      jax.tree.map(jnp.copy, params),
      _train_config(num_microbatches=4, kl_coef=kl_coef),
      TEMPERATURE,
      2,
      mesh=mesh,
  )
  before = jax.tree.map(lambda x: np.array(x, copy=True), (learner.params, learner.opt_state))
  shapes = learner.warm_up(batch["tokens"].shape[0], batch_lib.all_bucket_lens(48))
  assert shapes >= 2 and compiles  # one per padded length; the listener sees compiles
  # Nothing ran: params and optimizer state are as they were, no update was counted.
  jax.tree.map(np.testing.assert_array_equal, (learner.params, learner.opt_state), before)
  assert learner.attempted == 0
  compiled = len(compiles)
  metrics = learner.update(batch)
  assert len(compiles) == compiled, compiles[compiled:]  # every program was ready
  assert metrics["train/updates"] == 1


def test_non_finite_update_is_skipped_and_counted(params):
  batch = _batch(3)
  batch["advantages"] = np.where(
      np.arange(len(batch["advantages"])) == 0, np.nan, batch["advantages"]
  ).astype(np.float32)
  learner = Learner(CFG, jax.tree.map(jnp.copy, params), _train_config(), TEMPERATURE, 1)
  before = jax.tree.map(
      lambda x: np.array(x, copy=True), learner.params
  )  # not a view: params are donated
  metrics = learner.update(batch)
  assert metrics["train/skipped_updates"] == 1 and metrics["train/updates"] == 0
  jax.tree.map(np.testing.assert_array_equal, learner.params, before)


def test_reference_params_held_only_with_kl(params):
  no_kl = Learner(CFG, jax.tree.map(jnp.copy, params), _train_config(kl_coef=0.0), TEMPERATURE, 1)
  kl = Learner(CFG, jax.tree.map(jnp.copy, params), _train_config(kl_coef=0.05), TEMPERATURE, 1)
  assert no_kl.ref_params is None and kl.ref_params is not None
  metrics = kl.update(_batch(4))
  assert metrics["train/kl"] == pytest.approx(0.0, abs=1e-6)  # first update: policy == ref


def test_off_policy_batch_uses_tis_and_reports_staleness(params):
  batch = _batch(5, stale=True)
  assert batch["stale"].any()  # partial samples carried across versions
  learner = Learner(CFG, jax.tree.map(jnp.copy, params), _train_config(tis_cap=2.0), TEMPERATURE, 1)
  metrics = learner.update(batch)
  assert np.isfinite(metrics["train/loss"]) and metrics["train/is_weight_mean"] > 0
  assert metrics["train/prox_behav_kl"] >= 0


def _updated(params, batch, **train):
  learner = Learner(CFG, jax.tree.map(jnp.copy, params), _train_config(**train), TEMPERATURE, 1)
  return learner.update(batch), learner.params


def _agreeing_batch(params, seed):
  """A batch whose behaviour logprobs are the learner's own (weights exactly 1)."""
  batch = _batch(seed)
  learner = Learner(CFG, jax.tree.map(jnp.copy, params), _train_config(), TEMPERATURE, 1)
  return dict(batch, behavior=learner.logprobs(learner.params, batch))


def test_a_sample_the_mask_correction_drops_trains_as_if_it_were_absent(params):
  batch = _agreeing_batch(params, seed=7)
  far = dict(batch, behavior=batch["behavior"].copy())
  far["behavior"][0] -= batch["mask"][0]  # row 0: every token's weight e, outside [0.5, 2]
  mask = dict(is_level="geometric", is_mode="mask", is_low=0.5, tis_cap=2.0)
  m_mask, p_mask = _updated(params, far, **mask)
  absent = dict(batch, mask=batch["mask"].copy())
  absent["mask"][0] = 0.0
  m_absent, p_absent = _updated(params, absent, tis_cap=0.0)
  assert m_mask["train/is_masked_frac"] == pytest.approx(
      batch["mask"][0].sum() / batch["mask"].sum()
  )
  assert m_mask["train/is_weight_max"] == pytest.approx(np.e, rel=1e-5)
  assert m_mask["train/loss"] == pytest.approx(m_absent["train/loss"], rel=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), p_mask, p_absent)


def test_the_behavior_anchor_is_coupled_ppo_and_skips_the_old_logprob_pass(params):
  batch = _agreeing_batch(params, seed=8)
  m_behavior, p_behavior = _updated(params, batch, ratio_anchor="behavior", tis_cap=0.0)
  m_proximal, p_proximal = _updated(params, batch, tis_cap=2.0)
  assert "train/logprob_diff_mean" not in m_behavior and "train/is_weight_mean" not in m_behavior
  assert m_proximal["train/is_weight_max"] == pytest.approx(1.0, abs=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), p_behavior, p_proximal)
  # Against a sampler 0.1 nats less sure of every token the ratio starts at e^0.1.
  shifted = dict(batch, behavior=batch["behavior"] - 0.1)
  m_shifted, _ = _updated(params, shifted, ratio_anchor="behavior", tis_cap=0.0)
  assert m_shifted["train/ratio_mean"] == pytest.approx(np.exp(0.1), rel=1e-4)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")
def test_sharded_update_equals_unsharded(params):
  batch = _batch(6)
  mesh = sharding.make_mesh((2, 2, 2))
  sharded_params = jax.device_put(jax.tree.map(jnp.copy, params), qwen3.param_shardings(CFG, mesh))
  plain = Learner(CFG, jax.tree.map(jnp.copy, params), _train_config(), TEMPERATURE, 1)
  sharded = Learner(CFG, sharded_params, _train_config(), TEMPERATURE, 1, mesh=mesh)
  m_plain, m_sharded = plain.update(batch), sharded.update(batch)
  assert m_plain["train/loss"] == pytest.approx(m_sharded["train/loss"], abs=1e-5)
  q = sharded.params["layers"]["q"]
  assert q.dtype == jnp.float32  # the masters
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  mu_q = sharded.opt_state.inner_state[1][0].mu["layers"]["q"]  # AdamW's 1st moment: like q
  assert mu_q.dtype == jnp.float32 and mu_q.sharding.spec == q.sharding.spec
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5),
      plain.params,
      sharded.params,
  )


def test_lr_1e_6_adamw_step_changes_bf16_decoded_weights():
  params = qwen3.init_params(CFG, jax.random.key(1), std=0.02)
  batch = _batch(3)
  learner = Learner(CFG, params, _train_config(lr=1e-6), TEMPERATURE, 1, compute_dtype="bfloat16")
  masters_before = jax.tree.map(np.asarray, learner.params)
  decoded_before = jax.tree.map(np.asarray, learner.decode_params())
  assert learner.params["layers"]["q"].dtype == jnp.float32
  assert decoded_before["layers"]["q"].dtype == jnp.bfloat16
  learner.update(batch)
  masters_after = jax.tree.map(np.asarray, learner.params)
  decoded_after = jax.tree.map(np.asarray, learner.decode_params())
  q0, q1 = masters_before["layers"]["q"], masters_after["layers"]["q"]
  # Adam's first step moves every weight with a gradient by about lr.
  moved = np.abs(q1 - q0)
  assert np.mean(moved > 0) > 0.9 and np.median(moved[moved > 0]) == pytest.approx(1e-6, rel=0.2)
  # The float32 masters carry the change into the bf16 copy wherever it crosses a rounding
  # boundary; held in bf16 itself (bf16(w) + 1e-6 == bf16(w)) the step would be lost.
  changed = sum(
      int(np.sum(a != b))
      for a, b in zip(jax.tree.leaves(decoded_after), jax.tree.leaves(decoded_before))
  )
  assert changed > 20
  q16 = np.asarray(jnp.asarray(q0, jnp.bfloat16))
  lost = np.asarray(jnp.asarray(q16) + jnp.asarray(np.sign(q1 - q0) * 1e-6, jnp.bfloat16))
  big = np.abs(q0) > 1e-3  # half a bf16 ulp exceeds 1e-6 here
  assert big.mean() > 0.9 and np.array_equal(lost[big], q16[big])


def test_reinforce_pp_puts_the_kl_to_the_reference_into_each_tokens_return(params):
  batch = dict(_batch(9), rewards=np.linspace(-1.0, 1.0, 8))
  train = dict(advantage="reinforce_plus_plus", tis_cap=0.0)
  a = Learner(CFG, jax.tree.map(jnp.copy, params), _train_config(reward_kl_coef=0.5, **train),
              TEMPERATURE, 2)  # fmt: skip
  b = Learner(CFG, jax.tree.map(jnp.copy, params), _train_config(**train), TEMPERATURE, 2)
  reference = jax.tree.map(jnp.copy, b.params)
  for _ in range(2):  # the second update: the policy has moved off the reference
    learner_batches.learn_once(learner_batches.train_batch(batch, 4), a)
    adv = advantages.reinforce_pp_kl_advantages(
        batch["rewards"], b.logprobs(b.params, batch), b.logprobs(reference, batch),
        batch["mask"], 0.5,
    )  # fmt: skip
    b.update(dict(batch, advantages=adv))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), a.params, b.params)
  # ... and the KL changed the second update: without it the params differ.
  c = Learner(CFG, jax.tree.map(jnp.copy, params), _train_config(**train), TEMPERATURE, 2)
  flat = advantages.reinforce_pp_kl_advantages(
      batch["rewards"], np.zeros_like(batch["mask"]), np.zeros_like(batch["mask"]),
      batch["mask"], 0.0,
  )  # fmt: skip
  for _ in range(2):
    c.update(dict(batch, advantages=flat))
  diff = max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(
      jax.tree.leaves(a.params), jax.tree.leaves(c.params)))  # fmt: skip
  assert diff > 1e-6
