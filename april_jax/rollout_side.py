"""The rollout's half of a run: the engine, reward and episode runners, the APRIL
scheduler and the prompt stream (run_parts.make_rollout), and what the learner asks of
them at a boundary: an evaluation, the state a checkpoint keeps, a restore.

The trainer holds one where it draws itself (colocated, or the rollout on its own
devices in the same process); a split run's rollout process holds the only one
(rollout_server.py).
"""

from __future__ import annotations

from april_jax import run_parts
from april_jax.evaluation import evaluate
from april_jax.rollout import in_flight


class RolloutSide:
  """Built from the run's config; `params` None: the weights arrive later (split runs)."""

  def __init__(self, config, model_cfg, paths, params, tokenizer, task, place):
    self.config, self.task = config, task
    parts = run_parts.make_rollout(config, model_cfg, paths, params, tokenizer, task, place)
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
