"""Orbax checkpoints in `workdir/checkpoints`: everything a resume needs, in one step dir.

  state   params, optimizer state (and reference params): sharded arrays, restored
          straight into the shardings the run uses
  buffer  the whole partial buffer as flat numpy arrays (KV included in mode kv)
  host    JSON: step, policy version, data position, scheduler counters, learner
          counters, the buffer's array shapes, the run's config and the step's metrics

A checkpoint that cannot be read (a truncated file, bad metadata) is moved to
`workdir/damaged_checkpoints/<step>` for inspection (`<step>.2`, ... if that is taken:
nothing set aside is ever replaced), and the one before is used.

Resume order (trainer.py): build model, learner and engine as for a fresh run, then, if a
checkpoint exists, replace params/optimizer state, the buffer, the data position and
the counters with the saved ones, and continue. Checkpoint k holds the state after k
updates (steps count from 1, as the console, metrics.jsonl and export --step do).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from april_jax.errors import InputError


def remove_unfinished(workdir: str) -> None:
  """Deletes the folders of saves that never committed (after a failed write): they are
  never read, and they hold the room the next attempt needs."""
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  if os.path.isdir(directory):
    for name in os.listdir(directory):
      if ".orbax-checkpoint-tmp" in name:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def keep_aside(checkpoints: str, name: str) -> str:
  """A new path in `<workdir>/damaged_checkpoints` for `name`: `name`, else `name.2`,
  `name.3`, ... (never one already there). The folder is made if missing; a file in its
  place is an InputError."""
  aside = os.path.join(os.path.dirname(checkpoints), "damaged_checkpoints")
  if os.path.exists(aside) and not os.path.isdir(aside):
    raise InputError(f"{aside} is a file: move it away, so damaged checkpoints can be kept")
  os.makedirs(aside, exist_ok=True)
  target, n = os.path.join(aside, name), 1
  while os.path.lexists(target):
    n += 1
    target = os.path.join(aside, f"{name}.{n}")
  return target


def _folder_bytes(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        total += os.path.getsize(os.path.join(root, name))
      except OSError:
        pass
  return total


def _megabytes(n: float) -> str:
  return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _pack_buffer(buffer_state: dict[str, np.ndarray]):
  """Orbax refuses zero-size arrays: keep those as shapes in the JSON only."""
  arrays = {k: v for k, v in buffer_state.items() if v.size}
  specs = {k: [list(v.shape), str(v.dtype)] for k, v in buffer_state.items()}
  return arrays, specs


class Checkpointer:
  """A run's checkpoints. `read_only` (export, inspection) creates nothing on disk and
  refuses a workdir without checkpoints/ with FileNotFoundError. `alone`: this process
  writes and reads them without the run's other processes (a split run's learner, whose
  rollout's state reaches it as host arrays); arrays it holds whole go as numpy."""

  def __init__(
      self, workdir: str, max_to_keep: int = 3, read_only: bool = False, alone: bool = False
  ):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    if read_only and not os.path.isdir(self.directory):
      raise FileNotFoundError(f"no checkpoints/ folder in {os.path.abspath(workdir)}")
    self.alone = alone and jax.process_count() > 1
    processes = {}
    if self.alone:
      me = jax.process_index()
      processes = dict(
          multiprocessing_options=ocp.options.MultiprocessingOptions(
              primary_host=me, active_processes={me}
          )
      )
      if not read_only:
        os.makedirs(self.directory, exist_ok=True)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=not read_only and not self.alone,
        read_only=read_only,
        **processes,
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def steps(self) -> list[int]:
    """Every committed checkpoint, newest first."""
    return sorted(self.manager.all_steps(), reverse=True)

  def read_host(self, step: int) -> dict[str, Any]:
    """The host JSON of checkpoint `step` alone (no arrays are read)."""
    return self.manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore())).host

  def set_aside(self, step: int, move: bool = True) -> str:
    """Takes damaged checkpoint `step` out of the way (kept, for inspection); its new place.
    Only one process of a multi-host run moves it (`move`); every one forgets it. Nothing
    set aside before is replaced: a second damaged checkpoint `step` goes to `<step>.2`."""
    if move:
      target = keep_aside(self.directory, str(step))
      shutil.move(os.path.join(self.directory, str(step)), target)
    else:  # the mover's name for it, as far as this process can tell
      target = os.path.join(os.path.dirname(self.directory), "damaged_checkpoints", str(step))
    self.manager.reload()
    return target

  def room_problem(self, step: int, state: Any, buffer_state: dict[str, np.ndarray]) -> str | None:
    """What is wrong, in a line, if the disk cannot hold checkpoint `step` (else None):
    it needs about the size of the newest checkpoint (the arrays' own bytes for the first), with
    a tenth to spare. The older checkpoints are removed only once the new one commits,
    so the room must be there beside them."""
    latest = self.latest_step()
    if latest is not None:
      need = _folder_bytes(os.path.join(self.directory, str(latest)))
    else:
      leaves = jax.tree.leaves(state) + list(buffer_state.values())
      need = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)
    need = int(need * 1.1) + (1 << 20)
    self.manager.wait_until_finished()  # an earlier save still writing takes its room first
    free = shutil.disk_usage(self.directory).free
    if free < need:
      where = (
          f"checkpoint {latest} is the newest intact one"
          if latest is not None
          else ("no checkpoint was saved yet")
      )
      return (
          f"no room for checkpoint {step} in {self.directory}: it needs about "
          f"{_megabytes(need)}, {_megabytes(free)} is left ({where}); free some space and "
          "rerun the same command to resume"
      )
    return None

  def save(
      self, step: int, state: Any, buffer_state: dict[str, np.ndarray], host: dict[str, Any]
  ) -> None:
    arrays, specs = _pack_buffer(buffer_state)
    host = dict(host, buffer_specs=specs)
    if self.alone:  # Orbax writes no array one process holds whole in a multi-process run
      state = jax.tree.map(np.asarray, state)
    # Asynchronous: save returns once the arrays are copied off the devices (they may be
    # donated next) and writes on in the background; the next save or close() waits for
    # it. A checkpoint only counts once committed, so a kill mid-write resumes from the
    # one before.
    self.manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            buffer=ocp.args.StandardSave(arrays),
            host=ocp.args.JsonSave(host),
        ),
        force=True,
    )

  def restore(self, step: int, abstract_state: Any):
    """Returns (state in the shardings of abstract_state, buffer arrays, host JSON)."""
    host = self.read_host(step)
    specs = host["buffer_specs"]
    target = {
        k: np.zeros(shape, dtype) for k, (shape, dtype) in specs.items() if int(np.prod(shape))
    }
    wanted = abstract_state
    if self.alone:  # written as numpy (save): read so, then placed
      wanted = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_state)
    restored = self.manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(wanted), buffer=ocp.args.StandardRestore(target)
        ),
    )
    state = restored.state
    if self.alone:
      state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), state, abstract_state)
    buffer_state = {
        k: (np.asarray(restored.buffer[k]) if k in target else np.zeros(shape, dtype))
        for k, (shape, dtype) in specs.items()
    }
    return state, buffer_state, host

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """The params alone of checkpoint `step` (no optimizer state is read)."""
    target = {"params": abstract_params}
    args = ocp.args.PyTreeRestore(
        target,
        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True,
    )
    return self.manager.restore(step, args=ocp.args.Composite(state=args)).state["params"]

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs with the shardings of a live pytree (the restore target)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
