"""The rollout's half of a run: the engine, reward and episode runners, the APRIL
scheduler and the prompt stream (rollout/parts.py), and what the learner asks of them at
a boundary: an evaluation, the state a checkpoint keeps, a restore; and `make_rollout`,
the run's Rollout (rollout/base.py) over it.

The learner's process holds one where it draws itself (colocated, or the rollout on its
own devices in the same process); a split run's rollout process holds the only one
(rollout/server.py).
"""

from __future__ import annotations

from april_jax.rollout import in_flight
from april_jax.rollout import parts as rollout_parts
from april_jax.rollout.base import Rollout
from april_jax.rollout.channel import TO_LEARNER, TO_ROLLOUT, Channel
from april_jax.rollout.colocated import ColocatedRollout
from april_jax.rollout.evaluation import evaluate
from april_jax.rollout.remote_rollout import RemoteRollout
from april_jax.rollout.remote_weights import WeightServer
from april_jax.rollout.threaded import ThreadedRollout
from april_jax.runtime import distributed


class RolloutSide:
  """Built from the run's config; `params` None: the weights arrive later (split runs)."""

  def __init__(self, config, model_cfg, paths, params, tokenizer, task, place):
    self.config, self.task = config, task
    parts = rollout_parts.make_parts(config, model_cfg, paths, params, tokenizer, task, place)
    self.engine, self.rewards, self.scheduler = parts.engine, parts.rewards, parts.scheduler
    self.episodes, self.decode, self.publisher = parts.episodes, parts.decode, parts.publisher
    self.source = task.prompts  # every process reads all of the data: one stream

  def evaluate(self) -> dict[str, float]:
    """On the engine (empty between steps) and the params it holds."""
    c = self.config
    return evaluate(
        self.engine,
        self.task.eval_items(),
        self.rewards,
        k=c.eval.k,
        max_new_tokens=c.rollout.max_response_len,
        temperature=c.eval.temperature,
        top_p=c.eval.top_p,
        seed=c.seed,
        episodes=self.episodes,
    )

  def capture(self, waiting: list) -> tuple[dict, dict]:
    """What a checkpoint keeps of the rollout, taken where it stands still: the partial
    buffer with the batches drawn and not yet trained (`waiting`, rollout/in_flight.py),
    and as JSON the scheduler's counters, the data position and those batches' shape."""
    buffer, scheduler = self.scheduler.checkpoint()
    arrays, described = in_flight.to_state(waiting)
    host = {"scheduler": scheduler, "data": self.source.state(), "waiting": described}
    return {**buffer, **arrays}, host

  def restore(self, arrays: dict, host: dict) -> list:
    """Puts a checkpoint's rollout state back; the batches it holds drawn and not yet
    trained, oldest first."""
    buffer, waiting = in_flight.from_state(arrays, host.get("waiting"))
    self.scheduler.restore(buffer, host["scheduler"])
    self.source.restore(host["data"])
    return waiting

  def closers(self) -> list:
    """What to close at the run's end, in order."""
    return ([self.episodes.close] if self.episodes is not None else []) + [self.rewards.close]


def make_rollout(config, model_cfg, paths, tokenizer, task, place, stop) -> Rollout:
  """The run's Rollout, as its config places it: in another process (a split run across
  processes: this is the learner's), on a thread beside the learner (split meshes in one
  process), or colocated. stop: the run's SigtermStop."""
  if distributed.working_alone():
    return RemoteRollout(
        Channel(send_on=TO_ROLLOUT, receive_on=TO_LEARNER),
        lambda: WeightServer(
            distributed.coordinator_host(), place.mesh.devices.flat, place.rollout_mesh.devices.size
        ),
        cut_now=stop.cut_now,
    )
  side = RolloutSide(config, model_cfg, paths, None, tokenizer, task, place)
  if side.publisher is None:
    # One process alone may stop waiting for rewards at a stop; several wait alike.
    alone = distributed.process_count() == 1
    give_up = (lambda: stop.requested) if alone else None
    return ColocatedRollout(side, cut_now=stop.cut_now, give_up=give_up)
  r = config.rollout
  return ThreadedRollout(
      side,
      depth=0 if r.max_staleness == 0 else 1,
      in_flight=r.in_flight_updates,
      resume_mode=r.resume_mode,
      cut_now=stop.cut_now,
  )
