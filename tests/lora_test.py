"""LoRA adapters (models/lora.py): B = 0 is the base model exactly, the merge is the
low-rank update of each projection's linear map, gradients reach the adapters and train
them, and a bad spec is named in one line."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from april_jax.models import lora, qwen3
from conftest import sampler_qwen3

CFG = sampler_qwen3()
SPEC = lora.LoraSpec(rank=4, alpha=8.0)


def _tokens(seed=0, B=2, T=12):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, CFG.vocab_size)


def _logprobs(params, tokens):
  return qwen3.token_logprobs(CFG, params, tokens[:, :-1], tokens[:, 1:])[0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_with_b_zero_the_adapted_model_is_the_base_bit_for_bit(sampler_params, dtype):
  base = jax.tree.map(lambda x: x.astype(dtype), sampler_params)
  adapters = lora.init(CFG, SPEC, jax.random.key(1))
  merged = lora.merge(base, adapters, SPEC)
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(merged)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  tokens = _tokens()
  np.testing.assert_array_equal(_logprobs(base, tokens), _logprobs(merged, tokens))


def test_the_merge_is_each_projections_low_rank_update(sampler_params):
  """x @ W' = x @ W + (alpha / rank) * (x @ A) @ B for every target, over its flattened
  input and output dims, with random nonzero A and B."""
  adapters = lora.init(CFG, SPEC, jax.random.key(2))
  keys = iter(jax.random.split(jax.random.key(3), 16))
  for ad in adapters["layers"].values():
    ad["b"] = 0.1 * jax.random.normal(next(keys), ad["b"].shape)
  merged = lora.merge(sampler_params, adapters, SPEC)
  for target, ad in adapters["layers"].items():
    n = lora.INPUT_DIMS[target]
    w = np.asarray(sampler_params["layers"][target][1], np.float64)
    ins = int(np.prod(w.shape[:n]))
    a = np.asarray(ad["a"][1], np.float64).reshape(ins, SPEC.rank)
    b = np.asarray(ad["b"][1], np.float64).reshape(SPEC.rank, -1)
    x = np.random.default_rng(0).normal(size=(5, ins))
    want = x @ w.reshape(ins, -1) + SPEC.scale * (x @ a) @ b
    got = x @ np.asarray(merged["layers"][target][1], np.float64).reshape(ins, -1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got - x @ w.reshape(ins, -1)).max() > 1e-3  # the update is there


def test_gradients_reach_the_adapters_and_train_them_while_the_base_stays(sampler_params):
  base = sampler_params
  before = jax.tree.map(np.asarray, base)
  adapters = lora.init(CFG, SPEC, jax.random.key(4))
  tokens = _tokens(5)
  loss = lambda ad: -jnp.mean(_logprobs(lora.merge(base, ad, SPEC), tokens))
  grads = jax.grad(loss)(adapters)
  for target, g in grads["layers"].items():
    assert np.abs(np.asarray(g["b"])).max() > 0, target  # B learns first
    np.testing.assert_array_equal(g["a"], 0.0)  # dL/dA = dL/dW' B^T = 0 while B = 0
  opt = optax.adam(1e-2)
  state = opt.init(adapters)
  start = float(loss(adapters))
  for _ in range(5):
    updates, state = opt.update(jax.grad(loss)(adapters), state)
    adapters = optax.apply_updates(adapters, updates)
  assert float(loss(adapters)) < start - 1e-3
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(base)):
    np.testing.assert_array_equal(a, b)


def test_adapters_shard_like_the_sides_of_the_weights_they_touch():
  axes = lora.logical_axes(CFG, SPEC)["layers"]
  shapes = lora.init(CFG, SPEC, jax.random.key(0))["layers"]
  for target in lora.TARGETS:
    assert len(axes[target]["a"]) == shapes[target]["a"].ndim
    assert len(axes[target]["b"]) == shapes[target]["b"].ndim
  assert axes["q"] == {"a": ("layers", "embed", None), "b": ("layers", None, "heads", "head_dim")}
  assert axes["o"] == {"a": ("layers", "heads", "head_dim", None), "b": ("layers", None, "embed")}
  per_layer = 4 * (32 + 64) + 2 * 4 * (32 + 32) + 4 * (64 + 32) + 2 * 4 * (32 + 64) + 4 * (64 + 32)
  assert lora.num_params(CFG, SPEC) == CFG.num_layers * per_layer


@pytest.mark.parametrize(
    "spec, message",
    [
        (lora.LoraSpec(rank=0, alpha=8.0), r"train.lora.rank must be in \[1, 32\].*got 0"),
        (lora.LoraSpec(rank=33, alpha=8.0), r"train.lora.rank must be in \[1, 32\].*got 33"),
        (lora.LoraSpec(rank=4, alpha=8.0, targets=("qkv",)), r"unknown modules \['qkv'\]"),
        (lora.LoraSpec(rank=4, alpha=0.0), "train.lora.alpha must be > 0"),
    ],
)
def test_a_bad_spec_is_named_in_one_line(spec, message):
  [problem] = lora.problems(CFG, spec, "train.lora.")
  assert re.search(message, problem), problem
  with pytest.raises(ValueError, match=message.replace("train.lora.", "")):
    lora.init(CFG, spec, jax.random.key(0))
