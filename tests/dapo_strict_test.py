"""The dapo_strict reward gives the DAPO reference scorer's verdicts: on every row of a
corpus of responses and golds (tests/data/dapo_corpus.jsonl) its score and parsed answer
equal the reference's, recorded in tests/data/dapo_strict_verdicts.json
(tests/data/README.md says how they were made)."""

import json
import time

import pytest

from april_jax import rewards
from april_jax.rewards.dapo_strict import dapo_strict_reward, dapo_strict_verdict
from april_jax.rewards.dapo_strict import normalize_final_answer
from conftest import TEST_DATA


def _corpus():
  with open(TEST_DATA / "dapo_corpus.jsonl", encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _verdicts():
  with open(TEST_DATA / "dapo_strict_verdicts.json", encoding="utf-8") as f:
    return json.load(f)


def test_every_corpus_row_gets_the_reference_verdict():
  rows, verdicts = _corpus(), _verdicts()
  assert len(rows) == len(verdicts) >= 150
  mismatches = []
  for i, (row, want) in enumerate(zip(rows, verdicts)):
    score, pred = dapo_strict_verdict(row["response"], row["gold"])
    if (score, pred) != (want["score"], want["pred"]):
      mismatches.append(
          f"row {i}: response ...{row['response'][-80:]!r} gold {row['gold']!r}: "
          f"got ({score}, {pred!r}), reference ({want['score']}, {want['pred']!r})"
      )
  assert not mismatches, f"{len(mismatches)} of {len(rows)} rows differ:\n" + "\n".join(mismatches)


def test_the_corpus_holds_both_verdicts():
  scores = [v["score"] for v in _verdicts()]
  assert set(scores) == {1.0, -1.0}
  assert 0.3 < scores.count(1.0) / len(scores) < 0.7


def test_the_reward_is_registered_and_returns_the_score():
  assert rewards.get_reward("dapo_strict") is dapo_strict_reward
  assert dapo_strict_reward("Answer: 42", "42") == 1.0
  assert dapo_strict_reward("Answer: 41", "42") == -1.0


def test_only_the_last_300_characters_count():
  answer = "Answer: 42\n"
  assert dapo_strict_reward(answer + "x" * (300 - len(answer)), "42") == 1.0
  assert dapo_strict_reward(answer + "x" * (301 - len(answer)), "42") == -1.0
  # A later "Answer:" line outside the window never hides one inside it, nor counts itself.
  assert dapo_strict_reward("Answer: 41\n" + "y" * 400 + "\nAnswer: 42", "42") == 1.0
  assert dapo_strict_reward("Answer: 42\n" + "y" * 400, "42") == -1.0


def test_near_miss_of_a_large_integer_scores_minus_one():
  assert dapo_strict_reward("Answer: 1000001", "1000000") == -1.0
  assert dapo_strict_reward("Answer: 999999", "1000000") == -1.0
  assert dapo_strict_reward("Answer: 1,000,000", "1000000") == 1.0


def test_the_last_answer_line_wins_and_boxes_elsewhere_are_not_read():
  assert dapo_strict_reward("Answer: 41\nanswer: 42", "42") == 1.0
  assert dapo_strict_reward("Answer: 42\nAnswer: 41", "42") == -1.0
  assert dapo_strict_reward(r"So the answer is \boxed{42}.", "42") == -1.0
  assert dapo_strict_reward("<think>\\boxed{41}</think>\nAnswer: $\\boxed{42}$", "42") == 1.0


def test_answers_are_compared_as_strings_after_normalisation():
  assert normalize_final_answer(r"x = \dfrac12") == r"\dfrac{1}{2}"
  assert normalize_final_answer("42 degrees") == "42"
  assert normalize_final_answer(r"$42^\circ$.") == "42"
  assert dapo_strict_reward("Answer: 0.5", r"\frac{1}{2}") == -1.0
  assert dapo_strict_reward("Answer: 42.", "42") == -1.0


@pytest.mark.parametrize(
    "response, gold",
    [
        ("answer" + " " * 1_000_000, "42"),
        ("Answer:" + " \n" * 500_000, "42"),
        ("Answer: " + "$" * 1_000_000, "$" * 100_000),
        ("Answer: " + "frac" * 250_000, "frac" * 25_000),
        ("Answer: 4", "\\text{" * 20_000 + "\\boxed{" * 20_000),
    ],
    ids=["spaces_after_answer", "blank_lines", "dollars", "fracs", "openers_in_gold"],
)
def test_every_call_returns_quickly(response, gold):
  start = time.perf_counter()
  dapo_strict_reward(response, gold)
  assert time.perf_counter() - start < 1.0
