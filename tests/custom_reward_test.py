"""A reward of the user's own, by file path or module: both signatures, dict returns whose
extra numbers are logged, scored in the killable worker processes under the time limit,
and every way the spec can be wrong refused in one line at start-up."""

import json

import pytest

from april_jax.rewards import loading
from april_jax.rollout.reward_runner import RewardRunner
from record_builders import text_group, text_of

USER_REWARDS = """
import time

def exact(response, answer):
    return {"score": float(response.strip() == answer), "length": len(response)}

def with_prompt(sample):
    # the whole sample: the prompt it answered, its id, the response and the answer
    return float(sample["prompt"] == "q" + sample["answer"]) + 10 * sample["prompt_id"]

def by_level(sample):
    return float(sample["row"]["level"]) if sample["row"] else -5.0

def slow(response, answer):
    time.sleep(30)
    return 1.0

def not_a_number(response, answer):
    return "yes"

def ranked(samples):
    # a group judge: the shortest correct response scores 1, others by rank, with extras
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]["response"]))
    rank = {i: r for r, i in enumerate(order)}
    return [{"score": 1.0 / (1 + rank[i]), "rank": rank[i]} for i in range(len(samples))]

def short_group(samples):
    return [1.0]

def three(a, b, c):
    return 0.0

NOT_CALLABLE = 3
"""


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("user") / "my_rewards.py"
  path.write_text(USER_REWARDS)
  (path.parent / "broken.py").write_text("import no_such_package_here\n")
  return path


def test_a_file_reward_scores_in_worker_processes_and_its_extras_are_kept(user_file):
  runner = RewardRunner(loading.resolve(f"{user_file}:exact"), text_of, num_workers=2)
  group = text_group(0, "7", ["7", " 8 ", "7 "], prompt="q7")
  runner.submit(group)
  (scored,) = runner.wait_for([group])
  runner.close()
  assert scored.rewards == [1.0, 0.0, 1.0]
  assert scored.reward_info["metrics"] == {"length": [1.0, 3.0, 2.0]}
  assert runner.errors == runner.timeouts == 0


def test_the_sample_form_gets_the_prompt_and_its_id(user_file):
  runner = RewardRunner(loading.resolve(f"{user_file}:with_prompt"), text_of, num_workers=1)
  groups = [text_group(1, "3", ["a"], prompt="q3"), text_group(2, "4", ["b"], prompt="q5")]
  for g in groups:
    runner.submit(g)
  runner.wait_for(groups)
  runner.close()
  assert [g.rewards for g in groups] == [[11.0], [20.0]]


def test_the_sample_form_gets_the_dataset_rows_other_columns(user_file):
  runner = RewardRunner(loading.resolve(f"{user_file}:by_level"), text_of, num_workers=1)
  with_row, without = text_group(7, "1", ["a"], prompt="q"), text_group(8, "1", ["a"], prompt="q")
  with_row.row = {"level": 3, "source": "amc"}
  for g in (with_row, without):
    runner.submit(g)
  runner.wait_for([with_row, without])
  runner.close()
  assert with_row.rewards == [3.0] and without.rewards == [-5.0]


def test_a_user_reward_past_its_time_limit_or_returning_no_number_gets_the_fallback(user_file):
  slow = RewardRunner(loading.resolve(f"{user_file}:slow"), text_of, 1, timeout_s=1.0, fallback=-1)
  bad = RewardRunner(loading.resolve(f"{user_file}:not_a_number"), text_of, 1, fallback=-2)
  a, b = text_group(3, "1", ["x"], prompt="q"), text_group(4, "1", ["x"], prompt="q")
  slow.submit(a)
  bad.submit(b)
  slow.wait_for([a])
  bad.wait_for([b])
  slow.close()
  bad.close()
  assert a.rewards == [-1.0] and slow.timeouts == 1
  assert b.rewards == [-2.0] and bad.errors == 1


def test_the_group_form_scores_a_prompts_samples_together(user_file):
  runner = RewardRunner(loading.resolve(f"{user_file}:ranked"), text_of, num_workers=2)
  group = text_group(5, "1", ["ccc", "a", "bb"], prompt="q")
  runner.submit(group)
  runner.wait_for([group])
  wrong = RewardRunner(loading.resolve(f"{user_file}:short_group"), text_of, 1, fallback=-1)
  short = text_group(6, "1", ["a", "b"], prompt="q")
  wrong.submit(short)
  wrong.wait_for([short])
  runner.close()
  wrong.close()
  assert group.rewards == [1 / 3, 1.0, 1 / 2]
  assert group.reward_info["metrics"] == {"rank": [2.0, 0.0, 1.0]}
  # One result for two samples: every sample gets the fallback, each counted.
  assert short.rewards == [-1.0, -1.0] and wrong.errors == 2


def test_a_module_reward_by_dotted_name():
  assert loading.problem("april_jax.rewards.math:math_reward") is None
  fn = loading.resolve("april_jax.rewards.math:math_reward")
  assert loading.score(fn, "The answer is \\boxed{4}", "4")[0] == 1.0


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("{dir}/nope.py:f", "LookupError: no file"),
        ("{dir}/my_rewards.py:missing", "has no function 'missing'"),
        ("{dir}/my_rewards.py:NOT_CALLABLE", "is a int, not a function"),
        ("{dir}/my_rewards.py:three", "takes (a, b, c); a reward takes (response, answer)"),
        ("{dir}/broken.py:f", "ModuleNotFoundError: No module named 'no_such_package_here'"),
        ("no_such_module_anywhere:f", "ModuleNotFoundError"),
        ("nosuchname", "neither a registered reward"),
    ],
)
def test_each_wrong_spec_is_one_line_naming_it(user_file, spec, expected):
  spec = spec.format(dir=user_file.parent)
  message = loading.problem(spec)
  assert message is not None and expected in message and "\n" not in message
  assert message.startswith(f"rollout.reward {spec!r}")


# A run of `main` with a file reward (its extras logged, a wrong spec refused before
# compiling) is in episodes_test.py, beside a file environment: one run serves both.


def test_a_reward_that_cannot_reach_a_worker_process_is_refused_by_name():
  with pytest.raises(TypeError, match="pass processes=False to score on threads"):
    RewardRunner(lambda response, answer: 0.0, text_of)
  RewardRunner(lambda response, answer: 0.0, text_of, processes=False).close()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e300])
def test_a_reward_that_is_not_a_usable_number_is_an_error_the_runner_counts(value):
  """inf (or a float32 overflow) made the group's advantages NaN and skipped the update."""
  with pytest.raises(ValueError, match="the reward is"):
    loading.score(lambda response, answer: value, "x", "1")
  with pytest.raises(ValueError, match="the reward is"):
    loading.score(lambda response, answer: {"score": value, "n": 1}, "x", "1")
  assert loading.score(lambda response, answer: 3.0e38, "x", "1") == (3.0e38, {})


def test_a_reward_that_forks_gets_only_its_own_answers_back(tmp_path):
  """A forked child that returned into the worker's loop answered on the worker's pipe too:
  its reply was taken for the next sample's score."""
  path = tmp_path / "forking.py"
  path.write_text(
      "import os\n"
      "def score(response, answer):\n"
      "  pid = os.fork()\n"
      "  if pid == 0:\n"
      "    raise RuntimeError('the child fails')  # and falls back into the worker's loop\n"
      "  os.waitpid(pid, 0)\n"
      "  return float(len(response))\n"
  )
  runner = RewardRunner(loading.resolve(f"{path}:score"), text_of, 1, fallback=-1.0)
  groups = [text_group(i, "1", ["a" * (i + 1), "b" * (i + 2)], prompt="q") for i in range(3)]
  for group in groups:
    runner.submit(group)
  runner.wait_for(groups)
  runner.close()
  assert [g.rewards for g in groups] == [[1.0, 2.0], [2.0, 3.0], [3.0, 4.0]]
  assert runner.errors == 0
