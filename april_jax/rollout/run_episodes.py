"""A run's episode runner, made from its config's env section and its tokenizer."""

from __future__ import annotations

import functools
import sys
from typing import Any


from april_jax.runtime import distributed
from april_jax.envs import in_workers
from april_jax.envs import observation_format
from april_jax.rollout.episodes import EpisodeRunner
from april_jax.errors import InputError
from april_jax.tokenizer import TokenizerError

NO_ISOLATION = (
    "env.isolation=none: code the model writes runs under the audit hook and rlimits "
    "only, which are not a barrier (it can read the host's files and reach its processes)"
)


def runner_for(config, tokenizer: Any) -> tuple[EpisodeRunner | None, tuple[int, ...]]:
  """The environment's episode runner (env.name; None without one) and the token ids
  that end a turn besides the end of a chat turn (env.turn_stop). InputError, one line,
  for a turn stop of several tokens or an environment that cannot be made."""
  e = config.env
  if not e.name:
    return None, ()
  tok = tokenizer
  turn_stop_ids = ()
  if e.turn_stop:
    ids = tok.encode(e.turn_stop)
    if len(ids) != 1:
      raise InputError(
          f"env.turn_stop={e.turn_stop!r} is {len(ids)} tokens for this tokenizer; a turn "
          "stop must be one token"
      )
    turn_stop_ids = tuple(ids)
  try:
    env = in_workers.load(e.name, e.timeout_s, e.workers, options={"isolation": e.isolation})
  except in_workers.EnvError as problem:
    raise InputError(str(problem)) from None
  if e.isolation == "none" and distributed.process_index() == 0:
    print(f"april_jax: warning: {NO_ISOLATION}", file=sys.stderr, flush=True)
  try:
    observations = observation_format.from_config(e, tok, config.data.enable_thinking, tok.stop_ids)
  except (observation_format.ObservationFormatError, TokenizerError) as problem:
    raise InputError(str(problem)) from None
  runner = EpisodeRunner(
      env,
      tok.encode,
      lambda ids: tok.decode(ids, skip_special_tokens=False),
      e,
      end_of_turn_ids=tok.stop_ids,
      # Every process runs the same episodes: process 0's environment answers for all.
      agree=distributed.agree_json if distributed.process_count() > 1 else None,
      leader=distributed.process_index() == 0,
      render=functools.partial(  # reset's messages, rendered as the data's prompts are
          tok.apply_chat_template,
          add_generation_prompt=True,
          enable_thinking=config.data.enable_thinking,
          tokenize=True,
      ),
      observations=observations,
  )
  return runner, turn_stop_ids
