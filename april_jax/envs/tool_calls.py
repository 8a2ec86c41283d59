"""Tool calls read from a model's turn as the hermes parser reads them.

    parse_tool_calls(turn) -> ParsedCalls(calls=[ToolCall(name, arguments), ...], error=None)
    tool_results(turn, run)  -> [run(call) for each call] | ["error: ..."] | None (no call)

vLLM and SGLang serve Qwen3 with the hermes tool parser behind a reasoning parser, so a
model trained here should be rewarded for exactly the calls a deployment would run:

- Only the text after the thinking counts: a reasoning parser hands hermes what follows
  the first `</think>`, so a call inside a closed `<think>...</think>` runs nothing.
- Each call is `<tool_call>` JSON `</tool_call>`; the JSON (strict: double quotes, no
  raw newlines inside strings, nothing after the object) is an object with a string
  `name` and an object `arguments`.
- Every call of a turn runs, in order. If any call is malformed, none does (hermes then
  returns the turn as plain text), and `error` says in one line what was wrong, so the
  observation can teach the format a deployment honours.

Stricter than hermes where a lenient reading would teach a format a deployment does not
always honour: a call never closed by `</tool_call>`, `arguments` that are not an object,
and an empty name are malformed here. A turn's calls are at most MAX_CALLS.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_END = "</think>"
CALL_FORMAT = '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'
MAX_CALLS = 8  # calls in one turn; a turn with more runs none
_JSON_SPACE = " \t\r\n"  # what JSON itself allows around a value


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParsedCalls:
  calls: list[ToolCall]  # empty when the turn makes no call, or a call is malformed
  error: str | None = None  # one line: what is wrong with the first malformed call

  @property
  def any(self) -> bool:
    """Whether the turn tried to call a tool (well-formed or not)."""
    return bool(self.calls) or self.error is not None


def after_thinking(turn: str) -> str:
  """What a reasoning parser hands the tool parser: the text after the first `</think>`."""
  end = turn.find(THINK_END)
  return turn if end < 0 else turn[end + len(THINK_END) :]


def _call_of(body: str, number: int) -> ToolCall | str:
  """The call in one `<tool_call>` body, or a line saying what is wrong with it."""
  where = f"tool call {number}"
  try:
    call = json.loads(body)
  except ValueError as e:
    reason = str(e).split(":")[0]
    return f"{where} is not valid JSON ({reason}); write {CALL_FORMAT}"
  except RecursionError:
    return f"{where} is nested too deeply to read; write {CALL_FORMAT}"
  if not isinstance(call, dict):
    return f"{where} is a JSON {type(call).__name__}, not an object; write {CALL_FORMAT}"
  name = call.get("name")
  if not isinstance(name, str) or not name:
    return f'{where} has no "name"; write {CALL_FORMAT}'
  arguments = call.get("arguments")
  if not isinstance(arguments, dict):
    return f'{where} ({name}) has no "arguments" object; write {CALL_FORMAT}'
  return ToolCall(name, arguments)


def parse_tool_calls(turn: str) -> ParsedCalls:
  """The calls in `turn`, in order, as the hermes parser (after a reasoning parser) reads
  them: all of them, or none and the first one's problem."""
  text = after_thinking(turn)
  calls, at = [], text.find(OPEN)
  while at != -1:
    start = at + len(OPEN)
    end = text.find(CLOSE, start)
    if end == -1:
      return ParsedCalls([], f"tool call {len(calls) + 1} is not closed by {CLOSE}")
    if len(calls) == MAX_CALLS:
      return ParsedCalls(
          [], f"more than {MAX_CALLS} tool calls in one turn; make at most {MAX_CALLS}"
      )
    call = _call_of(text[start:end].strip(_JSON_SPACE), len(calls) + 1)
    if isinstance(call, str):
      return ParsedCalls([], call)
    calls.append(call)
    at = text.find(OPEN, end + len(CLOSE))
  return ParsedCalls(calls)


def tool_results(turn: str, run: Callable[[ToolCall], str]) -> list[str] | None:
  """One result per call of `turn`, in order (`run` gives a call's); a single
  "error: ..." result when a call is malformed (none runs); None when the turn makes no
  call (it is the final answer)."""
  parsed = parse_tool_calls(turn)
  if not parsed.any:
    return None
  if parsed.error is not None:
    return [f"error: {parsed.error}"]
  return [run(call) for call in parsed.calls]
