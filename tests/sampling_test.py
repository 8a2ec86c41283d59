"""Next-token sampling: exact greedy, the softmax distribution, top-k / top-p exclusion,
and behavior logprobs of the distribution actually sampled."""

import jax
import jax.numpy as jnp
import numpy as np

from april_jax.sampler import sample_tokens
from april_jax.sampler.sampling import draw_token

V = 8
LOGITS = jnp.asarray([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
QWEN_VOCAB = 151_936


def _draw(n, temperature, top_k=0, top_p=1.0, seed=0):
  keys = jax.random.split(jax.random.key(seed), n)
  fill = lambda v, dtype: jnp.full((n,), v, dtype)
  return sample_tokens(
      jnp.broadcast_to(LOGITS, (n, V)),
      keys,
      fill(temperature, jnp.float32),
      fill(top_k, jnp.int32),
      fill(top_p, jnp.float32),
  )


def _softmax64(logits_V):
  logits_V = np.asarray(logits_V, np.float64)
  p_V = np.exp(logits_V - logits_V.max())
  return p_V / p_V.sum()


def _z(observed, expected_count, p):
  """Binomial z-score of a count with expectation expected_count = n * p."""
  return (observed - expected_count) / np.sqrt(expected_count * (1 - p))


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
  # Untruncated, the distribution sampled is the tempered softmax: its logprob is recorded.
  np.testing.assert_allclose(logprobs, np.log(expected)[np.asarray(tokens)], rtol=1e-5)


def _full_vocab_logits():
  """Logits 4 * N(0, 1) over a Qwen-sized vocabulary and their float64 softmax."""
  logits_V = (4.0 * np.random.default_rng(0).standard_normal(QWEN_VOCAB)).astype(np.float32)
  return logits_V, _softmax64(logits_V)


def _fit_to_softmax(counts_V, p_V):
  """Observed vs expected counts of draws: per probability bin, the rare tokens, and each
  frequent token.

  Tokens are binned by probability, ascending: bins of cumulative mass 1e-4, 1e-3, 1e-2 at
  the bottom, then bins of (at least) equal mass. Rare tokens are also counted by how many
  are drawn more than once: a draw that rounds probabilities to a grid (as a float32
  inverse CDF does, to multiples of 2^-23) draws a few of them too often and the rest
  never, which leaves their total about right but repeats them far more.
  """
  n = counts_V.sum()
  order = np.argsort(p_V)
  edges = [1e-4, 1e-3, 1e-2] + list(np.linspace(0.04, 0.97, 32))
  bins = np.split(order, np.searchsorted(np.cumsum(p_V[order]), edges))
  bins = [b for b in bins if b.size]
  mass_B = np.asarray([p_V[b].sum() for b in bins])
  observed_B = np.asarray([counts_V[b].sum() for b in bins])
  rare = p_V < 3e-8
  frequent = n * p_V >= 100
  # P(drawn twice or more) of each rare token, Poisson: their count's mean and variance.
  lam_R = n * p_V[rare]
  repeat_R = 1 - np.exp(-lam_R) * (1 + lam_R)
  return dict(
      bin_expected=n * mass_B,
      bin_observed=observed_B,
      bin_z=_z(observed_B, n * mass_B, mass_B),
      chi2=np.sum((observed_B - n * mass_B) ** 2 / (n * mass_B)),
      rare_expected=n * p_V[rare].sum(),
      rare_observed=counts_V[rare].sum(),
      rare_z=_z(counts_V[rare].sum(), n * p_V[rare].sum(), p_V[rare].sum()),
      rare_repeated_expected=repeat_R.sum(),
      rare_repeated=np.sum(counts_V[rare] >= 2),
      rare_repeated_z=(
          (np.sum(counts_V[rare] >= 2) - repeat_R.sum())
          / np.sqrt(np.sum(repeat_R * (1 - repeat_R)))
      ),
      frequent_z=_z(counts_V[frequent], n * p_V[frequent], p_V[frequent]),
  )


def test_a_million_draws_over_a_full_vocabulary_match_softmax_down_to_the_tail():
  """Every mass class, the rarest included, is drawn at its softmax rate.

  A float32 inverse CDF fails this: it rounds each token's probability to a multiple of
  2^-23 (~1.2e-7), so of the tokens below that some are drawn several times too often and
  most never, and with a sequential cumulative sum those late in the vocabulary, where the
  sum is near 1, are lost altogether.
  """
  logits_V, p_V = _full_vocab_logits()
  # Vmapped over keys only: the blocks' logsumexps are computed once per chunk.
  chunks, chunk = 10, 100_000
  split = lambda i: jax.random.split(jax.random.fold_in(jax.random.key(0), i), chunk)
  logits_V = jnp.asarray(logits_V)
  # Compiled with XLA's backend optimisations (conftest turns them off): this test runs
  # its program ten times over a million draws, where they pay for themselves.
  draw = (
      jax.jit(jax.vmap(draw_token, in_axes=(None, 0)))
      .lower(logits_V, split(0))
      .compile(compiler_options={"xla_backend_optimization_level": 2})
  )
  counts_V = np.zeros(QWEN_VOCAB, np.int64)
  for i in range(chunks):
    counts_V += np.bincount(np.asarray(draw(logits_V, split(i))), minlength=QWEN_VOCAB)
  assert counts_V.sum() == chunks * chunk
  fit = _fit_to_softmax(counts_V, p_V)
  assert np.all(np.abs(fit["bin_z"]) < 5), fit
  assert fit["chi2"] < 70, fit  # 26 bins: P(chi2 > 70) ~ 5e-6.
  # Probability below 3e-8: ~3/4 of the vocabulary, ~4e-4 of the mass, ~3 repeats.
  assert abs(fit["rare_z"]) < 5, fit
  assert abs(fit["rare_repeated_z"]) < 5, fit
  assert np.all(np.abs(fit["frequent_z"]) < 5), np.abs(fit["frequent_z"]).max()


def _nucleus_case():
  """Logits over the full vocabulary where 20 tokens hold ~98% of the mass; returns them,
  their float64 softmax, a top_p near 0.9 half a token's mass away from either edge of
  its nucleus, and that nucleus."""
  rng = np.random.default_rng(1)
  logits_V = (rng.standard_normal(QWEN_VOCAB) - 4.0).astype(np.float32)
  heads = rng.choice(QWEN_VOCAB, 20, replace=False)
  logits_V[heads] = np.linspace(10.0, 8.0, 20, dtype=np.float32)
  p_V = _softmax64(logits_V)
  order = np.argsort(-p_V)
  mass_before = np.cumsum(p_V[order]) - p_V[order]
  last = np.searchsorted(mass_before, 0.9) - 1  # the token whose mass spans 0.9
  top_p = (mass_before[last] + mass_before[last + 1]) / 2
  return logits_V, p_V, top_p, order[: last + 1]


def _sample_one_row_many_times(logits_V, n, temperature, top_k, top_p):
  """n draws through sample_tokens with one row of logits (vmapped over keys only, so the
  truncation sort and the normaliser run once)."""
  keys = jax.random.split(jax.random.key(3), n)[:, None]
  row = lambda v, dtype: jnp.full((1,), v, dtype)
  draw = jax.jit(jax.vmap(sample_tokens, in_axes=(None, 0, None, None, None)))
  tokens, logprobs = draw(
      jnp.asarray(logits_V)[None],
      keys,
      row(temperature, jnp.float32),
      row(top_k, jnp.int32),
      row(top_p, jnp.float32),
  )
  return np.asarray(tokens[:, 0]), np.asarray(logprobs[:, 0])


def test_top_p_draws_stay_in_the_nucleus_and_log_its_renormalised_probability():
  logits_V, p_V, top_p, nucleus = _nucleus_case()
  assert 10 <= len(nucleus) <= 20 and p_V[nucleus].min() > 0.02
  n = 100_000
  tokens, logprobs = _sample_one_row_many_times(logits_V, n, 1.0, 0, top_p)
  assert set(np.unique(tokens)) == set(nucleus)
  q_V = p_V[nucleus] / p_V[nucleus].sum()
  expected_logprob = dict(zip(nucleus, np.log(q_V)))
  np.testing.assert_allclose(logprobs, [expected_logprob[t] for t in tokens], atol=1e-4)
  logged = {t: lp for t, lp in zip(tokens, logprobs)}
  np.testing.assert_allclose(sum(np.exp(logged[t]) for t in nucleus), 1.0, atol=1e-4)
  counts = np.bincount(tokens, minlength=QWEN_VOCAB)[nucleus]
  np.testing.assert_array_less(np.abs(_z(counts, n * q_V, q_V)), 5)


def test_top_k_logs_the_renormalised_probability_of_the_k_largest():
  logits_V, _, _, _ = _nucleus_case()
  k, temperature = 5, 0.7
  tokens, logprobs = _sample_one_row_many_times(logits_V, 20_000, temperature, k, 1.0)
  top = np.argsort(-logits_V)[:k]
  assert set(np.unique(tokens)) == set(top)
  q_K = _softmax64(logits_V.astype(np.float64)[top] / temperature)
  expected_logprob = dict(zip(top, np.log(q_K)))
  np.testing.assert_allclose(logprobs, [expected_logprob[t] for t in tokens], atol=1e-4)


def test_top_k_never_emits_tokens_outside_the_k_largest():
  tokens, logprobs = _draw(5000, temperature=1.0, top_k=3)
  assert set(np.unique(np.asarray(tokens))) == {0, 1, 2}
  expected = np.log(np.asarray(jax.nn.softmax(LOGITS[:3])))
  np.testing.assert_allclose(logprobs, expected[np.asarray(tokens)], rtol=1e-5)


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
  probs = np.asarray(jax.nn.softmax(LOGITS))
  p = float(probs[:3].sum()) - 1e-3  # tokens 0..2 are needed to reach p; 3 is excluded
  tokens, logprobs = _draw(5000, temperature=1.0, top_p=p)
  assert set(np.unique(np.asarray(tokens))) == {0, 1, 2}
  # Within the nucleus, renormalised probabilities, which are also what is logged.
  freq = np.bincount(np.asarray(tokens), minlength=V)[:3] / 5000
  renormalised = probs[:3] / probs[:3].sum()
  np.testing.assert_allclose(freq, renormalised, atol=0.03)
  np.testing.assert_allclose(logprobs, np.log(renormalised)[np.asarray(tokens)], rtol=1e-5)


def test_rows_mix_greedy_truncated_and_free_sampling():
  n = 3000
  keys = jax.random.split(jax.random.key(1), 3 * n)
  temp = jnp.repeat(jnp.asarray([0.0, 1.0, 1.0]), n)
  top_k = jnp.repeat(jnp.asarray([0, 2, 0], jnp.int32), n)
  top_p = jnp.ones((3 * n,))
  tokens, logprobs = sample_tokens(jnp.broadcast_to(LOGITS, (3 * n, V)), keys, temp, top_k, top_p)
  tokens = np.asarray(tokens).reshape(3, n)
  assert set(tokens[0]) == {0}
  assert set(tokens[1]) == {0, 1}
  assert len(set(tokens[2])) > 4
  logprobs = np.asarray(logprobs).reshape(3, n)
  probs = np.asarray(jax.nn.softmax(LOGITS))
  # Greedy and free rows log the full softmax; the top-2 row its renormalised pair.
  np.testing.assert_allclose(logprobs[0], np.log(probs[0]), rtol=1e-6)
  np.testing.assert_allclose(logprobs[1], np.log(probs[:2] / probs[:2].sum())[tokens[1]], rtol=1e-5)
  np.testing.assert_allclose(logprobs[2], np.log(probs)[tokens[2]], rtol=1e-5)
