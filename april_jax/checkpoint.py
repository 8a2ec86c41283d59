"""Orbax checkpoints in `workdir/checkpoints`: everything a resume needs, in one step dir.

  state   params, optimizer state (and reference params): sharded arrays, restored
          straight into the shardings the run uses
  buffer  the whole partial buffer as flat numpy arrays (KV included in mode kv)
  host    JSON: step, policy version, data position, scheduler counters, learner
          counters, the buffer's array shapes, the run's config and the step's metrics

A checkpoint that cannot be read (a truncated file, bad metadata) is moved to
`workdir/damaged_checkpoints/<step>` for inspection, and the one before is used.

Resume order (main.py): build model, learner and engine as for a fresh run, then, if a
checkpoint exists, replace params/optimizer state, the buffer, the data position and
the counters with the saved ones, and continue at step + 1.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


def _pack_buffer(buffer_state: dict[str, np.ndarray]):
  """Orbax refuses zero-size arrays: keep those as shapes in the JSON only."""
  arrays = {k: v for k, v in buffer_state.items() if v.size}
  specs = {k: [list(v.shape), str(v.dtype)] for k, v in buffer_state.items()}
  return arrays, specs


class Checkpointer:

  def __init__(self, workdir: str, max_to_keep: int = 3):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    )

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
    Only one process of a multi-host run moves it (`move`); every one forgets it."""
    target = os.path.join(os.path.dirname(self.directory), "damaged_checkpoints", str(step))
    if move:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      if os.path.exists(target):
        shutil.rmtree(target)
      shutil.move(os.path.join(self.directory, str(step)), target)
    self.manager.reload()
    return target

  def save(
      self, step: int, state: Any, buffer_state: dict[str, np.ndarray], host: dict[str, Any]
  ) -> None:
    arrays, specs = _pack_buffer(buffer_state)
    host = dict(host, buffer_specs=specs)
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
    restored = self.manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), buffer=ocp.args.StandardRestore(target)
        ),
    )
    buffer_state = {
        k: (np.asarray(restored.buffer[k]) if k in target else np.zeros(shape, dtype))
        for k, (shape, dtype) in specs.items()
    }
    return restored.state, buffer_state, host

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
