"""Tests for april_jax.tokenizer on the real Qwen3 tokenizer files."""

import json
import shutil
from pathlib import Path

import pytest

import hf_oracle

from april_jax.errors import InputError
from april_jax.tokenizer import CharTokenizer, Tokenizer

from conftest import QWEN3_TOKENIZER_DIR as QWEN3_DIR

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is 2 + 3?"}],
    "system_and_user": [
        {"role": "system", "content": "You are a careful math tutor."},
        {"role": "user", "content": "Solve x^2 = 4 for x > 0."},
    ],
    "multi_turn_with_thinking": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 7 * 6?"},
        {"role": "assistant", "content": "<think>\n7 * 6 = 42.\n</think>\n\nThe answer is 42."},
        {"role": "user", "content": "And 42 / 7? Réponds en français — ∑ ok."},
    ],
    "ends_with_assistant_thinking": [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nHi!"},
    ],
}


CASES = [
    (name, add_generation_prompt, enable_thinking)
    for name in CONVERSATIONS
    for add_generation_prompt in (True, False)
    for enable_thinking in (True, False)
]


@pytest.fixture(scope="module")
def hf_qwen3():
  """transformers' rendering of every case, (text, ids) by case (hf_oracle.py)."""
  hf_oracle.require("transformers")
  cases = [(CONVERSATIONS[name], gen, thinking) for name, gen, thinking in CASES]
  return dict(zip(CASES, hf_oracle.chat(QWEN3_DIR, cases)))


def test_encode_matches_known_qwen3_ids(qwen3_tokenizer):
  assert qwen3_tokenizer.encode("Hello world") == [9707, 1879]
  assert qwen3_tokenizer.encode("<|im_start|>hello<|im_end|>") == [151644, 14990, 151645]


def test_digits_are_one_token_each(qwen3_tokenizer):
  ids = qwen3_tokenizer.encode("12345")
  assert len(ids) == 5
  assert [qwen3_tokenizer.decode([i]) for i in ids] == list("12345")


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "  leading and trailing  \n",
        "héllo wörld 你好 🙂",
        "∫_0^1 x^2 dx = 1/3, so \\frac{1}{3} ≈ 0.333",
    ],
)
def test_decode_inverts_encode(qwen3_tokenizer, text):
  assert qwen3_tokenizer.decode(qwen3_tokenizer.encode(text)) == text


def test_special_ids_are_qwen3s(qwen3_tokenizer):
  assert qwen3_tokenizer.eos_id == 151645
  assert qwen3_tokenizer.pad_id == 151643
  assert 151645 in qwen3_tokenizer.stop_ids and 151643 in qwen3_tokenizer.stop_ids
  assert len(set(qwen3_tokenizer.stop_ids)) == len(qwen3_tokenizer.stop_ids)
  assert qwen3_tokenizer.token_to_id("<|im_end|>") == 151645


def test_vocab_size_counts_added_tokens(qwen3_tokenizer):
  assert qwen3_tokenizer.vocab_size == 151669
  assert qwen3_tokenizer.vocab_size > qwen3_tokenizer.token_to_id("<|im_end|>")


def test_skip_special_tokens_drops_them_in_decode(qwen3_tokenizer):
  ids = qwen3_tokenizer.encode("<|im_start|>hello<|im_end|>")
  assert qwen3_tokenizer.decode(ids, skip_special_tokens=True) == "hello"


@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_template_renders_like_transformers(
    qwen3_tokenizer, hf_qwen3, name, add_generation_prompt, enable_thinking
):
  messages = CONVERSATIONS[name]
  expected, expected_ids = hf_qwen3[(name, add_generation_prompt, enable_thinking)]
  rendered = qwen3_tokenizer.apply_chat_template(
      messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
  )
  assert rendered == expected
  assert (
      qwen3_tokenizer.apply_chat_template(
          messages,
          add_generation_prompt=add_generation_prompt,
          enable_thinking=enable_thinking,
          tokenize=True,
      )
      == expected_ids
  )


def test_disabled_thinking_prompt_closes_an_empty_think_block(qwen3_tokenizer):
  rendered = qwen3_tokenizer.apply_chat_template(
      CONVERSATIONS["single_user"], enable_thinking=False
  )
  assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tokenized_chat_is_the_ids_of_the_rendered_string(qwen3_tokenizer):
  messages = CONVERSATIONS["multi_turn_with_thinking"]
  rendered = qwen3_tokenizer.apply_chat_template(messages)
  ids = qwen3_tokenizer.apply_chat_template(messages, tokenize=True)
  assert ids == qwen3_tokenizer.encode(rendered)
  assert ids[0] == qwen3_tokenizer.token_to_id("<|im_start|>")


def test_missing_folder_raises_file_not_found_naming_it(tmp_path):
  missing = tmp_path / "no_such_tokenizer"
  with pytest.raises(FileNotFoundError, match=str(missing)):
    Tokenizer.from_pretrained(missing)


def test_missing_tokenizer_json_raises_file_not_found_naming_it(tmp_path):
  shutil.copy(QWEN3_DIR / "tokenizer_config.json", tmp_path)
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
    Tokenizer.from_pretrained(tmp_path)


def _folder_with_config(tmp_path: Path, config: dict) -> Path:
  (tmp_path / "tokenizer.json").symlink_to(QWEN3_DIR / "tokenizer.json")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  return tmp_path


def test_no_chat_template_raises_value_error_naming_folder(tmp_path):
  folder = _folder_with_config(tmp_path, {"eos_token": "<|im_end|>"})
  tokenizer = Tokenizer.from_pretrained(folder)
  with pytest.raises(ValueError, match=str(folder)):
    tokenizer.apply_chat_template(CONVERSATIONS["single_user"])


def test_chat_template_falls_back_to_config_string(qwen3_tokenizer, tmp_path):
  template = (QWEN3_DIR / "chat_template.jinja").read_text()
  config = {"eos_token": {"content": "<|im_end|>", "special": True}, "chat_template": template}
  tokenizer = Tokenizer.from_pretrained(_folder_with_config(tmp_path, config))
  messages = CONVERSATIONS["system_and_user"]
  assert tokenizer.apply_chat_template(messages) == qwen3_tokenizer.apply_chat_template(messages)
  assert tokenizer.eos_id == 151645
  assert tokenizer.pad_id == tokenizer.eos_id


def test_char_tokenizer_round_trips():
  tokenizer = CharTokenizer("0123456789+=")
  ids = tokenizer.encode("12+30=42")
  assert min(ids) >= 3 and max(ids) < tokenizer.vocab_size == 15
  assert tokenizer.decode(ids) == "12+30=42"
  assert tokenizer.decode(ids + [tokenizer.eos_id], skip_special_tokens=True) == "12+30=42"
  assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.stop_ids) == (0, 2, (2,))
  messages = [{"role": "user", "content": "1+1="}]
  assert tokenizer.apply_chat_template(messages) == "1+1="
  assert tokenizer.apply_chat_template(messages, tokenize=True) == tokenizer.encode("1+1=")


def test_char_tokenizer_rejects_unknown_characters():
  with pytest.raises(ValueError, match="'x'"):
    CharTokenizer("0123456789").encode("12x")


def test_char_tokenizer_decodes_ids_past_its_vocabulary_as_replacement_chars():
  tok = CharTokenizer("ab")
  assert tok.decode([3, 4, 99]) == "ab\ufffd"


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("tokenizer.json", '{"version": "1.0", "trunc', "tokenizer.json cannot be used"),
        ("tokenizer_config.json", "{not json", "tokenizer_config.json cannot be used"),
        ("tokenizer_config.json", "[1, 2]", "a JSON object was expected"),
        ("chat_template.jinja", "{% for m in messages %}", "chat_template.jinja cannot be used"),
        ("chat_template.jinja", "{{ messages[0].content.nope() }}", "chat_template.jinja"),
    ],
)
def test_a_broken_tokenizer_file_is_one_input_error_naming_it(tmp_path, name, content, words):
  """Each ended in a traceback, the template's only when the first prompt was rendered."""
  folder = tmp_path / "tok"
  shutil.copytree(QWEN3_DIR, folder)
  (folder / name).write_text(content)
  with pytest.raises(InputError, match=words):
    Tokenizer.from_pretrained(folder)
