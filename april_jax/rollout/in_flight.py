"""The batches a checkpoint holds that were drawn and not yet trained.

With the rollout on its own devices (rollout/async_rollout.py) the rollout runs ahead of
the learner: when update k is saved, batches k .. k + depth - 1 are drawn and wait. A
checkpoint keeps them beside the partial buffer, each sample's tokens, behaviour
logprobs and versions exactly, and a resumed run trains them first, in either mode or
colocated, so the continuation draws nothing twice and loses nothing.

Their groups go into the checkpoint's buffer arrays under the `waiting.` prefix (the
partial buffer's own format, rollout/buffer.py); which groups make each batch, which the
DAPO filter rejected, and each batch's rollout stats go in the host JSON.
"""

from __future__ import annotations

from april_jax.rollout.buffer import PartialBuffer
from april_jax.rollout.scheduler import RolloutResult

PREFIX = "waiting."


def to_state(results: list[RolloutResult]) -> tuple[dict, list[dict]]:
  """(arrays under PREFIX, the JSON that says which groups make which batch)."""
  if not results:
    return {}, []
  buffer = PartialBuffer()
  described = []
  for result in results:
    for group in result.groups + result.rejected:
      buffer.add(group)
    described.append(
        {
            "groups": [g.group_id for g in result.groups],
            "rejected": [g.group_id for g in result.rejected],
            "stats": {k: float(v) for k, v in result.stats.items()},
        }
    )
  arrays = {PREFIX + k: v for k, v in buffer.to_state().items()}
  return arrays, described


def from_state(arrays: dict, described: list[dict] | None) -> tuple[dict, list[RolloutResult]]:
  """(the partial buffer's own arrays, the waiting batches in order)."""
  own = {k: v for k, v in arrays.items() if not k.startswith(PREFIX)}
  if not described:
    return own, []
  waiting = PartialBuffer.from_state(
      {k[len(PREFIX) :]: v for k, v in arrays.items() if k.startswith(PREFIX)}
  )
  results = [
      RolloutResult(
          groups=[waiting.get(i) for i in d["groups"]],
          rejected=[waiting.get(i) for i in d["rejected"]],
          stats=dict(d["stats"]),
      )
      for d in described
  ]
  return own, results
