"""Evaluation: pass@1 from greedy responses, avg@k from k samples per prompt."""

import jax
import numpy as np

from april_jax.evaluation import evaluate
from april_jax.models import qwen3
from april_jax.data import PromptItem
from april_jax.sampler import EngineConfig, SlotEngine

CFG = qwen3.Qwen3Config(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
)


def _run(reward_fn, k=3, top_p=1.0):
  params = qwen3.init_params(CFG, jax.random.key(0), std=0.3)
  items = [
      PromptItem(prompt_id=i, tokens=np.array([1 + i, 2 + i], np.int32), answer=str(i))
      for i in range(5)
  ]
  engine = SlotEngine(CFG, params, EngineConfig(num_slots=4, max_len=16))
  out = evaluate(
      engine,
      items,
      decode=lambda ids: " ".join(map(str, ids)),
      reward_fn=reward_fn,
      k=k,
      max_new_tokens=6,
      temperature=1.0,
      seed=0,
      top_p=top_p,
  )
  assert engine.num_live == 0  # the engine is left empty for the next rollout
  return out


def test_pass_at_1_and_avg_at_k_count_correct_responses():
  assert _run(lambda text, answer: 1.0) == {
      "eval/pass@1": 1.0,
      "eval/reward_mean": 1.0,
      "eval/avg@3": 1.0,
  }
  assert _run(lambda text, answer: 0.0)["eval/avg@3"] == 0.0
  # Correct for prompts 0 and 1 only: 2 of 5 greedy responses, 6 of 15 samples.
  out = _run(lambda text, answer: float(int(answer) < 2))
  assert out["eval/pass@1"] == 0.4 and out["eval/avg@3"] == 0.4


def test_avg_at_k_samples_within_eval_top_p():
  # Reward 1 only for the greedy response: a nucleus of one token samples exactly it.
  greedy = {}

  def first_seen_is_correct(text, answer):
    return float(greedy.setdefault(answer, text) == text)

  assert _run(first_seen_is_correct, top_p=1e-6)["eval/avg@3"] == 1.0
  greedy.clear()
  assert _run(first_seen_is_correct, top_p=1.0)["eval/avg@3"] < 1.0
