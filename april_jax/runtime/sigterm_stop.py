"""How SIGTERM stops a run: the request, the cut of a step's rollout, and what a rerun
resumes.

SIGTERM sets a flag (`handle`). The scheduler asks `cut_now` before each decode call and
cuts the step's rollout at once (what it drew stays in the partial buffer); a step that
finished is followed by a checkpoint and the run ends after it (`stop_after`). The
trainer records which happened (`save_cut` and `stop_during`, or `stop_after`), and
`line` says it after the run's summary.
"""

from __future__ import annotations

from absl import logging

from april_jax.runtime import distributed


class SigtermStop:
  """The stop a SIGTERM asks for, and how the run carried it out."""

  def __init__(self):
    self.requested = False
    self._polls = 0
    self.stopped = False  # the run stopped early (after saving)
    self.cut_step = None  # the step whose rollout was cut, if one was
    self.cut_drew = False  # whether the cut rollout drew a token first (the trainer's record)
    self.cut_saved = False  # whether its rollouts so far went into a checkpoint
    self.cut_before = None  # the newest checkpoint when it was cut
    self.stopped_after = None  # the step the run stopped after, if it finished one

  def handle(self, signum, frame) -> None:
    """The SIGTERM handler: asks for the stop."""
    del signum, frame
    logging.warning("SIGTERM: cutting this step's rollouts, saving a checkpoint, then exiting")
    self.requested = True

  def cut_now(self) -> bool:
    """Asked before each decode call: True once SIGTERM reached any process (agreed every
    few calls on several hosts, where it is a collective)."""
    if distributed.process_count() == 1:
      return self.requested
    self._polls += 1
    return self._polls % 8 == 0 and distributed.any_process(self.requested)

  def agreed(self) -> bool:
    """Whether any process was asked to stop: decided by every process alike, once per
    step (SIGTERM may reach only one). A collective on several hosts."""
    return distributed.any_process(self.requested)

  def save_cut(self, index: int, latest: int | None) -> bool:
    """Whether to save the state before the cut step (loop index `index`), with
    checkpoint `latest` the newest on disk: not when it is on disk already (checkpoint
    `index` is never replaced: a kill while the new one was written would lose both; the
    step's rollouts are drawn again on resume), nor for a fresh run's start that drew
    nothing."""
    fresh = index == 0 and latest is None and not self.cut_drew
    self.cut_before, self.cut_saved = latest, not (latest == index or fresh)
    return self.cut_saved

  def stop_during(self, step: int) -> None:
    """Records that the run stopped during step `step`, its cut saved if it had to be."""
    self.stopped, self.cut_step = True, step

  def stop_after(self, step: int) -> None:
    """Records that the run stopped after finishing step `step` (and saving it)."""
    self.stopped, self.stopped_after = True, step

  def line(self, num_steps: int) -> str | None:
    """What happened and what a rerun resumes; None if the run was not stopped."""
    n, cut = num_steps, self.cut_step
    if cut is not None and not self.cut_saved:
      before = self.cut_before
      kept = "nothing drawn yet" if before is None else f"checkpoint {before} is kept"
      line = f"stopped by SIGTERM during step {cut} of {n} ({kept}; its rollouts are drawn again)"
    elif cut is not None:
      line = (
          f"stopped by SIGTERM during step {cut} of {n}: its rollouts so far are kept in "
          f"checkpoint {cut - 1}"
      )
    elif self.stopped:
      step = self.stopped_after
      line = f"stopped by SIGTERM after step {step} of {n}: checkpoint {step} is saved"
    else:
      return None
    return f"{line}; rerun the same command to resume"
