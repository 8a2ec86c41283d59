"""Tokenizers: turn chat messages into token ids and token ids back into text.

`Tokenizer` wraps a Hugging Face `tokenizer.json` (e.g. Qwen3's) with the `tokenizers`
library and renders the model's jinja2 chat template the same way `transformers` does,
without importing `transformers`. `CharTokenizer` is a tiny character-level tokenizer
for the built-in synthetic task.
"""

from __future__ import annotations

import contextlib
import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from april_jax.errors import InputError, InputFileMissing

# Keys of tokenizer_config.json that transformers hands to the chat template as strings.
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning may be given under; templates read `reasoning_content`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_ENDOFTEXT = "<|endoftext|>"


def _token_string(value: Any) -> str | None:
  """Returns the text of a special token as written in tokenizer_config.json.

  Args:
    value: A string, a dict with a "content" key (an AddedToken), or None.

  Returns:
    The token's text, or None when the config does not set it.
  """
  if isinstance(value, dict):
    return value.get("content")
  return value


def _raise_exception(message: str) -> None:
  """Lets a chat template fail with a message: `{{ raise_exception('...') }}`."""
  raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
  """Jinja's `tojson` filter as transformers defines it: no HTML escaping, unicode kept."""
  return json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def _strftime_now(format: str) -> str:
  """Returns the current local time formatted with `format`."""
  return datetime.now().strftime(format)


def compile_chat_template(source: str) -> jinja2.Template:
  """Compiles a chat template in the environment transformers uses.

  Same sandbox, whitespace options, extension, filter and globals as transformers'
  `_compile_jinja_template`, except its `{% generation %}` tag (used only for
  assistant-token masks), which is left out.

  Args:
    source: The jinja2 source of the template.

  Returns:
    The compiled template.
  """
  env = ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(source)


def _prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Copies messages as transformers does before rendering.

  Keys whose value is None are dropped, and a reasoning given as `thinking` or
  `reasoning` is also made available as `reasoning_content` (and vice versa).

  Args:
    messages: Chat messages, each a dict with at least "role" and "content".

  Returns:
    New message dicts; the caller's messages are not changed.
  """
  prepared = []
  for message in messages:
    if not isinstance(message, dict):
      raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    prepared.append(message)
  return prepared


class Tokenizer:
  """A Hugging Face tokenizer (tokenizer.json) plus its chat template.

  Build one with `Tokenizer.from_pretrained(folder)`.
  """

  def __init__(
      self,
      tokenizer: tokenizers.Tokenizer,
      config: dict[str, Any],
      chat_template: str | None,
      path: Path,
  ) -> None:
    """Initializes the tokenizer.

    Args:
      tokenizer: The loaded `tokenizers.Tokenizer`.
      config: The contents of tokenizer_config.json ({} when absent).
      chat_template: The jinja2 chat template source, or None.
      path: The folder the tokenizer was loaded from (used in error messages).
    """
    self._tokenizer = tokenizer
    self._config = config
    self._path = path
    self._template = compile_chat_template(chat_template) if chat_template is not None else None
    self.chat_template = chat_template
    # Special token strings as the template sees them; tokens the config leaves unset are not passed.
    self.special_tokens: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
      token = _token_string(config.get(key))
      if token is not None:
        self.special_tokens[key] = token

    eos_token = self.special_tokens.get("eos_token")
    if eos_token is None and tokenizer.token_to_id(_ENDOFTEXT) is not None:
      eos_token = _ENDOFTEXT
    if eos_token is None:
      raise ValueError(
          f"No eos_token in {path / 'tokenizer_config.json'} and no {_ENDOFTEXT} in the vocabulary"
      )
    self._eos_id = self.token_to_id(eos_token)
    pad_token = self.special_tokens.get("pad_token")
    self._pad_id = self.token_to_id(pad_token) if pad_token is not None else self._eos_id
    stop_ids = [self._eos_id]
    endoftext_id = tokenizer.token_to_id(_ENDOFTEXT)
    if endoftext_id is not None and endoftext_id not in stop_ids:
      stop_ids.append(endoftext_id)
    self._stop_ids = tuple(stop_ids)

  @classmethod
  def from_pretrained(cls, path: str | Path) -> Tokenizer:
    """Loads a tokenizer from a folder.

    The folder must hold `tokenizer.json`, and may hold `tokenizer_config.json`
    (special tokens, maybe a `chat_template` string) and `chat_template.jinja`,
    which is preferred over the config's template.

    Args:
      path: The folder.

    Returns:
      The tokenizer.

    Raises:
      FileNotFoundError: If the folder or its tokenizer.json is missing.
    """
    path = Path(path)
    if not path.is_dir():
      raise InputFileMissing(f"Tokenizer folder not found: {path}")
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
      raise InputFileMissing(f"Tokenizer file not found: {tokenizer_file}")
    with _named(tokenizer_file):
      tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    config_file = path / "tokenizer_config.json"
    with _named(config_file):
      config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
      if not isinstance(config, dict):
        raise ValueError(f"a JSON object was expected, got {type(config).__name__}")
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
      with _named(template_file):
        chat_template = template_file.read_text(encoding="utf-8")
    else:
      chat_template = config.get("chat_template")
      template_file = config_file
    if chat_template is not None:
      with _named(template_file):
        compile_chat_template(chat_template)
    with _named(config_file):  # its special tokens must be in the vocabulary
      loaded = cls(tokenizer, config, chat_template, path)
    if chat_template is not None:
      with _named(template_file):  # a template that cannot render fails here, not mid-run
        loaded.apply_chat_template([{"role": "user", "content": "1+1?"}], True)
    return loaded

  @property
  def vocab_size(self) -> int:
    """Number of token ids, added tokens included."""
    return self._tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def eos_id(self) -> int:
    """Id of the config's eos_token (`<|im_end|>` for Qwen3)."""
    return self._eos_id

  @property
  def pad_id(self) -> int:
    """Id of the config's pad_token, or eos_id when there is none."""
    return self._pad_id

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end generation: eos_id, plus `<|endoftext|>` when the vocabulary has it."""
    return self._stop_ids

  def token_to_id(self, token: str) -> int:
    """Returns the id of a token.

    Raises:
      KeyError: If the token is not in the vocabulary.
    """
    token_id = self._tokenizer.token_to_id(token)
    if token_id is None:
      raise KeyError(f"Token {token!r} is not in the vocabulary of {self._path}")
    return token_id

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Encodes text to token ids; special tokens written in the text become their ids."""
    return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_text(self, text: str) -> list[int]:
    """Encodes text in which special tokens are text: `<|im_end|>` written in a tool's
    output gives the tokens of its characters, never the control id (added tokens that
    are not special, such as `<tool_response>`, still become their ids)."""
    return self._literal.encode(text, add_special_tokens=False).ids

  @functools.cached_property
  def _literal(self) -> tokenizers.Tokenizer:
    literal = tokenizers.Tokenizer.from_str(self._tokenizer.to_str())
    literal.encode_special_tokens = True
    return literal

  def special_token_texts(self) -> list[str]:
    """The text of every special token (control tokens such as `<|im_start|>`)."""
    added = self._tokenizer.get_added_tokens_decoder().values()
    return [token.content for token in added if token.special]

  def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
    """Decodes token ids to text."""
    return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(
      self,
      messages: list[dict[str, Any]],
      add_generation_prompt: bool = True,
      enable_thinking: bool = True,
      tokenize: bool = False,
      **kwargs: Any,
  ) -> str | list[int]:
    """Renders a conversation with the chat template, as transformers does.

    Args:
      messages: Dicts with "role" and "content" (and maybe "reasoning_content").
      add_generation_prompt: Whether to end with the header of a new assistant turn.
      enable_thinking: Qwen3's switch; False makes the prompt close an empty think block.
      tokenize: Whether to return token ids instead of the string.
      **kwargs: More variables for the template (e.g. `tools`); they override
        the special token strings of the same name.

    Returns:
      The rendered string, or its token ids when `tokenize` is True.

    Raises:
      ValueError: If the tokenizer has no chat template.
    """
    if self._template is None:
      raise TokenizerError(
          f"No chat template in {self._path}: expected chat_template.jinja "
          "or a chat_template entry in tokenizer_config.json"
      )
    context = {
        "tools": None,
        "documents": None,
        **self.special_tokens,
        "enable_thinking": enable_thinking,
        **kwargs,
    }
    text = self._template.render(
        messages=_prepare_messages(messages), add_generation_prompt=add_generation_prompt, **context
    )
    if tokenize:
      return self.encode(text, add_special_tokens=False)
    return text


class TokenizerError(InputError, ValueError):
  """A tokenizer folder whose files cannot be used; the message names the file."""


@contextlib.contextmanager
def _named(where: Path):
  """Any error while reading `where` becomes a TokenizerError naming it."""
  try:
    yield
  except InputError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    cause = (str(e).strip().splitlines() or [""])[0][:300]
    raise TokenizerError(f"{where} cannot be used: {type(e).__name__}: {cause}") from e


class CharTokenizer:
  """A character-level tokenizer for the synthetic task.

  Ids 0, 1, 2 are `<pad>`, `<bos>`, `<eos>`; the characters follow in order from id 3.
  """

  SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")

  def __init__(self, chars: str) -> None:
    """Initializes the tokenizer.

    Args:
      chars: The vocabulary, one character each, no repeats.
    """
    if len(set(chars)) != len(chars):
      raise ValueError(f"Repeated characters in vocabulary {chars!r}")
    self.chars = chars
    offset = len(self.SPECIAL_TOKENS)
    self._char_to_id = {char: offset + i for i, char in enumerate(chars)}
    self._id_to_text = list(self.SPECIAL_TOKENS) + list(chars)

  @property
  def vocab_size(self) -> int:
    """Number of token ids, special tokens included."""
    return len(self._id_to_text)

  @property
  def pad_id(self) -> int:
    """Id of `<pad>`."""
    return 0

  @property
  def bos_id(self) -> int:
    """Id of `<bos>`."""
    return 1

  @property
  def eos_id(self) -> int:
    """Id of `<eos>`."""
    return 2

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end generation."""
    return (self.eos_id,)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Encodes text one character per token, with `<bos>` first if `add_special_tokens`.

    Raises:
      ValueError: If the text has a character outside the vocabulary.
    """
    ids = [self.bos_id] if add_special_tokens else []
    for char in text:
      if char not in self._char_to_id:
        raise ValueError(f"Character {char!r} is not in the vocabulary {self.chars!r}")
      ids.append(self._char_to_id[char])
    return ids

  def encode_text(self, text: str) -> list[int]:
    """Encodes text one character per token (no text here spells a special token)."""
    return self.encode(text)

  def special_token_texts(self) -> list[str]:
    """The text of every special token."""
    return list(self.SPECIAL_TOKENS)

  def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
    """Decodes token ids; special tokens are written as `<pad>` etc. unless skipped.

    Ids past the vocabulary (a model's padded embedding rows) decode to U+FFFD, so a
    response that samples one is visibly wrong rather than a crash.
    """
    offset = len(self.SPECIAL_TOKENS)
    text = lambda i: self._id_to_text[i] if 0 <= i < len(self._id_to_text) else "\ufffd"
    return "".join(text(i) for i in ids if not (skip_special_tokens and 0 <= i < offset))

  def apply_chat_template(
      self,
      messages: list[dict[str, Any]],
      add_generation_prompt: bool = True,
      enable_thinking: bool = True,
      tokenize: bool = False,
      **kwargs: Any,
  ) -> str | list[int]:
    """Returns the user messages' content joined together (no template).

    The other arguments exist only to match `Tokenizer.apply_chat_template`.
    """
    text = "".join(message["content"] for message in messages if message["role"] == "user")
    return self.encode(text) if tokenize else text
