"""The lookup tool of the built-in task's multi-turn variant (env.name = "lookup").

The prompt `c:<from>=` does not say where the walk ends. A turn that is ':' alone asks
the tool, which answers with the target symbol and '=' (`<to>=`); any other turn is the
answer and ends the episode. Reward needs the call: without it the model can only guess
the walk's length. State: the target and the calls made.
"""

from __future__ import annotations

from april_jax.envs.base import EnvStep, register
from april_jax.tasks.longtail import LOOKUP_CALL, target_of


@register("lookup")
class LookupEnv:

  def reset(self, row: dict) -> dict:
    return {"target": target_of(row["answer"]), "calls": 0}

  def step(self, state: dict, turn: str) -> EnvStep:
    if turn.replace("<eos>", "").strip() != LOOKUP_CALL:
      return EnvStep(observation=None, done=True, state=state)
    state = {**state, "calls": state["calls"] + 1}
    return EnvStep(observation=state["target"] + "=", done=False, state=state)
