"""Evaluation: pass@1 from greedy responses, avg@k from k samples per prompt, scored as
training scores (the reward's form, its fallback, counted errors and time-outs)."""

import time

import jax
import numpy as np

from april_jax.rollout.evaluation import evaluate
from april_jax.models import qwen3
from april_jax.data import PromptItem
from april_jax.rewards import loading
from april_jax.rollout import RewardRunner
from april_jax.sampler import EngineConfig, SlotEngine
from conftest import tiny_qwen3

CFG = tiny_qwen3(vocab_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)


def _run(reward_fn, k=3, top_p=1.0, timeout_s=30.0):
  params = qwen3.init_params(CFG, jax.random.key(0), std=0.3)
  items = [
      PromptItem(
          prompt_id=i, tokens=np.array([1 + i, 2 + i], np.int32), answer=str(i), row={"i": i}
      )
      for i in range(5)
  ]
  engine = SlotEngine(CFG, params, EngineConfig(num_slots=4, max_len=16))
  rewards = RewardRunner(
      reward_fn,
      lambda ids: " ".join(map(str, ids)),
      num_workers=2,
      timeout_s=timeout_s,
      fallback=-1.0,
      processes=False,
  )
  try:
    out = evaluate(
        engine, items, rewards, k=k, max_new_tokens=6, temperature=1.0, seed=0, top_p=top_p
    )
  finally:
    rewards.close()
  assert engine.num_live == 0  # the engine is left empty for the next rollout
  return out


def test_pass_at_1_and_avg_at_k_count_correct_responses():
  assert _run(lambda text, answer: 1.0) == {
      "eval/pass@1": 1.0,
      "eval/reward_mean": 1.0,
      "eval/avg@3": 1.0,
      "eval/reward_errors": 0.0,
      "eval/reward_timeouts": 0.0,
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


def test_a_reward_in_each_documented_form_scores_and_one_that_fails_is_counted(tmp_path):
  """Evaluation called the reward as (text, answer) itself: a dict reward, a whole-sample
  or group reward ended the run with a traceback, as did one that raised."""
  path = tmp_path / "my_reward.py"
  path.write_text(
      "def as_dict(response, answer):\n"
      "  return {'score': float(answer == '0'), 'length': len(response)}\n"
      "def whole(sample):\n"
      "  return float(sample['row']['i'] < 2 and sample['answer'] == str(sample['row']['i']))\n"
      "def group(samples):\n"
      "  return [float(s['prompt_id'] == 4) for s in samples]\n"
      "def broken(response, answer):\n"
      "  if answer == '3':\n"
      "    raise ZeroDivisionError('the user reward fails')\n"
      "  return 1.0\n"
  )
  as_dict = _run(loading.resolve(f"{path}:as_dict"))
  assert as_dict["eval/pass@1"] == 0.2 and as_dict["eval/avg@3"] == 0.2
  whole = _run(loading.resolve(f"{path}:whole"))
  assert whole["eval/pass@1"] == 0.4 and whole["eval/avg@3"] == 0.4
  group = _run(loading.resolve(f"{path}:group"))
  assert group["eval/pass@1"] == 0.2 and group["eval/avg@3"] == 0.2
  broken = _run(loading.resolve(f"{path}:broken"))  # prompt 3 scores the fallback, -1
  assert broken["eval/pass@1"] == 0.8 and broken["eval/avg@3"] == 0.8
  assert broken["eval/reward_mean"] == (4 * 1.0 - 1.0) / 5
  assert broken["eval/reward_errors"] == 1 + 3 and broken["eval/reward_timeouts"] == 0


def test_a_reward_past_its_time_limit_scores_the_fallback_and_is_counted():
  def slow_for_prompt_2(text, answer):
    if answer == "2":
      time.sleep(3.0)
    return 1.0

  out = _run(slow_for_prompt_2, k=0, timeout_s=0.5)
  assert out["eval/pass@1"] == 0.8 and out["eval/reward_timeouts"] == 1
