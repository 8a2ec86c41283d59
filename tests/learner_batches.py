"""Learner batches built directly from hand-made samples: no sampler, no scheduler.

A sample is what a rollout hands the learner: prompt tokens, response tokens (the last
one the stop token), each response token's sampler logprob and the policy version that
drew it, and a reward. `build` lays samples out as a run does (rl/batch.py's TrainBatch,
with an advantage estimator over each group's rewards); `random_batch` makes them.
`train_batch` makes a TrainBatch of a test's own rows, `learn_once` runs rl/learn.py's
step on it, and `gae` gives a critic's advantages as that step does."""

import numpy as np

from april_jax.rl import advantages
from april_jax.rl import learn
from april_jax.rl.batch import ROW_KEYS, TrainBatch
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
  `version` (tokens drawn before it are stale): rl/batch.py's rows, advantages by
  `estimator` (default GRPO), rows padded as a run pads them (max_len: 48), and the
  rewards [B]."""
  estimator, max_len = kw.pop("estimator", "grpo"), kw.pop("max_len", 48)
  assert not kw, kw
  rewards_GxN = np.asarray(rewards_GxN, np.float32)
  made = [
      Group(g, g, samples[0].prompt, "", samples, first_step=0, rewards=list(rewards_GxN[g]))
      for g, samples in enumerate(groups)
  ]
  adv = np.asarray(advantages.get_advantage(estimator)(rewards_GxN))
  batch = TrainBatch.from_groups(made, version, max_len=max_len)
  return dict(batch.with_advantages(adv), rewards=rewards_GxN.reshape(-1))


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


def train_batch(batch: dict, n: int, version: int = 1) -> TrainBatch:
  """A test's rows (a dict of [B, T] arrays with rewards [B]) as the TrainBatch of groups
  of n samples; a sample's length: its row's drawn tokens."""
  rewards = np.asarray(batch["rewards"], np.float32).reshape(-1, n)
  lengths = (np.asarray(batch["mask"]) > 0).sum(-1).astype(np.float32).reshape(-1, n)
  rows = {k: batch[k] for k in ROW_KEYS}
  return TrainBatch(**rows, rewards=rewards, lengths=lengths, version=version)


def learn_once(batch: TrainBatch, learner, critic=None) -> dict[str, float]:
  """rl/learn.py's step on the learner's (and critic's) held state, which it replaces;
  its metrics."""
  learners = learn.Learners(learner, critic)
  state, metrics = learn.learn(learners.state(), batch, learners)
  learners.put(state)
  return metrics


def gae(critic, batch: dict, rewards_B) -> dict[str, float]:
  """The critic's values of batch's tokens and GAE's advantages and returns over them, as
  rl/learn.py derives them, set into batch ("old_values", "advantages", "returns"); the
  critic/* metrics."""
  values = critic.values(batch)
  adv = learn.critic_advantages(critic.train, rewards_B, batch["mask"], values, batch.get("stale"))
  batch.update(old_values=values, advantages=adv.values, returns=adv.returns)
  return adv.metrics


def critic_update(critic, batch: dict) -> dict[str, float]:
  """The critic's updates on the returns `gae` set; critic/* metrics."""
  return critic.update(batch, batch["old_values"], batch["returns"])
