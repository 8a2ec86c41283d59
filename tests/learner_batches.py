"""Learner batches built directly from hand-made samples: no sampler, no scheduler.

A sample is what a rollout hands the learner: prompt tokens, response tokens (the last
one the stop token), each response token's sampler logprob and the policy version that
drew it, and a reward. `build` lays samples out as a run does (rl/batch.py's build_batch,
with an advantage estimator over each group's rewards); `random_batch` makes them."""

import numpy as np

from april_jax.rl import advantages
from april_jax.rl import batch as batch_lib
from april_jax.rollout.group import Group
from april_jax.sampler import SampleRecord

STOP = 3  # the token that ends every response


def sample(prompt, response, logprobs, versions) -> SampleRecord:
  """A finished sample: its response drawn with these logprobs at these versions."""
  return SampleRecord(
      prompt=prompt,
      max_new_tokens=len(response),
      rng=np.zeros(2, np.uint32),
      response=response,
      logprobs=logprobs,
      versions=versions,
      finish_reason="stop",
  )


def build(groups: list[list[SampleRecord]], rewards_GxN, version: int, **kw) -> dict:
  """The learner's batch of these groups of samples and their rewards, trained at policy
  `version` (tokens drawn before it are stale): rl/batch.py's arrays, advantages by
  `estimator` (default GRPO), rows padded as build_batch pads them (max_len: 48)."""
  estimator, max_len = kw.pop("estimator", "grpo"), kw.pop("max_len", 48)
  assert not kw, kw
  rewards_GxN = np.asarray(rewards_GxN, np.float32)
  made = [
      Group(g, g, samples[0].prompt, "", samples, first_step=0, rewards=list(rewards_GxN[g]))
      for g, samples in enumerate(groups)
  ]
  adv = np.asarray(advantages.get_advantage(estimator)(rewards_GxN))
  return batch_lib.build_batch(made, adv, version, max_len=max_len)


def random_batch(
    seed: int, vocab: int, groups: int = 2, n: int = 4, max_response: int = 24, stale: bool = False
) -> dict:
  """groups x n samples: a prompt of 3 to 6 tokens per group, responses of 2 to
  max_response tokens ending in STOP, sampler logprobs about -3.5 (a tiny model's over
  its vocabulary), a sample's length as its reward. Trained at version 1; with `stale`,
  the first half of every other sample's response was drawn at version 0 (a partial
  sample resumed across an update)."""
  rng = np.random.default_rng(seed)
  out, rewards = [], []
  for _ in range(groups):
    prompt = rng.integers(STOP + 1, vocab, rng.integers(3, 7)).astype(np.int32)
    samples = []
    for i in range(n):
      R = int(rng.integers(2, max_response + 1))
      response = np.append(rng.integers(STOP + 1, vocab, R - 1), STOP).astype(np.int32)
      logprobs = np.minimum(rng.normal(-3.5, 0.7, R), -0.01).astype(np.float32)
      versions = np.ones(R, np.int32)
      if stale and i % 2 == 0:
        versions[: R // 2 + 1] = 0
      samples.append(sample(prompt, response, logprobs, versions))
    out.append(samples)
    rewards.append([float(len(s.response)) for s in samples])
  return build(out, rewards, version=1)
