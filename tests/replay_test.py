"""The replay shows what a run holds, and what it holds is what a deployment shows the
model: transformers' chat template (with the tool schema) gives the same ids for the
prompt, and for each tool part and the next generation prompt, thinking on and off, for
outputs with and without a trailing newline, a traceback and two calls in one turn."""

import json
import shutil

import pytest

import cli
import hf_oracle
from april_jax import replay
from april_jax.tokenizer import Tokenizer
from conftest import MODEL_CONFIGS_DIR, QWEN3_TOKENIZER_DIR, TOOL_ISOLATION, load_config


def _call(code):
  return (
      "<tool_call>\n"
      + json.dumps({"name": "python", "arguments": {"code": code}})
      + "\n</tool_call>"
  )


TURNS = [
    "<think>\nCompute it.\n</think>\n\n" + _call("print(2 ** 10 + 45)"),  # "1069\n"
    _call("import sys\nsys.stdout.write('45')"),  # no trailing newline
    "Check the division.\n" + _call("1 / 0"),  # a traceback
    _call("print(1)") + "\n" + _call("print('two')"),  # two calls in one turn
    "<think>\n\n</think>\n\nSo the answer is \\boxed{1069}.",  # no call: the end
]
ROW = {"problem": "What is 2^10 + 45?", "answer": "1069"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp("qwen3")
  for f in QWEN3_TOKENIZER_DIR.iterdir():
    shutil.copy(f, folder / f.name)
  shutil.copy(MODEL_CONFIGS_DIR / "qwen3-4b.config.json", folder / "config.json")
  return folder


def _replayed(model_dir, thinking):
  c = load_config("math_python_tool")
  c.env.isolation = TOOL_ISOLATION
  c.model.path = str(model_dir)
  c.data.enable_thinking = thinking
  return replay.replay(c, Tokenizer.from_pretrained(model_dir), ROW, TURNS)


def test_the_replay_marks_model_tokens_as_trained_and_observations_as_given(model_dir):
  result = _replayed(model_dir, thinking=False)
  kinds = [kind for kind, _ in result["parts"]]
  assert kinds == ["prompt"] + ["model", "observation"] * 4 + ["model"]
  assert result["ended"] == "the environment ended the episode" and result["turns_ignored"] == 0
  start = 0
  for kind, ids in result["parts"]:
    assert result["mask"][start : start + len(ids)] == [int(kind == "model")] * len(ids)
    start += len(ids)
  roles = [m["role"] for m in result["messages"]]
  assert roles == ["system", "user"] + ["assistant", "tool"] * 3 + [
      "assistant",
      "tool",
      "tool",
      "assistant",
  ]
  results = [m["content"] for m in result["messages"] if m["role"] == "tool"]
  assert results[:2] == ["1069\n", "45"] and "ZeroDivisionError" in results[2]
  assert results[3:] == ["1\n", "two\n"]
  assert result["tools"][0]["function"]["name"] == "python"


def test_a_trailing_newline_merges_with_the_template_s_as_in_a_full_rendering(model_dir):
  tok = Tokenizer.from_pretrained(model_dir)
  result = _replayed(model_dir, thinking=True)
  first_observation = result["parts"][2][1]
  # "1069\n" then "\n</tool_response>": one "\n\n" token (271), as the template renders it.
  assert tok.encode("1069\n\n</tool_response>") == first_observation[6 : 6 + 6]
  assert 271 in first_observation and first_observation.count(198) == 5


def test_transformers_renders_the_same_prompt_tool_parts_and_next_prompts(model_dir):
  hf_oracle.require("torch", "transformers")
  cases, expected = [], []
  for thinking in (True, False):
    result = _replayed(model_dir, thinking)
    messages, tools, parts = result["messages"], result["tools"], result["parts"]
    cases.append([messages[:2], True, thinking, tools])
    expected.append(parts[0][1])
    # After each observation, the conversation so far (its tool messages included).
    upto = 2
    for k in range(1, len(parts)):
      kind, ids = parts[k]
      if kind == "model":
        upto += 1  # the assistant message
        continue
      while upto < len(messages) and messages[upto]["role"] == "tool":
        upto += 1
      cases.append([messages[:upto], True, thinking, tools])
      expected.append(ids)
  rendered = hf_oracle.chat(model_dir, cases)
  assert len(rendered) == len(expected) == 2 * 5
  im_end = Tokenizer.from_pretrained(model_dir).token_to_id("<|im_end|>")
  for i, ((_, hf_ids), ours) in enumerate(zip(rendered, expected)):
    if i % 5 == 0:  # the prompt: the whole rendering
      assert hf_ids == ours
    else:  # the tool part and the next prompt: what follows the model's <|im_end|>
      assert hf_ids[-len(ours) :] == ours, i
      assert hf_ids[-len(ours) - 1] == im_end, i


def _replay_command(model_dir, transcript):
  return cli.run(
      f"--config.model.path={model_dir}",
      f"--transcript={transcript}",
      f"--config.env.isolation={TOOL_ISOLATION}",
      config="math_python_tool.py",
      module="april_jax.replay",
      devices=None,
      timeout=300,
  )


def test_the_cli_prints_the_episode_and_a_json_last_line(model_dir, tmp_path):
  transcript = tmp_path / "episode.json"
  transcript.write_text(json.dumps({"row": ROW, "turns": TURNS[:1] + TURNS[-1:]}))
  proc = _replay_command(model_dir, transcript)
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stdout.strip().splitlines()
  assert "=== observation: " in proc.stdout and "1069" in proc.stdout
  last = json.loads(lines[-1])
  assert set(last) == {"ids", "mask", "messages", "tools"}
  assert len(last["ids"]) == len(last["mask"]) and [m["role"] for m in last["messages"]][-2:] == [
      "tool",
      "assistant",
  ]


def test_a_bad_transcript_is_one_line_naming_the_problem(model_dir, tmp_path):
  transcript = tmp_path / "bad.json"
  transcript.write_text(json.dumps({"row": ROW, "turns": "not a list"}))
  proc = _replay_command(model_dir, transcript)
  assert proc.returncode == 2
  assert proc.stderr.strip().count("\n") == 0 and "turns as text" in proc.stderr
