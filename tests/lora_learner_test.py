"""The LoRA learner (train.lora): adapters over a frozen base. With B = 0 it is the base
model exactly; an update moves the adapters and leaves every base weight bit for bit;
the sampler's merged params draw the greedy tokens the learner's unmerged passes give;
a checkpoint of another base is refused; the critic trains adapters over the shared base."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.errors import InputError
from april_jax.run import lora_base
from april_jax.models import lora, peft_io, qwen3
from april_jax.rl import critic as critic_lib
from april_jax.rl.update import Learner
from april_jax.sampler import generate
from april_jax.settings.train import LoraSettings, TrainSettings
from conftest import mesh_or_skip, tiny_qwen3
import learner_batches

CFG = tiny_qwen3()
TEMPERATURE = 0.8
SPEC = lora.LoraSpec(rank=4, alpha=8.0)


def _train(**overrides):
  lora_settings = LoraSettings(rank=SPEC.rank, alpha=SPEC.alpha, lr=1e-2)
  t = dict(lr=1e-3, logprob_chunk=16, lora=lora_settings)
  return dataclasses.replace(TrainSettings(), **{**t, **overrides})


@pytest.fixture(scope="module")
def params():
  return qwen3.init_params(CFG, jax.random.key(0), std=0.3)


def _lora_learner(params, mesh=None, **train):
  return Learner(CFG, params, _train(**train), TEMPERATURE, 4, mesh=mesh, lora=SPEC, seed=1)


def _batch(seed):
  return learner_batches.random_batch(seed, CFG.vocab_size)


def test_with_b_zero_the_lora_policy_is_the_base_exactly(params):
  full = Learner(CFG, params, _train(), TEMPERATURE, 1)
  adapted = _lora_learner(params)
  assert all(float(jnp.abs(ab["a"]).max()) > 0 for ab in adapted.params["layers"].values())
  batch = _batch(0)
  np.testing.assert_array_equal(
      adapted.logprobs(adapted.params, batch), full.logprobs(full.params, batch)
  )
  decoded = jax.tree.map(np.asarray, adapted.decode_params())
  jax.tree.map(np.testing.assert_array_equal, decoded, jax.tree.map(np.asarray, params))


def test_an_update_trains_the_adapters_and_leaves_the_base_bit_for_bit(params):
  learner = _lora_learner(params, kl_coef=0.05)  # a KL to the base: the reference pass too
  base_before = jax.tree.map(np.array, learner.frozen)
  adapters_before = jax.tree.map(np.array, learner.params)
  batch = _batch(1)
  before = learner.logprobs(learner.params, batch)
  metrics = learner.update(batch)
  assert metrics["train/updates"] == 1 and np.isfinite(metrics["train/loss"])
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, learner.frozen), base_before)
  for target in SPEC.targets:
    assert np.abs(np.asarray(learner.params["layers"][target]["b"])).max() > 0, target
  # With B = 0, A's gradient (x^T dy B^T) is 0: the first update moves B alone, the next A.
  moved = lambda: {
      (t, side): float(np.abs(np.asarray(ab[side]) - adapters_before["layers"][t][side]).max())
      for t, ab in learner.params["layers"].items()
      for side in ab
  }
  assert {k: v > 0 for k, v in moved().items()} == {(t, s): s == "b" for t, s in moved()}
  learner.update(_batch(6))
  assert min(moved().values()) > 0
  assert learner.ref_params is None  # the base is the reference: no copy held
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, learner.frozen), base_before)
  after = learner.logprobs(learner.params, batch)
  assert np.abs(after - before)[batch["mask"] > 0].max() > 1e-4
  # The optimizer holds the adapters' moments only.
  sizes = sum(x.size for x in jax.tree.leaves(learner.opt_state) if x.ndim)
  assert sizes == 2 * lora.num_params(CFG, SPEC)


def _greedy_unmerged(learner, prompt, steps):
  """Greedy tokens from the learner's own unmerged forward passes, one token at a time."""
  tokens = list(prompt)
  for _ in range(steps):
    h = qwen3.hidden_states(
        CFG, learner.frozen, jnp.asarray([tokens]), adapters=learner.params,
        adapter_scale=SPEC.scale,
    )  # fmt: skip
    logits = qwen3.logits_from_hidden(CFG, learner.frozen, h[:, -1:])
    tokens.append(int(jnp.argmax(logits[0, 0])))
  return tokens[len(prompt) :]


@pytest.mark.parametrize("decode", ["merged", "unmerged"])
def test_the_samplers_params_draw_the_learners_greedy_tokens(params, decode):
  learner = Learner(CFG, params, _train(), TEMPERATURE, 4, lora=SPEC, seed=1, lora_decode=decode)
  learner.update(_batch(2))
  learner.update(_batch(3))
  decode_params = learner.decode_params()
  if decode == "unmerged":  # the base itself, not a copy, with the adapters beside it
    assert decode_params["layers"]["q"] is learner.frozen["layers"]["q"]
    assert set(decode_params["adapters"]["layers"]) == set(SPEC.targets)
  prompts = [[5, 9, 11, 7], [20, 4, 33], [8, 8, 8, 8, 8, 40]]
  drawn = generate(CFG, decode_params, prompts, max_new_tokens=12, num_slots=2)
  expected = [_greedy_unmerged(learner, p, 12) for p in prompts]
  assert drawn == expected


def test_a_checkpoint_over_another_base_is_refused_naming_it(params):
  learner = _lora_learner(params)
  arrays, host = learner.state()
  assert host["lora"]["rank"] == SPEC.rank and len(host["lora"]["base_fingerprint"]) == 16
  other = jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1.0), params)
  moved = _lora_learner(other)
  with pytest.raises(InputError, match="other base weights"):
    moved.restore(arrays, host)
  with pytest.raises(InputError, match="full fine-tune"):
    moved.restore(arrays, {"attempted": 0})
  same = _lora_learner(params)
  same.restore(arrays, host)  # the same base: restored


def test_the_lora_learner_on_a_mesh_equals_one_device(params):
  mesh = mesh_or_skip((2, 2, 2))
  batch = _batch(4)
  one, sharded = _lora_learner(params), _lora_learner(params, mesh=mesh)
  m1, m2 = one.update(batch), sharded.update(batch)
  assert m1["train/loss"] == pytest.approx(m2["train/loss"], rel=1e-5)
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5),  # Adam: ~0.01 steps
      one.params, sharded.params,
  )  # fmt: skip


def test_a_lora_critic_shares_the_base_and_trains_its_adapters_and_head(params):
  learner = _lora_learner(params)
  train = _train(advantage="gae", critic_lr=1e-2)
  critic = critic_lib.Critic(CFG, learner.frozen, train, 4, lora=SPEC, seed=2)
  # Held once: the critic reads the learner's arrays (all but the output head, unread).
  assert set(critic.frozen) == set(learner.frozen) - {"lm_head"}
  assert all(critic.frozen[k] is learner.frozen[k] for k in critic.frozen)
  batch = _batch(5)
  learner_batches.gae(critic, batch, np.linspace(0.0, 1.0, batch["mask"].shape[0]))
  assert np.abs(critic.values(batch)).max() == 0  # a zero head: values start at 0
  before = jax.tree.map(np.array, learner.frozen)
  metrics = learner_batches.critic_update(critic, batch)
  assert metrics["critic/value_loss"] > 0
  assert np.abs(critic.values(batch)).max() > 0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, learner.frozen), before)


def test_a_run_starts_from_a_peft_adapter_as_saved(params, tmp_path):
  trained = _lora_learner(params)
  trained.update(_batch(7))
  peft_io.save_peft(tmp_path, SPEC, jax.tree.map(np.asarray, trained.params))
  adapters = lora_base.start_adapters(str(tmp_path), SPEC, CFG)
  started = Learner(CFG, params, _train(), TEMPERATURE, 4, lora=SPEC, adapters=adapters)
  batch = _batch(8)
  np.testing.assert_array_equal(
      started.logprobs(started.params, batch), trained.logprobs(trained.params, batch)
  )
  with pytest.raises(InputError, match="train.lora asks for"):
    lora_base.start_adapters(str(tmp_path), lora.LoraSpec(4, 16.0), CFG)
