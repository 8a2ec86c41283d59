"""Replay one episode of a config without a model: what a run would hold, token by token.

  python -m april_jax.replay --config=configs/math_python_tool.py \\
      --config.model.path=/models/Qwen3-4B --transcript=episode.json

FILE is JSON: {"row": {...a data row...}, "turns": ["the model's turn 1", ...]}. The
replay opens the episode as a run does (the environment's reset, its messages and tools
rendered by the chat template, or the row's prompt), appends each turn as the model's
tokens (the end-of-turn token added when the text does not end with one), and asks the
environment for its answer: the tools really run. It prints the sequence with each part
marked, model tokens (trained) and observations (given, not trained), and ends with one
JSON line: `ids` (prompt and response), `mask` (1 where a token trains), `messages` (the
conversation as chat messages: system, user, assistant, tool) and `tools` (the schemas
given to the chat template, or null). Use it to check a template or an environment
before spending a GPU hour. Turns left after the episode ends are reported and ignored.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from absl import app
from absl import flags
from ml_collections import config_flags
import numpy as np

from april_jax import cli
from april_jax import data as data_lib
from april_jax.rollout import run_episodes
from april_jax.envs.base import EnvReset
from april_jax.errors import InputError
from april_jax.sampler.records import SampleRecord
from april_jax.validation.checks import settings_of


def _define_flags() -> None:
  """The command's flags, defined when it runs (importing this module for `replay`
  defines none, so it lives beside april_jax.main's --config in one process)."""
  config_flags.DEFINE_config_file(
      "config", None, "Config file (configs/*.py) with an env section.", lock_config=True
  )
  flags.DEFINE_string("transcript", None, 'JSON: {"row": {...}, "turns": ["...", ...]}.')
  flags.mark_flags_as_required(["config", "transcript"])


def _tokenizer(config):
  """The run's tokenizer: the model's (or model.tokenizer_path), else the built-in task's."""
  from april_jax.tasks import longtail as longtail_task  # pylint: disable=g-import-not-at-top
  from april_jax.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top

  path = config.model.tokenizer_path or config.model.path
  if path:
    return Tokenizer.from_pretrained(path)
  return longtail_task.tokenizer(config.data.task.ring_size)


def read_transcript(path: str) -> tuple[dict, list[str]]:
  """(row, turns) from a transcript file; InputError naming what is wrong."""
  try:
    with open(path, encoding="utf-8") as f:
      transcript = json.load(f)
  except (OSError, ValueError) as e:
    raise InputError(f"--transcript={path}: {e}") from None
  row, turns = (
      (transcript.get("row"), transcript.get("turns"))
      if isinstance(transcript, dict)
      else (None, None)
  )
  if (
      not isinstance(row, dict)
      or not isinstance(turns, list)
      or not all(isinstance(t, str) for t in turns)
  ):
    raise InputError(
        f'--transcript={path}: expected {{"row": {{...}}, "turns": ["...", ...]}} (turns as text)'
    )
  return row, turns


def replay(config, tokenizer, row: dict, turns: list[str]) -> dict[str, Any]:
  """The episode a run would hold for `row` and the model's `turns` (module docstring):
  {"parts": [(kind, ids)], "ids", "mask", "messages", "tools", "ended", "counts"}."""
  runner, turn_stop_ids = run_episodes.runner_for(config, tokenizer)
  if runner is None:
    raise InputError("the config has no environment (env.name is empty): nothing to replay")
  try:
    record_in = data_lib.record_from_row(row, config.data.prompt_key, config.data.answer_key)
    reset = runner.env.reset({**record_in["row"], "answer": record_in["answer"]})
    messages, tools = _first_messages(config, record_in, reset)
    prompt = data_lib.PromptIterator(
        [record_in],
        tokenizer,
        max_prompt_len=1 << 30,
        shuffle=False,
        system_prompt=config.data.system_prompt,
        enable_thinking=config.data.enable_thinking,
    ).tokens(record_in)
    record = SampleRecord(prompt, config.rollout.max_response_len, rng=np.zeros(2, np.uint32))
    runner.start([record], [{**record_in["row"], "answer": record_in["answer"]}])
    if record.episode.error is not None:
      raise InputError(f"the environment could not open the episode: {record.episode.error}")
    parts = [("prompt", [int(t) for t in record.prompt])]
    ends = set(tokenizer.stop_ids) | set(turn_stop_ids)
    ended, used = "turns ran out", 0
    for turn in turns:
      ids = tokenizer.encode(turn)
      if not ids or ids[-1] not in ends:
        ids.append(tokenizer.stop_ids[0])
      record.give(ids, 0)
      parts.append(("model", ids))
      messages.append(
          {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
      )
      used += 1
      tokens, results = runner.step_once(record)
      if tokens is None:
        ended = record.episode.error or "the environment ended the episode"
        break
      record.give(tokens, 0)
      parts.append(("observation", [int(t) for t in tokens]))
      messages += [{"role": "tool", "content": r} for r in results or []]
    counts = dict(runner.counts)
  finally:
    runner.close()
  ids = [t for _, part in parts for t in part]
  mask = [int(kind == "model") for kind, part in parts for _ in part]
  return {
      "parts": parts,
      "ids": ids,
      "mask": mask,
      "messages": messages,
      "tools": tools,
      "ended": ended,
      "turns_ignored": len(turns) - used,
      "counts": counts,
  }


def _first_messages(config, record_in: dict, reset: Any) -> tuple[list[dict], list | None]:
  """The conversation's opening messages and tools, as the prompt was rendered."""
  if isinstance(reset, EnvReset) and reset.messages is not None:
    return [dict(m) for m in reset.messages], reset.tools
  messages = list(record_in["messages"])
  if config.data.system_prompt:
    messages = [{"role": "system", "content": config.data.system_prompt}] + messages
  return messages, None


def render(result: dict, decode) -> str:
  """The episode as text, each part marked with its kind, size and whether it trains."""
  lines = []
  for kind, ids in result["parts"]:
    trains = "trained" if kind == "model" else "not trained"
    lines.append(f"=== {kind}: {len(ids)} tokens, {trains} ===")
    lines.append(decode(ids))
  lines.append(
      f"=== {len(result['ids'])} tokens, {sum(result['mask'])} trained; ended: {result['ended']}"
      + (
          f"; {result['turns_ignored']} turns after the end ignored"
          if result["turns_ignored"]
          else ""
      )
      + f"; counts {json.dumps(result['counts'], sort_keys=True)} ==="
  )
  return "\n".join(lines)


def main(argv):
  del argv
  try:
    config = settings_of(flags.FLAGS.config)
    row, turns = read_transcript(flags.FLAGS.transcript)
    tokenizer = _tokenizer(config)
    result = replay(config, tokenizer, row, turns)
  except InputError as e:
    cli.fail("april_jax.replay", str(e))
  print(render(result, lambda ids: tokenizer.decode(ids, skip_special_tokens=False)))
  keys = ("ids", "mask", "messages", "tools")
  print(json.dumps({k: result[k] for k in keys}, ensure_ascii=False), flush=True)
  sys.stdout.flush()


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=cli.flags_parser("april_jax.replay", "april_jax.replay"))
