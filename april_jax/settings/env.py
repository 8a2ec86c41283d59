"""The `env` section: a multi-turn environment (envs/), each sample an episode of model
turns and observations. Off when name is ""."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EnvSettings:
  name: str = ""  # a registered env ("calculator"), or path/to/env.py:Name or package.module:Name
  turn_stop: str = (
      ""  # also ends a turn, besides the end of a chat turn: one token, e.g. "</tool_call>"
  )
  max_turns: int = 8  # model turns per episode
  max_observation_tokens: int = 256  # each longer tool result is cut to this (counted)
  timeout_s: float = 10.0  # per call of the environment; past it the episode ends (counted)
  workers: int = 4  # environment calls made at once (a user's environment: worker processes)
  # How the tools that run model-written code (python_tool) isolate it: "kernel" (a
  # sandbox of Linux namespaces and a seccomp filter; the run refuses to start where the
  # kernel does not allow one) or "none" (the audit hook and rlimits only, which are not a
  # barrier: a warning at start-up and in the run's summary). docs/environments.md.
  isolation: str = "kernel"
  # Calls run while the other slots decode, each answered at the first decode boundary
  # after it returns; False: every call is waited for right after the decode call that
  # ended its turn (the engine idles on calls, but a run is reproducible whatever their
  # timing).
  overlap: bool = True
  # How an environment's answer is written after a turn: "chat_template" (tool messages
  # and the next generation prompt as the tokenizer's chat template renders them, thinking
  # as data.enable_thinking says) or "text" (the two fields below, for a tokenizer
  # without a chat template).
  observation_format: str = "text"
  # "text": the observation in this template, after close_turn when the turn ended on
  # turn_stop rather than on the end of a chat turn.
  observation_template: str = "{observation}"
  close_turn: str = ""  # "text": before the template when the turn ended on turn_stop
