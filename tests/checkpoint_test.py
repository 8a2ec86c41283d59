"""Checkpoints set aside as damaged are kept, never replaced: a second damaged checkpoint of
the same step goes beside the first; saves a kill cut short are removed."""

import jax
import numpy as np
import pytest

from april_jax import checkpoint
from april_jax import errors
from april_jax.checkpoint import Checkpointer
from april_jax.errors import InputError


def _save(workdir, step, value):
  ckpt = Checkpointer(str(workdir))
  ckpt.save(step, {"x": jax.numpy.full((4,), value)}, {"ids": np.arange(3)}, {"step": step})
  ckpt.close()


def test_a_second_damaged_checkpoint_of_a_step_is_kept_beside_the_first(tmp_path):
  _save(tmp_path, 5, 1.0)
  first = Checkpointer(str(tmp_path)).set_aside(5)
  assert first == str(tmp_path / "damaged_checkpoints" / "5")
  (tmp_path / "damaged_checkpoints" / "5" / "note").write_text("looked at")
  _save(tmp_path, 5, 2.0)
  ckpt = Checkpointer(str(tmp_path))
  second = ckpt.set_aside(5)
  assert second == str(tmp_path / "damaged_checkpoints" / "5.2") and ckpt.steps() == []
  assert (tmp_path / "damaged_checkpoints" / "5" / "note").read_text() == "looked at"
  assert sorted(p.name for p in (tmp_path / "damaged_checkpoints").iterdir()) == ["5", "5.2"]


def test_a_file_where_damaged_checkpoints_go_is_one_clear_error(tmp_path):
  _save(tmp_path, 1, 1.0)
  (tmp_path / "damaged_checkpoints").write_text("not a folder")
  with pytest.raises(InputError, match="damaged_checkpoints is a file: move it away"):
    Checkpointer(str(tmp_path)).set_aside(1)
  assert Checkpointer(str(tmp_path)).steps() == [1]  # still where it was


def test_saves_cut_short_are_removed_and_committed_ones_kept(tmp_path):
  _save(tmp_path, 1, 1.0)
  cut = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1733"
  (cut / "state").mkdir(parents=True)
  (cut / "state" / "data").write_bytes(b"\0" * 1000)
  checkpoint.remove_unfinished(str(tmp_path))
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]
  assert Checkpointer(str(tmp_path)).steps() == [1]


def test_a_read_that_ran_out_of_memory_or_files_is_told_from_damage():
  """A restore that runs short of memory, files or quota leaves the checkpoint where it is
  (trainer.py); anything else about the read is damage."""
  try:
    try:
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB")
    except RuntimeError as inner:
      raise ValueError("error restoring item 'state'") from inner
  except ValueError as outer:
    assert errors.is_out_of_memory(outer)
  assert errors.is_out_of_memory(MemoryError())
  shape = ValueError("Requested shape (8,) is not compatible with the stored shape (4,)")
  assert not errors.is_out_of_memory(shape) and not errors.is_out_of_resources(shape)
  io_error = OSError(5, "Input/output error")
  assert not errors.is_out_of_memory(io_error) and not errors.is_out_of_resources(io_error)
  # Files or quotas, which tensorstore also reports as RESOURCE_EXHAUSTED: not memory.
  files = ValueError("RESOURCE_EXHAUSTED: Error opening file: Too many open files")
  assert not errors.is_out_of_memory(files) and errors.is_out_of_resources(files)
  assert errors.is_out_of_resources(OSError(24, "Too many open files"))
