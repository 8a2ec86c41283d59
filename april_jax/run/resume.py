"""Which checkpoint a run resumes from: the newest intact one of the same config and model.

  step, arrays, buffer, host = resume.newest_intact(checkpointer, config, model_cfg, target)

Newest first, each checkpoint is judged: its host JSON must read; its config may differ
only in what a resume may change, and its model must have the run's architecture (both
refused in one line, nothing moved: validation/resume.py); then its arrays are read
into `target`'s shardings. A checkpoint whose files cannot be read is damaged: it is
moved to `<workdir>/damaged_checkpoints/<step>` (by the primary process, once every
process came through its read) with a one-line warning naming what could not be read,
and the one before is tried. A read that failed for the machine's limits (memory, open
files, a quota) moves nothing and stops the run (MemoryError: exit 3; InputError: 2).
No intact checkpoint at all is an InputError.

A failed read leaves Orbax's coroutines and asyncio tasks holding its error, which Python
and asyncio would print to stderr when they are collected, then or any time later, from
Orbax's threads: after a failed read they go to the log for the rest of the run.
"""

from __future__ import annotations

import gc
import logging as std_logging
import sys
from typing import Any

from absl import logging

from april_jax.runtime import distributed
from april_jax import errors
from april_jax.checkpoint import Checkpointer
from april_jax.validation import resume as resume_check
from april_jax.errors import InputError, is_out_of_memory, is_out_of_resources


def newest_intact(
    checkpointer: Checkpointer, config, model_cfg, target: Any, primary: bool = True
) -> tuple[int, Any, dict, dict]:
  """(step, arrays, buffer arrays, host JSON) of the newest intact checkpoint; see the
  module docstring. `target`: the abstract arrays to restore into."""
  hook, aio = sys.unraisablehook, std_logging.getLogger("asyncio")
  aio_level = aio.level
  sys.unraisablehook = lambda u: logging.info("checkpoint read: %s", u.exc_value)
  aio.setLevel(std_logging.CRITICAL)
  damaged: list[str] = []
  try:
    return _judge_each(checkpointer, config, model_cfg, target, primary, damaged)
  finally:
    gc.collect()
    if not damaged:  # nothing failed: nothing is left to collect
      sys.unraisablehook = hook
      aio.setLevel(aio_level)


def _judge_each(checkpointer, config, model_cfg, target, primary, damaged):
  for step in checkpointer.steps():
    try:
      host = checkpointer.read_host(step)
    except Exception as e:  # pylint: disable=broad-except
      damaged.append(_set_aside(checkpointer, step, e, primary))
      continue
    resume_check.check_resumable(host.get("config"), config, step, checkpointer.directory)
    resume_check.check_same_model(host.get("model"), model_cfg, step, checkpointer.directory)
    try:
      restored, failure = _read_quietly(checkpointer, step, target), None
    except Exception as e:  # pylint: disable=broad-except
      restored, failure = None, e
      _refuse_if_short_of_resources(checkpointer, step, e)
    # Set aside only when every process came through its read (a peer that died, e.g. of
    # memory, fails this collective: exit 4, and nothing is moved).
    if distributed.any_process(failure is not None):
      failure = failure or RuntimeError("a peer's read failed")
      damaged.append(_set_aside(checkpointer, step, failure, primary))
      continue
    return (step, *restored)
  raise InputError(
      f"no intact checkpoint in {checkpointer.directory}: every one is damaged (kept in "
      f"{', '.join(damaged)}); running again starts this run afresh, keeping its "
      "metrics beside them"
  )


def _read_quietly(checkpointer: Checkpointer, step: int, target: Any):
  """Checkpoint step's arrays, buffer and host JSON; a read error is raised, not logged
  (Orbax logs its traceback itself)."""
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.FATAL)
  try:
    return checkpointer.restore(step, target)
  finally:
    gc.collect()  # what a failed read left, while its loggers are quiet
    logging.set_verbosity(verbosity)


def _refuse_if_short_of_resources(checkpointer: Checkpointer, step: int, error: Exception) -> None:
  """A read that failed for the machine's size or limits, not the files: nothing is set
  aside; out of memory exits 3 (main), other limits (open files, a quota) 2."""
  if not is_out_of_resources(error):
    return
  cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
  where = f"checkpoint {step} of {checkpointer.directory}"
  advice = (
      "nothing was set aside; if it fails so again where the resources suffice, move "
      f"checkpoints/{step} out of the workdir to resume from the one before"
  )
  if is_out_of_memory(error):
    raise MemoryError(f"restoring {where} ran out of memory ({cause}); {advice}") from error
  raise InputError(f"restoring {where} ran short of resources ({cause}); {advice}") from error


def _set_aside(checkpointer: Checkpointer, step: int, error: Exception, primary: bool) -> str:
  """Moves damaged checkpoint `step` aside (the primary process) with one line; its place."""
  where = checkpointer.set_aside(step, move=primary)
  logging.info("checkpoint %d is damaged", step, exc_info=error)  # the traceback, in the log
  if primary:  # the mover, who knows the name it chose
    print(
        f"april_jax: warning: checkpoint {step} is damaged ({errors.cause_line(error)}); "
        f"kept in {where}; trying the one before",
        file=sys.stderr,
        flush=True,
    )
  return where
