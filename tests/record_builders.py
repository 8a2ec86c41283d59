"""Builders of the records the sampler and reward tests feed in: random prompts and
SampleRecords for the sampler tests' model, groups of text responses (a token a character)
for the reward runner, and the logprobs a record's response has under a model."""

import jax
import jax.numpy as jnp
import numpy as np

from april_jax import sampler
from april_jax.models import qwen3
from april_jax.rollout.group import Group
from april_jax.sampler import SampleRecord
from conftest import sampler_qwen3

SAMPLER_VOCAB = sampler_qwen3().vocab_size


def random_prompts(seed, lengths, vocab=SAMPLER_VOCAB):
  """One prompt of random int32 tokens per length, drawn in order from one seeded stream."""
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]


def sample_records(prompts, max_new_tokens, temperature=0.8, seed=0, **kw):
  """A fresh SampleRecord per prompt, each with its own key (seed's) and meta {"index": i}."""
  keys = sampler.sample_keys(seed, len(prompts))
  return [
      SampleRecord(
          prompt=p,
          max_new_tokens=max_new_tokens,
          rng=keys[i],
          temperature=temperature,
          index=i,
          **kw,
      )
      for i, p in enumerate(prompts)
  ]


def teacher_forced_logprobs(cfg, params, record, temperature=1.0, padded_len=64):
  """The record's response logprobs under params, from one forward over the whole
  sequence (right-padded to one length, so one compile serves every record: causal
  attention keeps the padding out of the positions that count)."""
  tokens = np.concatenate([record.prompt, record.response])
  padded = np.zeros(padded_len, np.int32)
  padded[: len(tokens) - 1] = tokens[:-1]
  logits = qwen3.forward(cfg, params, jnp.asarray(padded[None]))[0]
  logp = np.asarray(jax.nn.log_softmax(logits / temperature, axis=-1))
  P = len(record.prompt)
  return logp[np.arange(P - 1, len(tokens) - 1), record.response]


def chars(text):
  """Text as tokens, a character each (its code point)."""
  return np.array([ord(c) for c in text], np.int32)


def text_of(ids):
  """The text of chars()' tokens: the reward runner's decode for text_group's groups."""
  return "".join(chr(i) for i in ids)


def text_group(group_id, answer, responses, prompt="q?", prompt_id=None):
  """A group of finished samples with these text responses (8-token budget) to one text
  prompt; its prompt id is the group id unless given."""
  samples = [
      SampleRecord(
          prompt=chars(prompt),
          max_new_tokens=8,
          rng=np.zeros(2, np.uint32),
          response=chars(text),
          logprobs=np.zeros(len(text), np.float32),
          versions=np.zeros(len(text), np.int32),
          finish_reason="stop",
      )
      for text in responses
  ]
  prompt_id = group_id if prompt_id is None else prompt_id
  return Group(group_id, prompt_id, chars(prompt), answer, samples, first_step=0)
