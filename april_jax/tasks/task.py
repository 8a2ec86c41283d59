"""What a run trains on, chosen by the config: a Task.

A Task bundles the prompt stream (checkpointable: state() / restore()), the evaluation
prompts, the reward and, where the task has reference answers, a supervised warm-start.
Two kinds exist, and the trainer treats them alike:
  the built-in task    data.source = "longtail": generated ring-walk prompts, held-out
                       ones for evaluation, the `longtail` reward, and reference answers
                       for the warm-start (train.sft_steps)
  a dataset            data.source = a .jsonl / .json / .parquet file: its prompts, the
                       prompts of eval.path for evaluation, the config's reward; no
                       reference responses, so no warm-start (refused at start-up)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

from absl import logging
import numpy as np

from april_jax import data as data_lib
from april_jax.data import PromptItem
from april_jax.rewards import loading as reward_loading
from april_jax.tasks import longtail as longtail_task
from april_jax.tokenizer import Tokenizer

Batch = tuple[np.ndarray, np.ndarray, np.ndarray]  # tokens, targets, loss mask [B, T]


@dataclasses.dataclass
class Task:
  prompts: Any  # () -> PromptItem; state() / restore()
  eval_items: Callable[[], list[PromptItem]]  # the evaluation prompts
  reward: Callable[[str, str], float]  # (response text, answer) -> reward
  warm_start: Callable[[], Iterator[Batch]] | None = None  # supervised batches, one a step


def make_task(config, tokenizer) -> Task:
  """The task of `config.data.source`, tokenized with `tokenizer`."""
  c = config
  if c.data.source == "longtail":
    return _builtin_task(c, tokenizer)
  return Task(
      prompts=data_lib.make_prompt_source(c.data, tokenizer, c.seed),
      eval_items=lambda: _file_items(c, tokenizer),
      reward=reward_loading.from_config(c.rollout),
  )


def _builtin_task(c, tokenizer) -> Task:
  t = c.data.task
  # Walks fill at most the ring; a longer cap leaves room for responses that miss the stop.
  task = longtail_task.LongTailTask(
      max_answer_len=min(c.rollout.max_response_len - 1, t.ring_size),
      median=t.median,
      sigma=t.sigma,
      ring_size=t.ring_size,
      hide_target=t.hide_target,
  )

  def eval_items():
    held_out = longtail_task.LongTailSource(task, tokenizer, seed=c.seed + 10_000)
    return [held_out() for _ in range(c.eval.num_prompts)]

  def warm_start():
    bs, seq_len = c.train.sft_batch_size, c.data.max_prompt_len + c.rollout.max_response_len
    for i in range(c.train.sft_steps):
      yield longtail_task.sft_batch(
          task,
          tokenizer,
          range(i * bs, (i + 1) * bs),
          seed=c.seed + 1,
          seq_len=seq_len,
          overshoot=t.demo_overshoot,
      )

  return Task(
      prompts=longtail_task.LongTailSource(task, tokenizer, c.seed),
      eval_items=eval_items if not c.eval.path else lambda: _file_items(c, tokenizer),
      reward=reward_loading.from_config(c.rollout),
      warm_start=warm_start,
  )


def _file_items(c, tokenizer) -> list[PromptItem]:
  """The first eval.num_prompts prompts of eval.path that fit data.max_prompt_len, in file
  order, each once (a file with fewer gives fewer; the skipped are logged)."""
  records, _ = data_lib.load_records(
      c.eval.path, c.data.prompt_key, c.data.answer_key, data_lib.line_budget(c.data.max_prompt_len)
  )
  source = data_lib.PromptIterator(
      records,
      tokenizer,
      c.data.max_prompt_len,
      seed=0,
      shuffle=False,
      system_prompt=c.data.system_prompt,
      enable_thinking=c.data.enable_thinking,
  )
  source.check_one_fits(c.eval.path)
  items, skipped = [], 0
  for record in records:  # once each: a file with fewer that fit gives fewer
    if len(items) == c.eval.num_prompts:
      break
    tokens = source.tokens(record)
    if len(tokens) > c.data.max_prompt_len:
      skipped += 1
      continue
    items.append(PromptItem(record["id"], tokens, record["answer"], row=record.get("row")))
  if skipped:
    logging.warning(
        "eval.path %s: %d prompts longer than data.max_prompt_len (%d) skipped; %d evaluated",
        c.eval.path,
        skipped,
        c.data.max_prompt_len,
        len(items),
    )
  return items


def load_tokenizer(config) -> Tokenizer:
  """The run's tokenizer alone (a split run's rollout process loads no weights)."""
  c = config
  if c.model.path:
    return Tokenizer.from_pretrained(c.model.tokenizer_path or c.model.path)
  return longtail_task.tokenizer(c.data.task.ring_size)
