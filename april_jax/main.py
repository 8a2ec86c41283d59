"""The training entry point.

  python -m april_jax.main --config=configs/tiny.py --workdir=/tmp/april_tiny
  python -m april_jax.main --config=configs/qwen3_8b.py --workdir=runs/8b \
      --config.model.path=/models/Qwen3-8B --config.rollout.over_sampling_batch_size=64

Multi-host: the same command on every host, plus `--config.distributed.auto=True` under
SLURM (or coordinator_address, num_processes and process_id); see launch/ and README.md.

The config is validated before anything compiles; a wrong one exits with status 2 and a
message naming every bad field. A config whose memory plan (april_jax/plan.py) does not fit
the devices exits with status 3 and the numbers, before any weight is allocated. A process
of a multi-host run that loses a peer exits with status 4; one whose peers do not all
join within distributed.initialization_timeout_s says how many did and exits with 5. Rerunning with the same workdir
resumes from its latest checkpoint. SIGTERM cuts the current step's rollouts (kept in the
partial buffer), saves a checkpoint and exits with status 143 (a finished run: 0). Ctrl-C,
at any point, exits at once with one line and status 130, ending every worker process
(interrupt.py); the rerun resumes from the last checkpoint. A run whose every sample
fails the same way (its reward or environment) exits with status 2 (rollout/failures.py).
"""

if __name__ == "__main__":  # first of all, before jax loads: a Ctrl-C then is answered too
  from april_jax.runtime import interrupt  # pylint: disable=g-import-not-at-top

  interrupt.install()

import os
import sys
from typing import NoReturn
import warnings

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from april_jax import checkpoint
from april_jax import cli
from april_jax.runtime import distributed
from april_jax.runtime import process_tree
from april_jax.models import hf_io
from april_jax.settings.run import RunSettings
from april_jax.validation.checks import ConfigError, validate, validate_for_devices
from april_jax.errors import DiskFull, InputError, is_no_space
from april_jax.rollout import remote_rollout
from april_jax.rollout.server import LearnerEnded, RolloutServer
from april_jax.run.trainer import Trainer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/*.py).", lock_config=True
)
STOPPED_EXIT = 143  # 128 + SIGTERM: stopped by SIGTERM, checkpoint saved (finished: 0)

_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs go here.")
_TRACEBACK = flags.DEFINE_bool(
    "traceback", False, "With an error's one line, also print its traceback (and nothing more)."
)
flags.mark_flags_as_required(["config", "workdir"])


def _fail(message: str) -> NoReturn:
  """One line, status 2: how main reports bad input."""
  cli.fail("april_jax", message)


_parse_flags = cli.flags_parser("april_jax", "april_jax.main")  # one line, exit 2


def _leave_for_space(message: str) -> NoReturn:
  """A write that found no room: one line and status 2. The unfinished save is removed
  (it would never be read and holds room), and the process leaves at once, so the
  writers' own threads and exit handlers print nothing more."""
  checkpoint.remove_unfinished(_WORKDIR.value)
  print(f"april_jax: {message}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  process_tree.end_descendants()  # os._exit runs no atexit
  os._exit(2)  # pylint: disable=protected-access


def _no_space_message(error: BaseException) -> str:
  """The line for a write that failed for space past the run's own checks (in Orbax)."""
  logging.info("the write that found no room", exc_info=error)
  where = getattr(error, "filename", None)
  cause = " ".join(str(error).split())[:240]
  return (
      f"no space left on the device while writing the run's files"
      f"{f' ({where})' if where else ''}: {cause}; the newest committed checkpoint is "
      "intact: free some space and rerun the same command to resume"
  )


def _one_cache_warning(directory: str) -> None:
  """JAX warns once per program that the compilation cache cannot be written (a full
  disk); one line says it, and the run goes on compiling as it needs."""
  show, said = warnings.showwarning, []

  def showwarning(message, category, filename, lineno, file=None, line=None):
    if "persistent compilation cache" not in str(message):
      return show(message, category, filename, lineno, file, line)
    if not said:
      said.append(message)
      cause = str(message).rsplit(": ", 2)[-2:]
      print(
          f"april_jax: warning: the compilation cache in {directory} cannot be written "
          f"({': '.join(cause)}); the run goes on, compiling what it needs",
          file=sys.stderr,
          flush=True,
      )
    return None

  warnings.showwarning = showwarning


def _use_compilation_cache(config, workdir: str) -> None:
  """Points XLA's persistent compilation cache at config.compilation_cache_dir."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return  # the environment's choice
  directory = config.compilation_cache_dir
  if directory is None:
    directory = os.path.join(workdir, "xla_cache")
  if directory:
    jax.config.update("jax_compilation_cache_dir", directory)
    _one_cache_warning(directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def _model_shape(config):
  """The model's config where it can be read now (its heads for the split's checks); None
  where it cannot (the run's start says why)."""
  try:
    return hf_io.model_config(config)
  except Exception:  # pylint: disable=broad-except
    return None


def _split_across_processes(config) -> bool:
  """For a split run whose sides are on different processes: each process runs its own
  side's loop from here on (distributed.work_alone). True on the rollout's process."""
  try:
    sides = distributed.split_sides(config.mesh.rollout_devices)
  except ValueError as e:
    _fail(str(e))
  if sides is None:
    return False
  learner, rollout = sides
  if len(learner) > 1 or len(rollout) > 1:
    _fail(
        f"mesh.rollout_devices={config.mesh.rollout_devices} puts the learner on "
        f"{len(learner)} processes and the rollout on {len(rollout)}: a split run across "
        "processes gives each side one process (docs/async.md)"
    )
  distributed.work_alone()
  return jax.process_index() in rollout


def _train(settings: RunSettings) -> bool:
  """The run (a split run's learner); whether SIGTERM stopped it."""
  trainer = None
  try:
    try:
      trainer = Trainer(settings, _WORKDIR.value)
    except MemoryError as e:  # the start-up memory plan refused the config
      print(f"april_jax: {e}", file=sys.stderr)
      sys.exit(3)
    trainer.run()
  except BaseException:
    if distributed.working_alone() and trainer is None:  # (a Trainer's close tells it)
      try:  # its rollout's process waits for a start that never comes
        remote_rollout.abandon()
      except Exception:  # pylint: disable=broad-except  # the error being raised says more
        logging.info("could not tell the rollout's process to close", exc_info=True)
    raise
  return trainer.stopped


def _serve_rollout(settings: RunSettings) -> bool:
  """A split run's rollout process; whether a stop ended it early."""
  server = RolloutServer(settings, _WORKDIR.value, host="0.0.0.0")
  try:
    server.run()
  except LearnerEnded as e:
    print(f"april_jax: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
  return server.stopped


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    settings = validate(_CONFIG.value)  # the config file and its flags, read once
  except ConfigError as e:
    print(f"april_jax: {e}", file=sys.stderr)
    sys.exit(2)
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # progress lines go to stdout; libraries stay quiet
  try:
    distributed.initialize(settings.distributed)  # before anything touches a device
  except distributed.PeersMissing as e:
    print(f"april_jax: {e}", file=sys.stderr, flush=True)
    sys.exit(distributed.PEERS_MISSING_EXIT)
  _use_compilation_cache(settings, _WORKDIR.value)
  try:
    validate_for_devices(settings, jax.device_count(), _model_shape(settings))
  except ConfigError as e:
    print(f"april_jax: {e}", file=sys.stderr)
    sys.exit(2)
  logging.info("settings: %s", settings)
  serving = _split_across_processes(settings)
  try:
    stopped = _serve_rollout(settings) if serving else _train(settings)
    if stopped:
      sys.exit(STOPPED_EXIT)
  except InputError as e:  # a file, field, flag or workdir the user can fix: one line
    logging.info("traceback of the error below", exc_info=True)
    if _TRACEBACK.value:
      import traceback  # pylint: disable=g-import-not-at-top

      traceback.print_exc()
    if isinstance(e, DiskFull):
      _leave_for_space(str(e))
    print(f"april_jax: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  except Exception as e:  # pylint: disable=broad-except
    if is_no_space(e):
      _leave_for_space(_no_space_message(e))
    if not distributed.is_collective_failure(e):
      raise
    import traceback  # pylint: disable=g-import-not-at-top

    traceback.print_exc()
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(
        f"april_jax: process {jax.process_index()} of {jax.process_count()}: a collective "
        f"failed, most likely because another process died ({first_line}). Restart all "
        "processes to resume from the last checkpoint.",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    process_tree.end_descendants()  # os._exit runs no atexit
    os._exit(distributed.PEER_FAILURE_EXIT)  # skip the shutdown barrier: the peer is gone


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
