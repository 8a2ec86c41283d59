"""The calculator tool parses arithmetic and nothing else: real values for real
expressions, and a refusal (never an evaluation) for code, names, calls and sizes that
could hold the process."""

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


@pytest.mark.parametrize(
    "turn,observation",
    [
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>',
            "27",
        ),
        ("first <tool_call>1 + 1</tool_call> then <tool_call>2 ** 10</tool_call>", "1024"),
        ("<tool_call>open('/etc/passwd')</tool_call>", "error: not arithmetic: Call"),
        ('<tool_call>{"name": "calculator", "arguments": {}}', "error: a call needs"),
        ("The answer is \\boxed{27}.", None),
    ],
)
def test_the_calculator_environment_answers_the_turns_last_call_or_ends_the_episode(
    turn, observation
):
  env = CalculatorEnv()
  out = env.step(env.reset({"answer": "27"}), turn)
  assert out.done == (observation is None)
  assert out.observation == observation or out.observation.startswith(observation)
  assert out.state == {"calls": 0 if observation is None else 1}
