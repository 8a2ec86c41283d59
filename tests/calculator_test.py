"""The calculator tool parses arithmetic and nothing else: real values for real
expressions, and a refusal (never an evaluation) for code, names, calls and sizes that
could hold the process."""

import json

import pytest

from april_jax.envs.calculator import CalculatorEnv, CalculatorError, calculate


@pytest.mark.parametrize(
    "expression,value",
    [
        ("3 * (4 + 5) / 2", "13.5"),
        ("2 ** 10 - 1", "1023"),
        ("-(7 - 10) * 2", "6"),
        ("1,234 + 766", "2000"),  # thousands separators
        ("10 / 4", "2.5"),
        ("10 // 4 + 10 % 4", "4"),
        ("0.1 + 0.2", "0.3"),
        ("48 / 2 * 3", "72"),
        ("  12  ", "12"),
    ],
)
def test_arithmetic_gives_its_value(expression, value):
  assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression,reason",
    [
        ("__import__('os').system('true')", "not arithmetic: Call"),
        ("x + 1", "not arithmetic: Name"),
        ("(1).real", "not arithmetic: Attribute"),
        ("[1, 2]", "not arithmetic: List"),
        ("'a' * 3", "not arithmetic: Constant"),
        ("True + 1", "not arithmetic: Constant"),
        ("1 / 0", "division by zero"),
        ("10 ** 10 ** 10", "too big"),
        ("9" * 40 + " * " + "9" * 40, "too big"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an expression"),
        ("", "empty"),
        ("1+" * 150 + "1", "more than 200 characters"),
    ],
)
def test_everything_else_is_refused_without_being_run(expression, reason):
  with pytest.raises(CalculatorError, match=reason):  # by size, before any power is computed
    calculate(expression)


def _call(expression):
  return json.dumps({"name": "calculator", "arguments": {"expression": expression}})


@pytest.mark.parametrize(
    "turn,results",
    [
        (f"<tool_call>{_call('3 * (4 + 5)')}</tool_call>", ["27"]),
        (  # every call of the turn, in order
            f"first <tool_call>{_call('1 + 1')}</tool_call> then <tool_call>{_call('2 ** 10')}</tool_call>",
            ["2", "1024"],
        ),
        (f"<tool_call>{_call('open(1)')}</tool_call>", ["error: not arithmetic: Call"]),
        ("<tool_call>1 + 1</tool_call>", ["error: tool call 1 is not valid JSON"]),
        (
            '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>',
            ["error: a calculator call needs"],
        ),
        (f"<tool_call>{_call('1 + 1')}", ["error: tool call 1 is not closed"]),
        ("The answer is \\boxed{27}.", None),
        (f"<think><tool_call>{_call('1 + 1')}</tool_call></think>\\boxed{{27}}", None),
    ],
)
def test_the_calculator_answers_every_call_of_the_turn_or_ends_the_episode(turn, results):
  env = CalculatorEnv()
  out = env.step(env.reset({"answer": "27"}), turn)
  assert out.done == (results is None)
  if results is not None:
    assert len(out.observation) == len(results)
    for got, want in zip(out.observation, results):
      assert got.startswith(want), (got, want)
  assert out.state == {"calls": 0 if results is None else 1}
