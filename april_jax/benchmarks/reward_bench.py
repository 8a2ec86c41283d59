"""Reward calls per second: the math rewards over a corpus of (response, gold) pairs.

  python -m april_jax.bench --mode=rewards [--corpus=typical|PATH --repeats=3]

The corpus: "typical" (the default) is what a math run scores, built from the eval sets'
golds (AIME-2024, AMC-23, MATH-500, the first 300 of GSM8K test): per gold, the right
answer on an `Answer:` line after some reasoning, the right answer boxed, and a wrong
answer: for an integer gold a near miss (gold + 1), for another the gold before it in
the list (a wrong answer of a real shape, which math-verify judges); or PATH, JSON lines of {"response", "gold"}
(tests/data/dapo_corpus.jsonl holds the edge cases of the DAPO scorer's test).
Each registered math reward (`math`, `math_dapo`, `dapo_strict`) scores every pair in
this process, once to warm up (math-verify's child starts), then `repeats` times, timed. Beside calls per second it
prints how many calls reached math-verify, the slow path that plain numbers skip, and
the slowest single call (the bound holds for it too).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from april_jax import rewards
from april_jax.benchmarks import common
from april_jax.rewards import math as math_reward

REWARDS = ("math", "math_dapo", "dapo_strict")
MATH_DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "math"
_REASONING = "Let me work through it step by step. First, set up the equation; then solve.\n"


def typical_corpus(math_data: Path = MATH_DATA) -> list[tuple[str, str]]:
  """(response, gold) pairs as a math run scores them (module docstring)."""
  golds = []
  for name in ("aime24.jsonl", "amc23.jsonl"):
    with open(math_data / name, encoding="utf-8") as f:
      golds += [str(json.loads(line)["answer"]) for line in f if line.strip()]
  with open(math_data / "math500.json", encoding="utf-8") as f:
    golds += [str(row["answer"]) for row in json.load(f)]
  with open(math_data / "gsm8k_test.jsonl", encoding="utf-8") as f:
    golds += [json.loads(line)["answer"] for line in f.readlines()[:300]]
  pairs, before = [], "0"
  for raw in golds:
    gold = math_reward.gold_answer(raw)
    pairs += [(f"{_REASONING}Answer: {gold}", raw), (f"{_REASONING}So \\boxed{{{gold}}}.", raw)]
    number = math_reward.as_rational(gold)
    wrong = number + 1 if number is not None and number.denominator == 1 else before
    pairs.append((f"{_REASONING}So \\boxed{{{wrong}}}.", raw))
    before = gold
  return pairs


def load_corpus(path: str | Path) -> list[tuple[str, str]]:
  """(response, gold) pairs from a JSON-lines file."""
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [(str(r["response"]), str(r["gold"])) for r in rows]


def _time(fn, pairs, repeats: int) -> tuple[float, float]:
  """(seconds per pass over `pairs`, best of `repeats`; the slowest single call)."""
  best, slowest = float("inf"), 0.0
  for _ in range(repeats):
    math_reward.clear_verdict_cache()  # every pass scores cold
    began = time.perf_counter()
    for response, gold in pairs:
      call_began = time.perf_counter()
      fn(response, gold)
      slowest = max(slowest, time.perf_counter() - call_began)
    best = min(best, time.perf_counter() - began)
  return best, slowest


def run(corpus: str | Path | None = None, repeats: int = 3) -> dict:
  pairs = typical_corpus() if corpus in (None, "typical") else load_corpus(corpus)
  calls = {"n": 0}
  verdict = math_reward.math_verify_child.verdict

  def counted(*args):
    calls["n"] += 1
    return verdict(*args)

  result = {
      "mode": "rewards",
      "corpus": str(corpus or "typical"),
      "pairs": len(pairs),
      "repeats": repeats,
      "machine": common.machine(),
  }
  print(f"{len(pairs)} (response, gold) pairs, best of {repeats} passes")
  print(
      f"{'reward':<12} {'calls/s':>10} {'ms/1000':>10} {'math-verify calls':>18} {'slowest (s)':>12}"
  )
  math_reward.math_verify_child.verdict = counted
  try:
    for name in REWARDS:
      fn = rewards.get_reward(name)
      _time(fn, pairs, 1)  # warm-up: math-verify's child starts
      calls["n"] = 0
      seconds, slowest = _time(fn, pairs, repeats)
      slow_path = calls["n"] // repeats
      per_s = len(pairs) / seconds
      print(f"{name:<12} {per_s:>10.0f} {1e6 / per_s:>10.1f} {slow_path:>18} {slowest:>12.3f}")
      result[name] = {"calls_per_s": per_s, "math_verify_calls": slow_path, "slowest_s": slowest}
  finally:
    math_reward.math_verify_child.verdict = verdict
  return result
