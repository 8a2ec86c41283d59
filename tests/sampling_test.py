"""Next-token sampling: exact greedy, the softmax distribution, top-k / top-p exclusion."""

import jax
import jax.numpy as jnp
import numpy as np

from april_jax.sampler import sample_tokens

V = 8
LOGITS = jnp.asarray([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def _draw(n, temperature, top_k=0, top_p=1.0, seed=0):
  keys = jax.random.split(jax.random.key(seed), n)
  fill = lambda v, dtype: jnp.full((n,), v, dtype)
  return sample_tokens(jnp.broadcast_to(LOGITS, (n, V)), keys, fill(temperature, jnp.float32),
                       fill(top_k, jnp.int32), fill(top_p, jnp.float32))


def test_greedy_rows_take_argmax_with_untempered_logprob():
  tokens, logprobs = _draw(4, temperature=0.0)
  assert np.all(np.asarray(tokens) == 0)
  np.testing.assert_allclose(logprobs, jax.nn.log_softmax(LOGITS)[0], rtol=1e-6)


def test_temperature_sampling_matches_softmax_distribution():
  n, temperature = 40_000, 0.8
  tokens, logprobs = _draw(n, temperature)
  expected = np.asarray(jax.nn.softmax(LOGITS / temperature))
  freq = np.bincount(np.asarray(tokens), minlength=V) / n
  sigma = np.sqrt(expected * (1 - expected) / n)
  np.testing.assert_array_less(np.abs(freq - expected), 5 * sigma + 1e-9)
  # Each recorded logprob is that of the tempered (untruncated) distribution.
  np.testing.assert_allclose(logprobs, np.log(expected)[np.asarray(tokens)], rtol=1e-5)


def test_top_k_never_emits_tokens_outside_the_k_largest():
  tokens, _ = _draw(5000, temperature=1.0, top_k=3)
  assert set(np.unique(np.asarray(tokens))) == {0, 1, 2}


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
  probs = np.asarray(jax.nn.softmax(LOGITS))
  p = float(probs[:3].sum()) - 1e-3  # tokens 0..2 are needed to reach p; 3 is excluded
  tokens, _ = _draw(5000, temperature=1.0, top_p=p)
  assert set(np.unique(np.asarray(tokens))) == {0, 1, 2}
  # Within the nucleus, renormalised probabilities.
  freq = np.bincount(np.asarray(tokens), minlength=V)[:3] / 5000
  np.testing.assert_allclose(freq, probs[:3] / probs[:3].sum(), atol=0.03)


def test_rows_mix_greedy_truncated_and_free_sampling():
  n = 3000
  keys = jax.random.split(jax.random.key(1), 3 * n)
  temp = jnp.repeat(jnp.asarray([0.0, 1.0, 1.0]), n)
  top_k = jnp.repeat(jnp.asarray([0, 2, 0], jnp.int32), n)
  top_p = jnp.ones((3 * n,))
  tokens, _ = sample_tokens(jnp.broadcast_to(LOGITS, (3 * n, V)), keys, temp, top_k, top_p)
  tokens = np.asarray(tokens).reshape(3, n)
  assert set(tokens[0]) == {0}
  assert set(tokens[1]) == {0, 1}
  assert len(set(tokens[2])) > 4
