"""Math rewards: answer extraction, gold normalisation, equivalence on the real eval sets."""

import concurrent.futures
import json
import os
from pathlib import Path
import random
import resource
import subprocess
import sys
import time

import pytest

from april_jax import rewards
from april_jax.rewards import math as math_reward
from conftest import MATH_DIR
from april_jax.rewards.math import extract_answer, gold_answer, is_equivalent


def _data_file(name):
  return MATH_DIR / name


def _jsonl(name):
  with open(_data_file(name)) as f:
    return [json.loads(line) for line in f if line.strip()]


def _math500():
  with open(_data_file("math500.json")) as f:
    return json.load(f)


def _boxed(answer):
  return f"Let me work through it step by step... so the answer is \\boxed{{{answer}}}"


# Extraction.


def test_extract_reads_nested_braces_inside_boxed():
  assert extract_answer(r"so $x = \boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"


def test_extract_takes_the_last_of_several_boxes():
  assert extract_answer(r"first \boxed{3}, then \fbox{4}, finally \boxed{5}. Done") == "5"


def test_extract_ignores_a_truncated_last_box():
  assert extract_answer(r"maybe \boxed{7}. Actually it is \boxed{\frac{8}{") == "7"
  assert extract_answer(r"it is \boxed{\frac{8}{") is None


def test_extract_reads_dapo_answer_line():
  assert extract_answer("Work...\nanswer: 41\nmore work\nAnswer: $42$.") == "42"


def test_extract_reads_gsm8k_hashes_without_thousands_commas():
  assert extract_answer("She pays 1,000 + 234.\n#### 1,234") == "1234"
  assert is_equivalent(extract_answer("#### 1,234"), "1234")


def test_extract_prefers_boxed_over_answer_line_over_hashes():
  assert extract_answer("#### 1\nAnswer: 2\n\\boxed{3}") == "3"
  assert extract_answer("#### 1\nAnswer: 2") == "2"


def test_extract_finds_nothing_in_plain_text():
  assert extract_answer("I think it is probably seven.") is None
  assert rewards.get_reward("math")("I think it is probably seven.", "7") == 0.0


def test_gold_answer_normalises_gsm8k_boxed_and_plain():
  assert gold_answer("3 * 24 = <<3*24=72>>72\n#### 72") == "72"
  assert gold_answer("so 1,000 total\n#### 1,000") == "1000"
  assert gold_answer(r"The area is $\boxed{\frac{3}{2}}$.") == r"\frac{3}{2}"
  assert gold_answer("  27.0 ") == "27.0"


# Real eval sets.


def test_every_aime24_gold_boxed_scores_one_and_off_by_one_scores_zero():
  reward = rewards.get_reward("math")
  rows = _jsonl("aime24.jsonl")
  assert len(rows) == 30
  for row in rows:
    assert reward(_boxed(row["answer"]), row["answer"]) == 1.0, row["answer"]
    assert reward(_boxed(int(row["answer"]) + 1), row["answer"]) == 0.0, row["answer"]


def test_aime_gold_with_leading_zero_matches_plain_number():
  assert rewards.get_reward("math")(_boxed("25"), "025") == 1.0


def test_gsm8k_test_golds_as_hashes_score_one():
  reward = rewards.get_reward("math")
  rows = _jsonl("gsm8k_test.jsonl")[:200]
  for row in rows:
    gold = gold_answer(row["answer"])
    assert gold and "," not in gold, row["answer"]
    assert reward(f"Step by step...\n#### {gold}", row["answer"]) == 1.0, gold
    assert reward(f"Step by step...\n#### {gold}1", row["answer"]) == 0.0, gold


@pytest.mark.parametrize(
    "pred, gold",
    [
        (r"(3, \frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)"),
        ("0.5", r"\frac{1}{2}"),
        (r"\frac{14}{3}", r"\dfrac{14}{3}"),
        ("27", "27.0"),
        ("1,234", "1234"),
    ],
)
def test_equivalent_forms_match(pred, gold):
  assert is_equivalent(pred, gold)


@pytest.mark.parametrize(
    "pred, gold",
    [
        (r"(3, \frac{\pi}{3})", r"\left( 3, \frac{\pi}{2} \right)"),
        ("0.51", r"\frac{1}{2}"),
        ("28", "27.0"),
        ("", "0"),
    ],
)
def test_different_answers_do_not_match(pred, gold):
  assert not is_equivalent(pred, gold)


def test_math500_first_answers_match_the_documented_forms():
  answers = [row["answer"] for row in _math500()]
  assert answers[0] == r"\left( 3, \frac{\pi}{2} \right)"
  assert answers[2] == r"\frac{14}{3}"
  reward = rewards.get_reward("math")
  assert reward(_boxed(r"(3, \frac{\pi}{2})"), answers[0]) == 1.0
  assert reward(_boxed(r"\dfrac{14}{3}"), answers[2]) == 1.0


def test_math500_golds_match_themselves_boxed():
  rows = _math500()
  assert len(rows) == 500
  reward = rewards.get_reward("math")
  matched = sum(reward(_boxed(row["answer"]), row["answer"]) for row in rows)
  print(f"MATH-500 self-match: {int(matched)}/500")
  assert matched >= 0.95 * len(rows)


def test_math500_sample_of_golds_match_themselves_under_math_verify():
  # The reward's exact-text path would pass the test above on its own; this is the
  # parse + verify path, on a fixed sample of 100.
  sample = random.Random(0).sample(_math500(), 100)
  matched = sum(math_reward.math_verify_equal(row["answer"], row["answer"]) for row in sample)
  print(f"MATH-500 self-match under math-verify: {matched}/100 sampled")
  assert matched >= 95


def test_amc_float_gold_matches_integer_box():
  rows = _jsonl("amc23.jsonl")
  assert rows[0]["answer"] == 27.0
  reward = rewards.get_reward("math")
  assert reward(_boxed(27), str(rows[0]["answer"])) == 1.0
  for row in rows:
    assert reward(_boxed(int(row["answer"])), str(row["answer"])) == 1.0, row["answer"]


def test_dapo_ground_truths_score_plus_one_and_wrong_answer_minus_one():
  pq = pytest.importorskip("pyarrow.parquet")
  table = pq.read_table(_data_file("dapo_format_aime24.parquet"), columns=["reward_model"])
  truths = sorted({row["reward_model"]["ground_truth"] for row in table.to_pylist()})
  assert len(truths) >= 29
  reward = rewards.get_reward("math_dapo")
  for gt in truths:
    assert reward(f"Reasoning...\nAnswer: {gt}", gt) == 1.0, gt
    assert reward(f"Reasoning...\nAnswer: {int(gt) + 1}", gt) == -1.0, gt
  assert reward("no final line", truths[0]) == -1.0


# The cases math_dapo once got wrong, and those where it was right and stays right.

_HAND_LABELLED = [
    # Near misses of large integers are wrong: integers compare exactly, never as floats.
    ("Answer: 1000001", "1000000", -1.0),
    ("Answer: 2016033", "2016032", -1.0),
    (f"Answer: {2**100 + 1}", str(2**100), -1.0),
    ("Answer: 2^{100}+1", str(2**100), -1.0),
    ("Answer: 1000000", "1000000", 1.0),
    ("Answer: 2^{100}", str(2**100), 1.0),
    # Decimals and fractions are exact rationals.
    ("Answer: 0.3333333", r"\frac{1}{3}", -1.0),
    ("Answer: 0.5000001", "0.5", -1.0),
    (r"\boxed{\dfrac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\frac12}", "0.5", 1.0),
    (r"Answer: $-\frac{3}{4}$", "-0.75", 1.0),
    ("Answer: 3/4", r"\frac{3}{4}", 1.0),
    # The final answer after the thinking wins over a stray box inside it.
    ("<think>maybe \\boxed{47}? no...</think> The total is 42.\nAnswer: 42", "42", 1.0),
    ("<think>it is \\boxed{42}</think>\nAnswer: 47", "42", -1.0),
    ("<think>only here: \\boxed{42}</think> I am not sure.", "42", -1.0),
    # Answer: then any whitespace, newlines included, then the answer.
    ("Answer:\n42", "42", 1.0),
    ("Answer:  \n\n  42", "42", 1.0),
    # Where april_jax was right: keep it.
    ("So the answer is \\boxed{42}", "42", 1.0),
    ("Answer: 42\n" + "and a long check afterwards. " * 20, "42", 1.0),
    ("Answer: 42.", "42", 1.0),
    (r"\boxed{\{3, 1, 2\}}", r"\{1, 2, 3\}", 1.0),
    ("Answer: 12,34", "1234", -1.0),
    ("Answer: 1,234", "1234", 1.0),
    ("Answer: 2^{10}", "1024", 1.0),
    ("no final line", "42", -1.0),
    # A box inside thinking never closed is not an answer (the response ended thinking).
    ("<think>so \\boxed{5}", "5", -1.0),
    ("<think>a</think> x <think>then \\boxed{5}", "5", -1.0),
    # Markdown around the answer line; an Answer: inside a box or in prose is not one.
    ("**Answer:** 42", "42", 1.0),
    ("**Answer: 42**", "42", 1.0),
    ("Answer: **42**", "42", 1.0),
    ("\\boxed{42}. Is this answer: correct? Yes.", "42", 1.0),
    # Money and thousands separators, on either side; spaces never merge digits.
    (r"\boxed{\$1,200}", "#### 1200", 1.0),
    (r"\boxed{1{,}200}", "1200", 1.0),
    (r"\boxed{1,200 \text{ dollars}}", "1200", 1.0),
    (r"\boxed{32348}", r"\$32,\!348", 1.0),
    (r"\boxed{1008016}", "1{,}008{,}016", 1.0),
    (r"\boxed{1\,000}", "1000", 1.0),
    (r"\boxed{2 1/2}", "21/2", -1.0),
    (r"\boxed{3 4}", "34", -1.0),
    # A decimal is exact: braces around it change nothing, an irrational is never met.
    (r"\boxed{{0.333333}}", r"\frac13", -1.0),
    (r"\boxed{3.14159265}", r"\pi", -1.0),
    (r"\boxed{0.866025}", r"\frac{\sqrt3}{2}", -1.0),
]


@pytest.mark.parametrize("response, gold, score", _HAND_LABELLED)
def test_math_dapo_scores_the_hand_labelled_cases(response, gold, score):
  assert rewards.get_reward("math_dapo")(response, gold) == score
  assert rewards.get_reward("math")(response, gold) == max(score, 0.0)


def test_plain_numbers_never_reach_math_verify(monkeypatch):
  def refuse(*args):
    raise AssertionError(f"math-verify called on {args}")

  monkeypatch.setattr(math_reward.math_verify_child, "verdict", refuse)
  for response, gold in [
      ("Answer: 1000001", "1000000"),
      (r"\boxed{\frac{1}{2}}", "0.5"),
      ("#### 1,234", "1234"),
      ("Answer: $-7$", "-7.0"),
      ("Answer: 025", "25"),
  ]:
    math_reward.math_dapo_reward(response, gold)


@pytest.mark.parametrize(
    "response",
    ["Answer: 10^{10^{10}}", r"\boxed{9^{9^{9^9}}}", "Answer: " + "(" * 5000 + "1" + ")" * 5000],
)
def test_a_power_tower_returns_within_the_bound_as_a_wrong_answer(response):
  """math-verify would compute 10^(10^10) for hours in C: the comparison's child process
  is killed at MATH_VERIFY_TIMEOUT_S and the answer is wrong (-1), never a timeout whose
  fallback pays more than a wrong answer does. In a worker thread, where signals fail."""
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    began = time.monotonic()
    score = pool.submit(math_reward.math_dapo_reward, response, "7").result()
    took = time.monotonic() - began
  assert score == -1.0
  # The bound, and the start of a fresh child (which does not count against it).
  assert took < math_reward.MATH_VERIFY_TIMEOUT_S + 60


def test_extraction_is_linear_in_the_response():
  """Unclosed boxes by the ten thousand, then a closed one: one pass over the braces, not
  one scan to the end per box (that took hours on this input). The bound is for
  termination only: the linear pass takes a fraction of a second."""
  response = "\\boxed{" * 40000 + " \\boxed{42}"
  began = time.monotonic()
  assert extract_answer(response) == "42"
  assert time.monotonic() - began < 30.0


def test_math_verify_s_child_starts_where_nothing_else_imported_math(tmp_path):
  """The child runs as a module from the package's parent folder: april_jax/rewards/ is
  never first on its path, where math.py would shadow the standard library's (seen in a
  plain virtual environment, where no start-up file had imported math already)."""
  venv = tmp_path / "venv"
  made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=False)
  if made.returncode:
    pytest.skip("no venv module here")
  python = venv / "bin" / "python"
  site_dir = subprocess.run(
      [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
      capture_output=True,
      text=True,
      check=True,
  ).stdout.strip()
  # Only paths: the .pth files in the base installation's folder are not run.
  base = [p for p in sys.path if p.endswith("site-packages")]
  root = str(Path(math_reward.__file__).resolve().parents[2])
  (Path(site_dir) / "base.pth").write_text("\n".join(base + [root]) + "\n")
  out = subprocess.run(
      [
          str(python),
          "-c",
          "from april_jax.rewards import math as M; print(M.is_equivalent('x+1', '1+x'))",
      ],
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
      env={"PATH": os.environ["PATH"]},
  )
  assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def test_math_verify_answers_from_a_thread_whose_pipes_are_past_fd_1024():
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if hard != resource.RLIM_INFINITY and hard < 2048:
    pytest.skip("this process may not hold 2,048 files")
  resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
  files = [open(os.devnull) for _ in range(1100)]
  try:
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:  # a fresh child
      assert pool.submit(math_reward.math_verify_equal, "x+3", "3+x").result()
  finally:
    for f in files:
      f.close()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# Safety and threads.


def test_model_text_is_never_executed(tmp_path):
  marker = tmp_path / "pwned_marker"
  for response in [
      f"\\boxed{{__import__('os').system('touch {marker}')}}",
      f"Answer: __import__('os').system('touch {marker}')",
      f"#### __import__('os').system('touch {marker}')",
  ]:
    assert rewards.get_reward("math")(response, "42") == 0.0
  assert not marker.exists()


def test_is_equivalent_works_in_worker_threads():
  pairs = [
      (r"\frac{1}{2}", "0.5", True),
      (r"(3, \frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)", True),
      (r"\sqrt{2}", r"\frac{\sqrt{8}}{2}", True),
      (r"\frac{1}{3}", "0.5", False),
  ] * 4
  with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
    results = list(pool.map(lambda p: is_equivalent(p[0], p[1]), pairs))
  assert results == [want for _, _, want in pairs]


# Registry.


def test_math_rewards_are_registered():
  assert rewards.get_reward("math") is math_reward.math_reward
  assert rewards.get_reward("math_dapo") is math_reward.math_dapo_reward


def test_unknown_reward_name_raises_key_error_listing_known_names():
  with pytest.raises(KeyError, match="math_dapo"):
    rewards.get_reward("no_such_reward")


def test_duplicate_reward_name_is_refused():
  with pytest.raises(ValueError, match="already registered"):
    rewards.register("math")(lambda response, answer: 0.0)
  assert rewards.get_reward("math") is math_reward.math_reward
