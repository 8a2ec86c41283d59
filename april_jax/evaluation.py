"""Evaluation with `sampler.generate`: pass@1 (greedy) and avg@k (k samples per prompt).

A response counts as correct when its reward reaches `correct_at` (1.0 for the math and
copy rewards). eval/pass@1: fraction of prompts whose greedy response is correct.
eval/avg@k: correct responses among k sampled per prompt, averaged (AIME's avg@k).
"""

from __future__ import annotations

import numpy as np

from april_jax import sampler


def evaluate(cfg, params, items, decode, reward_fn, *, k: int, max_new_tokens: int,
             temperature: float, num_slots: int, eos_ids, seed: int, mesh=None,
             correct_at: float = 1.0, max_len: int | None = None) -> dict[str, float]:
  """items: PromptItems (tokens, answer). Returns eval/* metrics."""
  prompts = [item.tokens.tolist() for item in items]

  def score(responses, repeat):
    rewards = [reward_fn(decode(r), items[i // repeat].answer)
               for i, r in enumerate(responses)]
    return np.array(rewards, np.float64)

  common = dict(max_new_tokens=max_new_tokens, num_slots=num_slots, eos_ids=eos_ids,
                mesh=mesh, max_len=max_len)
  greedy = score(sampler.generate(cfg, params, prompts, temperature=0.0, seed=seed,
                                  **common), 1)
  out = {"eval/pass@1": float(np.mean(greedy >= correct_at)),
         "eval/reward_mean": float(np.mean(greedy))}
  if k > 0:
    repeated = [p for p in prompts for _ in range(k)]
    sampled = score(sampler.generate(cfg, params, repeated, temperature=temperature,
                                     seed=seed + 1, **common), k)
    out[f"eval/avg@{k}"] = float(np.mean(sampled >= correct_at))
  return out
