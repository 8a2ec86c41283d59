"""Evaluation on the run's engine: pass@1 (greedy) and avg@k (k samples per prompt).

A response counts as correct when its reward reaches `correct_at` (1.0 for the math and
copy rewards). eval/pass@1: fraction of prompts whose greedy response is correct.
eval/avg@k: correct responses among k sampled per prompt, averaged (AIME's avg@k).

Responses are scored as training scores them, by the run's RewardRunner: the reward's
own form (a pair, a whole sample, or a group: a prompt's k samples), its worker
processes, time limit and fallback, and the environment's failures. A reward that raises
or runs past its limit scores the fallback and is counted (eval/reward_errors,
eval/reward_timeouts); it never ends the run.
"""

from __future__ import annotations

import numpy as np

from april_jax import sampler
from april_jax.rollout.group import Group


def _score(items, records, repeat: int, rewards, counts: dict) -> np.ndarray:
  """The rewards of `records` (`repeat` per item, in the items' order), scored by
  `rewards` as groups of their own; adds the groups' reward errors and timeouts to
  `counts`."""
  groups = [  # negative ids: never a training group's
      Group(
          group_id=-1 - i,
          prompt_id=item.prompt_id,
          prompt=item.tokens,
          answer=item.answer,
          samples=records[i * repeat : (i + 1) * repeat],
          first_step=-1,
          row=item.row or {},
      )
      for i, item in enumerate(items)
  ]
  for group in groups:
    rewards.submit(group)
  rewards.wait_for(groups)
  for key in counts:
    counts[key] += sum(group.reward_info[key] for group in groups)
  return np.array([r for group in groups for r in group.rewards], np.float64)


def evaluate(
    engine,
    items,
    rewards,
    *,
    k: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    top_p: float = 1.0,
    correct_at: float = 1.0,
    episodes=None,
) -> dict[str, float]:
  """items: PromptItems (tokens, answer). Generates with `engine` (empty; its current
  params and stop tokens; with `episodes`, each prompt an episode of the run's
  environment), scores with `rewards` (a RewardRunner) and returns eval/* metrics."""
  prompts = [item.tokens.tolist() for item in items]
  rows = [{**(item.row or {}), "answer": item.answer} for item in items]
  counts = {"errors": 0, "timeouts": 0}
  records = sampler.generate_on(
      engine,
      prompts,
      max_new_tokens=max_new_tokens,
      temperature=0.0,
      seed=seed,
      episodes=episodes,
      rows=rows,
      return_records=True,
  )
  greedy = _score(items, records, 1, rewards, counts)
  out = {
      "eval/pass@1": float(np.mean(greedy >= correct_at)),
      "eval/reward_mean": float(np.mean(greedy)),
  }
  if k > 0:
    repeated = [p for p in prompts for _ in range(k)]
    records = sampler.generate_on(
        engine,
        repeated,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed + 1,
        episodes=episodes,
        rows=[row for row in rows for _ in range(k)],
        return_records=True,
    )
    sampled = _score(items, records, k, rewards, counts)
    out[f"eval/avg@{k}"] = float(np.mean(sampled >= correct_at))
  out["eval/reward_errors"] = float(counts["errors"])
  out["eval/reward_timeouts"] = float(counts["timeouts"])
  return out
