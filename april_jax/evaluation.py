"""Evaluation on the run's engine: pass@1 (greedy) and avg@k (k samples per prompt).

A response counts as correct when its reward reaches `correct_at` (1.0 for the math and
copy rewards). eval/pass@1: fraction of prompts whose greedy response is correct.
eval/avg@k: correct responses among k sampled per prompt, averaged (AIME's avg@k).
"""

from __future__ import annotations

import numpy as np

from april_jax import sampler


def evaluate(
    engine,
    items,
    decode,
    reward_fn,
    *,
    k: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    top_p: float = 1.0,
    correct_at: float = 1.0,
    episodes=None,
    fallback: float = 0.0,
) -> dict[str, float]:
  """items: PromptItems (tokens, answer). Generates with `engine` (empty; its current
  params and stop tokens; with `episodes`, each prompt an episode of the run's
  environment, scored `fallback` where the environment failed, as in training) and
  returns eval/* metrics."""
  prompts = [item.tokens.tolist() for item in items]
  rows = [{**(item.row or {}), "answer": item.answer} for item in items]

  def score(records, repeat):
    rewards = [
        fallback
        if "env_error" in r.meta
        else reward_fn(decode(r.response.tolist()), items[i // repeat].answer)
        for i, r in enumerate(records)
    ]
    return np.array(rewards, np.float64)

  greedy = score(
      sampler.generate_on(
          engine,
          prompts,
          max_new_tokens=max_new_tokens,
          temperature=0.0,
          seed=seed,
          episodes=episodes,
          rows=rows,
          return_records=True,
      ),
      1,
  )
  out = {
      "eval/pass@1": float(np.mean(greedy >= correct_at)),
      "eval/reward_mean": float(np.mean(greedy)),
  }
  if k > 0:
    repeated = [p for p in prompts for _ in range(k)]
    sampled = score(
        sampler.generate_on(
            engine,
            repeated,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed + 1,
            episodes=episodes,
            rows=[row for row in rows for _ in range(k)],
            return_records=True,
        ),
        k,
    )
    out[f"eval/avg@{k}"] = float(np.mean(sampled >= correct_at))
  return out
