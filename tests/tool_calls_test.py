"""Tool calls are read as the hermes parser reads them behind a reasoning parser: every
well-formed call of a turn in order, none when one is malformed (with one line saying
what is wrong), nothing from inside a closed thinking block."""

import json

import pytest

from april_jax.envs.tool_calls import ToolCall, parse_tool_calls

CODE = {"code": "print(2 ** 10)"}
CANONICAL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(2 ** 10)"}}\n</tool_call>'
SECOND = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'


@pytest.mark.parametrize(
    "name,turn,calls,error",
    [
        ("canonical", "Let me compute.\n" + CANONICAL, [ToolCall("python", CODE)], None),
        (
            "two calls",
            CANONICAL + "\n" + SECOND,
            [ToolCall("python", CODE), ToolCall("python", {"code": "print(1)"})],
            None,
        ),
        (
            "single quotes",
            "<tool_call>{'name': 'python', 'arguments': {'code': 'print(1)'}}</tool_call>",
            [],
            "tool call 1 is not valid JSON (Expecting property name enclosed in double quotes)",
        ),
        (
            "missing brace",
            '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}</tool_call>',
            [],
            "tool call 1 is not valid JSON (Expecting ',' delimiter)",
        ),
        (
            "trailing text",
            '<tool_call>{"name": "python", "arguments": {"code": "x"}} and more</tool_call>',
            [],
            "tool call 1 is not valid JSON (Extra data)",
        ),
        (
            "no name",
            '<tool_call>{"arguments": {"code": "print(1)"}}</tool_call>',
            [],
            'tool call 1 has no "name"',
        ),
        (
            "arguments not an object",
            '<tool_call>{"name": "python", "arguments": "print(1)"}</tool_call>',
            [],
            'tool call 1 (python) has no "arguments" object',
        ),
        (
            "call inside the thinking",
            "<think>try " + CANONICAL + "</think>The answer is 4.",
            [],
            None,
        ),
        (
            "call after the thinking",
            "<think>" + SECOND + "</think>" + CANONICAL,
            [ToolCall("python", CODE)],
            None,
        ),
        (
            "unterminated",
            '<tool_call>{"name": "python", "arguments": {"code": "x"}}',
            [],
            "tool call 1 is not closed by </tool_call>",
        ),
        (
            "a good call then a bad one",
            CANONICAL + "<tool_call>print(1)</tool_call>",
            [],
            "tool call 2 is not valid JSON",
        ),
        (
            "raw newline in a string",
            '<tool_call>{"name": "python", "arguments": {"code": "a = 1\nprint(a)"}}</tool_call>',
            [],
            "tool call 1 is not valid JSON (Invalid control character at)",
        ),
        ("bare code", "<tool_call>print(3)</tool_call>", [], "tool call 1 is not valid JSON"),
        ("no call", "So the answer is \\boxed{4}.", [], None),
        (  # as a reasoning parser splits: at the first </think>
            "call after the first think end",
            "<think>a</think>" + CANONICAL + " and I wrote </think>",
            [ToolCall("python", CODE)],
            None,
        ),
        (
            "nested too deeply",
            "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>",
            [],
            "tool call 1 is nested too deeply",
        ),
        ("too many calls", CANONICAL * 9, [], "more than 8 tool calls in one turn"),
    ],
)
def test_calls_are_parsed_as_hermes_parses_them(name, turn, calls, error):
  parsed = parse_tool_calls(turn)
  assert parsed.calls == calls, name
  if error is None:
    assert parsed.error is None, name
  else:
    assert parsed.error.startswith(error), (name, parsed.error)
    assert "\n" not in parsed.error  # one line the model can read
  assert parsed.any == bool(calls or error)


def test_the_arguments_come_back_as_the_model_wrote_them():
  arguments = {"code": 'print("a\\tb")\nx = [1, 2]', "timeout": 3}
  turn = "<tool_call>" + json.dumps({"name": "python", "arguments": arguments}) + "</tool_call>"
  assert parse_tool_calls(turn).calls == [ToolCall("python", arguments)]
