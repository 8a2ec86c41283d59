"""The tokens an environment's answer adds to an episode after a model turn.

    fmt.tokens(results, end_id) -> token ids   # end_id: the end-of-turn id the turn drew, or None

`ChatToolFormat` (env.observation_format = "chat_template") gives what a deployment
shows the model: the chat template's rendering of the tool message(s) and of the next
generation prompt, taken as the difference between two renderings of one conversation,
with and without them (and `data.enable_thinking` honoured, as at the first turn). The
model's own turn stays exactly as sampled; what closes it (`<|im_end|>\\n` in Qwen3's
template) comes from the template too, less the template's closing token when the model
drew that very token (a turn that ended on another stop id still gets it).
Several results (two calls in one turn) render as the template renders consecutive tool
messages. The whole text is tokenized at once, so a result's trailing newline merges with
the template's newline after it as it does in a full rendering (`45\\n` + `\\n</tool_response>`
gives one "\\n\\n" token). Text in a result that spells a special token (`<|im_end|>`)
stays text: only the template's own special tokens become control ids.

`TextFormat` (env.observation_format = "text") is for tokenizers without a chat template
(the built-in task): `close_turn` (when the turn did not end on an end-of-turn id), then
`observation_template` with the result(s) in it.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Protocol

_TURN = "\x00APRIL-TURN\x00"  # stand-ins that real text does not hold
_RESULT = "\x00APRIL-RESULT-{}\x00"
_RESULT_PATTERN = re.compile("\x00APRIL-RESULT-(\\d+)\x00")


class ObservationFormatError(ValueError):
  """A chat template that cannot render tool results after a model turn."""


class ObservationFormat(Protocol):

  def tokens(self, results: list[str], end_id: int | None) -> list[int]:
    ...

  def encode_text(self, text: str) -> list[int]:  # one result's own tokens
    ...


class TextFormat:
  """close_turn + observation_template around the results (joined by newlines); the
  results' text encoded with `encode_text` (control-token text stays text), the rest
  with `encode`."""

  def __init__(
      self, encode, template: str = "{observation}", close_turn: str = "", encode_text=None
  ):
    self._encode, self._close = encode, close_turn
    self.encode_text = encode_text or encode
    self._prefix, _, self._suffix = template.partition("{observation}")

  def tokens(self, results: list[str], end_id: int | None) -> list[int]:
    close = "" if end_id is not None else self._close
    body = "\n".join(results)
    return (
        list(self._encode(close + self._prefix))
        + list(self.encode_text(body))
        + list(self._encode(self._suffix))
    )


class ChatToolFormat:
  """Tool results as the chat template renders tool messages (module docstring)."""

  def __init__(self, tokenizer: Any, enable_thinking: bool, end_of_turn_ids: tuple[int, ...]):
    self._tok = tokenizer
    self._thinking = enable_thinking
    self._end_text = {int(i): tokenizer.decode([int(i)]) for i in end_of_turn_ids}
    self._specials = sorted(tokenizer.special_token_texts(), key=len, reverse=True)
    self.frame(1)  # a template that cannot do this fails at start-up

  @functools.lru_cache(maxsize=16)
  def frame(self, n: int) -> str:
    """The text after a model turn with `n` tool results (stand-ins in their places):
    what closes the turn, the tool messages and the next generation prompt."""
    base = [
        {"role": "user", "content": "Q"},
        # With reasoning given, the template renders this turn alike as the last message
        # and before tool messages (Qwen3's drops an empty think block in the latter).
        {"role": "assistant", "content": _TURN, "reasoning_content": "R"},
    ]
    tools = [{"role": "tool", "content": _RESULT.format(i)} for i in range(n)]
    render = functools.partial(self._tok.apply_chat_template, enable_thinking=self._thinking)
    without = render(base, add_generation_prompt=False)
    with_results = render(base + tools, add_generation_prompt=True)
    if _TURN not in without or not with_results.startswith(without):
      raise ObservationFormatError(
          "env.observation_format='chat_template': the chat template renders the "
          "conversation before tool messages differently once they follow, so the tool "
          "part cannot be taken as the difference; use observation_format='text'"
      )
    text = without[without.rindex(_TURN) + len(_TURN) :] + with_results[len(without) :]
    if [m.group(1) for m in _RESULT_PATTERN.finditer(text)] != [str(i) for i in range(n)]:
      raise ObservationFormatError(
          "env.observation_format='chat_template': the chat template does not render each "
          "tool message's content once, in order"
      )
    return text

  def encode_text(self, text: str) -> list[int]:
    """A result's own tokens (special tokens spelled in it stay text)."""
    return self._tok.encode_text(text)

  def tokens(self, results: list[str], end_id: int | None) -> list[int]:
    text = self.frame(len(results))
    end = self._end_text.get(end_id) if end_id is not None else None
    if end and text.startswith(end):  # the model drew the template's closing token
      text = text[len(end) :]
    ids = []
    for piece in self._split_at_specials(text):
      if piece in self._specials:
        ids.append(self._tok.token_to_id(piece))
      elif piece:
        filled = _RESULT_PATTERN.sub(lambda m: results[int(m.group(1))], piece)
        ids.extend(self._tok.encode_text(filled))
    return ids

  def _split_at_specials(self, text: str) -> list[str]:
    """`text` cut around the template's special tokens (each kept as its own piece)."""
    if not self._specials:
      return [text]
    pattern = "(" + "|".join(re.escape(s) for s in self._specials) + ")"
    return re.split(pattern, text)


def from_config(
    env_config, tokenizer: Any, enable_thinking: bool, end_of_turn_ids
) -> ObservationFormat:
  """The run's observation format (env.observation_format)."""
  if env_config.observation_format == "chat_template":
    return ChatToolFormat(tokenizer, enable_thinking, tuple(end_of_turn_ids))
  return TextFormat(
      tokenizer.encode,
      env_config.observation_template,
      env_config.close_turn,
      getattr(tokenizer, "encode_text", None),
  )
