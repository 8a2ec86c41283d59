"""Qwen3 in JAX against transformers' Qwen3ForCausalLM, and the model's four uses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.models import hf_io, qwen3
from conftest import tiny_qwen3
import hf_oracle


def _hf_logits(model_dir, tokens):
  hf_oracle.require("torch", "transformers")
  return hf_oracle.logits(model_dir, tokens)


def _random_tokens(seed, shape, vocab):
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def test_forward_matches_transformers_within_1e4(hf_model_dir):
  cfg, params = hf_io.load_pretrained(hf_model_dir)
  tokens = _random_tokens(0, (3, 40), cfg.vocab_size)
  ours = np.asarray(qwen3.forward_jit(cfg, params, jnp.asarray(tokens)))
  theirs = _hf_logits(hf_model_dir, tokens)
  assert ours.dtype == np.float32 and ours.shape == theirs.shape
  assert np.abs(theirs).max() > 1.0  # real magnitudes, not a near-zero model
  np.testing.assert_array_less(np.abs(ours - theirs).max(), 1e-4)


# block 24 does not divide the 64-entry cache: the last block starts early and masks.
@pytest.mark.parametrize("block", [24, 1024])
def test_prefill_then_16_decode_steps_match_full_forward(hf_model_dir, block):
  cfg, params = hf_io.load_pretrained(hf_model_dir)
  steps, cache_len = 16, 64
  lengths = np.array([5, 11, 8], np.int32)
  full = _random_tokens(1, (3, int(lengths.max()) + steps), cfg.vocab_size)
  reference = _hf_logits(hf_model_dir, full)  # [B, T, V]

  prompt = np.where(
      np.arange(lengths.max())[None] < lengths[:, None], full[:, : lengths.max()], 0
  )  # right padded with garbage zeros
  logits, kv = jax.jit(qwen3.prefill, static_argnums=0)(
      cfg, params, jnp.asarray(prompt), jnp.asarray(lengths)
  )
  rows = np.arange(3)
  np.testing.assert_array_less(
      np.abs(np.asarray(logits) - reference[rows, lengths - 1]).max(), 1e-4
  )

  pad = cache_len - kv.k.shape[2]
  cache = qwen3.KVCache(
      *(
          jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 1, 3, 2, 4)
          for a in (kv.k, kv.v)
      )
  )  # slot layout [L,B,K,S,H]
  step = jax.jit(qwen3.decode_step, static_argnums=(0, 6))
  positions = lengths.copy()
  for _ in range(steps):
    tokens = full[rows, positions]
    logits, cache = step(
        cfg, params, jnp.asarray(tokens), jnp.asarray(positions), cache, None, block
    )
    np.testing.assert_array_less(
        np.abs(np.asarray(logits) - reference[rows, positions]).max(), 1e-4
    )
    positions = positions + 1


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
def test_chunked_logprobs_equal_log_softmax_of_full_logits(chunk_size):
  cfg = tiny_qwen3(vocab_size=97, head_dim=16)
  params = qwen3.init_params(cfg, jax.random.key(0), std=0.3)
  tokens = jnp.asarray(_random_tokens(2, (2, 23), cfg.vocab_size))
  targets = jnp.roll(tokens, -1, axis=1)
  temperature = 0.7
  logp, entropy = qwen3.token_logprobs(
      cfg, params, tokens, targets, chunk_size=chunk_size, temperature=temperature
  )
  full = jax.nn.log_softmax(qwen3.forward(cfg, params, tokens) / temperature, axis=-1)
  expected = jnp.take_along_axis(full, targets[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(logp, expected, atol=1e-5)
  np.testing.assert_allclose(entropy, -(jnp.exp(full) * full).sum(-1), atol=1e-5)


def test_chunked_logprob_gradients_match_full_and_remat_changes_nothing():
  cfg = tiny_qwen3(
      vocab_size=61,
      intermediate_size=48,
      num_heads=2,
      num_kv_heads=1,
      head_dim=16,
      tie_word_embeddings=True,
  )
  params = qwen3.init_params(cfg, jax.random.key(1), std=0.3)
  tokens = jnp.asarray(_random_tokens(3, (2, 12), cfg.vocab_size))
  targets = jnp.roll(tokens, -1, axis=1)

  def chunked(p, remat):
    return qwen3.token_logprobs(cfg, p, tokens, targets, chunk_size=5, remat=remat)[0].sum()

  def full(p):
    logp = jax.nn.log_softmax(qwen3.forward(cfg, p, tokens), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1).sum()

  g_full = jax.grad(full)(params)
  for remat in (False, True):
    g = jax.grad(chunked)(params, remat)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4), g, g_full)


def test_bfloat16_params_give_float32_logits_close_to_float32(hf_model_dir):
  cfg, params32 = hf_io.load_pretrained(hf_model_dir, dtype="float32")
  _, params16 = hf_io.load_pretrained(hf_model_dir, dtype="bfloat16")
  assert params16["layers"]["q"].dtype == jnp.bfloat16
  tokens = jnp.asarray(_random_tokens(4, (2, 16), cfg.vocab_size))
  l32 = qwen3.forward_jit(cfg, params32, tokens)
  l16 = qwen3.forward_jit(cfg, params16, tokens)
  assert l16.dtype == jnp.float32
  # bf16 keeps ~3 significant digits; the argmax agrees almost everywhere.
  agree = np.mean(np.asarray(l32.argmax(-1) == l16.argmax(-1)))
  assert agree > 0.9, agree


def test_config_rejects_heads_not_divisible_by_kv_heads():
  with pytest.raises(ValueError, match="num_kv_heads"):
    qwen3.Qwen3Config(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=3,
        num_kv_heads=2,
        head_dim=4,
    )
