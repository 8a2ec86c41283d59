"""A calculator for tool calls: arithmetic expressions parsed, never evaluated as code.

  calculate("3 * (4 + 5) / 2")  -> "13.5"
  calculate("2 ** 10 - 1")      -> "1023"
  calculate("1,234 + 5%")       -> CalculatorError (a percent sign is not an operator here)

Model output is untrusted text: it is parsed with `ast.parse(mode="eval")` and only
numbers, parentheses, + - * / // % ** and unary signs are accepted; a name, a call, an
attribute or any other node is refused. Sizes are bounded so no answer can hold the
process: the expression's length, a power's exponent and the magnitude of every
intermediate result. Thousands separators ("1,234") are accepted in numbers.

`CalculatorEnv` (env.name = "calculator") is the tool as a multi-turn environment; its
calls are read as the hermes parser reads them (tool_calls.py).
"""

from __future__ import annotations

import ast
import math
import operator
import re

from april_jax.envs.base import EnvStep, register
from april_jax.envs.tool_calls import ToolCall, tool_results

MAX_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


class CalculatorError(ValueError):
  """The expression is not arithmetic this calculator does, or its result is too big."""


def _value(node: ast.AST) -> int | float:
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return node.value
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _checked(_UNARY[type(node.op)](_value(node.operand)))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _value(node.left), _value(node.right)
    if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or abs(left) > MAX_MAGNITUDE):
      raise CalculatorError(f"a power with exponent {right} is too big")
    if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
      raise CalculatorError("division by zero")
    try:
      return _checked(_BINARY[type(node.op)](left, right))
    except (OverflowError, ZeroDivisionError) as e:
      raise CalculatorError(str(e)) from None
  raise CalculatorError(f"not arithmetic: {type(node).__name__}")


def _checked(x: int | float | complex) -> int | float:
  if isinstance(x, complex):
    raise CalculatorError("the result is not a real number")
  if isinstance(x, float) and not math.isfinite(x) or abs(x) > MAX_MAGNITUDE:
    raise CalculatorError("the result is too big")
  return x


def _format(x: int | float) -> str:
  if isinstance(x, float) and x.is_integer():
    x = int(x)
  if isinstance(x, int):
    return str(x)
  return f"{x:.10g}"


def calculate(expression: str) -> str:
  """The value of an arithmetic expression, as text (integers without a decimal point).
  Raises CalculatorError for anything else."""
  text = _THOUSANDS.sub("", expression.strip())
  if not text:
    raise CalculatorError("an empty expression")
  if len(text) > MAX_CHARS:
    raise CalculatorError(f"an expression of more than {MAX_CHARS} characters")
  try:
    tree = ast.parse(text, mode="eval")
  except SyntaxError as e:
    raise CalculatorError(f"not an expression: {e.msg}") from None
  return _format(_value(tree.body))


def call_expression(call: ToolCall) -> str:
  """The expression a well-formed call asks to compute; CalculatorError when it names
  another tool or gives no expression."""
  if call.name != "calculator":
    raise CalculatorError(f"there is no tool {call.name!r}: the tool is 'calculator'")
  expression = call.arguments.get("expression")
  if not isinstance(expression, str):
    raise CalculatorError('a calculator call needs {"arguments": {"expression": "..."}}')
  return expression


def _result(call: ToolCall) -> str:
  try:
    return calculate(call_expression(call))
  except CalculatorError as e:
    return f"error: {e}"


@register("calculator")
class CalculatorEnv:
  """GSM8K with a calculator: each call of a turn gets its result (or the calculator's
  error) as one tool result; a malformed call computes nothing and the result says what
  was wrong; a turn with no call is the final answer and ends the episode. State: the
  number of turns that called."""

  def reset(self, row: dict) -> dict:
    del row
    return {"calls": 0}

  def step(self, state: dict, turn: str) -> EnvStep:
    results = tool_results(turn, _result)
    if results is None:
      return EnvStep(observation=None, done=True, state=state)
    return EnvStep(observation=results, done=False, state={"calls": state["calls"] + 1})
