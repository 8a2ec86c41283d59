"""AdamW's moments kept in bfloat16 (train.moments_dtype): Adam's own numbers when kept in
float32, half the state's bytes, and how far the first updates move from float32's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from april_jax.models import qwen3
from april_jax.rl import step as step_lib
from april_jax.rl.update import Learner
from april_jax.settings.train import TrainSettings
from conftest import tiny_qwen3
import learner_batches

CFG = tiny_qwen3()


def test_kept_in_float32_it_is_optax_scale_by_adam():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
  ours = step_lib.scale_by_adam_stored_in("float32", 0.9, 0.98, 1e-8)
  theirs = optax.scale_by_adam(0.9, 0.98, 1e-8)
  s_ours, s_theirs = ours.init(params), theirs.init(params)
  for _ in range(4):
    grads = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
    u_ours, s_ours = ours.update(grads, s_ours)
    u_theirs, s_theirs = theirs.update(grads, s_theirs)
    np.testing.assert_allclose(u_ours["w"], u_theirs["w"], rtol=1e-6)


def _learner(params, moments_dtype):
  train = dataclasses.replace(
      TrainSettings(), lr=1e-3, logprob_chunk=16, moments_dtype=moments_dtype
  )
  return Learner(CFG, jax.tree.map(jnp.copy, params), train, 0.8, total_updates=10)


def test_bfloat16_moments_halve_the_state_and_keep_the_first_updates_within_2_percent():
  params = qwen3.init_params(CFG, jax.random.key(0), std=0.3)
  moved = {}
  for dtype in ("float32", "bfloat16"):
    learner = _learner(params, dtype)
    moments = [x for x in jax.tree.leaves(learner.opt_state) if x.ndim > 0]
    assert {str(x.dtype) for x in moments} == {dtype}
    moved[dtype] = []
    for seed in range(4):
      learner.update(learner_batches.random_batch(seed, CFG.vocab_size))
      delta = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), learner.params, params)
      moved[dtype].append(np.concatenate([d.ravel() for d in jax.tree.leaves(delta)]))
  for step, (exact, rounded) in enumerate(zip(moved["float32"], moved["bfloat16"])):
    relative = np.linalg.norm(rounded - exact) / np.linalg.norm(exact)
    print(f"update {step + 1}: bfloat16 moments move the params {relative:.2%} off float32's")
    assert relative < 0.02, (step, relative)
